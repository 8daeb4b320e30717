"""Time and achieved bandwidth of `ring_attention` as windows fill, against a measured device-to-device copy.

    python benchmarks/ring_attention.py            # Voxtral shapes on the present accelerator
    python benchmarks/ring_attention.py --quick    # small shapes, minutes on a CPU
    python benchmarks/ring_attention.py --implementations xla --sessions 8 32 --no-prefill   # CPU, real shapes
    python benchmarks/ring_attention.py --shapes decoder-mid encoder-mid --sessions 8 32   # CPU: C++ kernel vs XLA
    git show HEAD:tpu_kernels/ring_attention/xla.py > /tmp/xla_before.py
    python benchmarks/ring_attention.py --implementations xla --baseline /tmp/xla_before.py   # before/after

Every case runs at three fills side by side: nearly empty (the first `--early` positions of a stream, 125
by default: 10 s of Voxtral decoder slots), half a window and full (a session past a wrap-around). A
kernel whose cost follows the filled positions is much faster at the first two than at the third.
Bytes per call are what an ideal kernel must move: the K and V pages that hold positions inside the
window of each session (as `positions.visible_pages` counts them), the new K/V rows written, q and the
output. Bandwidth = bytes / median time per call; "% copy" compares the full window's with a jitted copy
of a large array (read + write). Every call donates the pages and feeds the returned pages to the next
call, as the engine does, so writes happen in place. The implementations of one case (and `--baseline`,
another `ring_attention_xla` loaded from a file) are timed alternately, call by call, so their ratio is
measured under the same machine load.
"""
import argparse
import dataclasses
import functools
import importlib.util
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream import allocator
from jaxstream.tpu_kernels.ring_attention import api, positions

FILLS = ("early", "half", "full")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    kv_heads: int
    group: int
    head_dim: int
    window: int
    page_size: int


FULL_SHAPES = (Shape("decoder", kv_heads=8, group=4, head_dim=128, window=8192, page_size=256),
               Shape("encoder", kv_heads=32, group=1, head_dim=64, window=750, page_size=128))
# The random mid-size Voxtral of benchmarks/vs_transformers.py (real windows, small heads): CPU-sized.
MID_SHAPES = (Shape("decoder-mid", kv_heads=2, group=4, head_dim=64, window=8192, page_size=64),
              Shape("encoder-mid", kv_heads=4, group=1, head_dim=64, window=750, page_size=64))
QUICK_SHAPES = (Shape("decoder-mini", kv_heads=2, group=4, head_dim=128, window=512, page_size=64),
                Shape("encoder-mini", kv_heads=4, group=1, head_dim=64, window=96, page_size=32))


def fill_length(shape, fill, early):
    """Positions written before the call: `early` (at most a quarter window), half a window, or past a wrap."""
    return {"early": min(early, shape.window // 4), "half": shape.window // 2, "full": shape.window * 3 + 5}[fill]


def timed_alternately(functions, reps):
    """Median seconds per call of each `function()` (returning arrays), after one warm-up call each; the
    functions take turns, so a change of machine load hits all of them alike."""
    for function in functions:
        jax.block_until_ready(function())
    samples = [[] for _ in functions]
    for _ in range(reps):
        for function, times in zip(functions, samples):
            start = time.perf_counter()
            jax.block_until_ready(function())
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def copy_gbps(num_bytes, reps):
    """GB/s of a jitted elementwise copy: a fresh output buffer, one full read and one full write."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(jnp.negative)  # Unlike x * 1 or x + 0, never folded away.
    return 2 * x.nbytes / timed_alternately([lambda: copy(x)], reps)[0] / 1e9


def load_baseline(path):
    """`ring_attention_xla` of another copy of xla.py (e.g. an earlier commit's), for before/after runs."""
    spec = importlib.util.spec_from_file_location("ring_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ring_attention_xla


def stepper(implementation, shape, interpret, baseline):
    """A jitted call with donated pages: the named implementation through the API, or the baseline."""
    if implementation == "baseline":
        function = functools.partial(baseline, window=shape.window)
    else:
        function = functools.partial(api.ring_attention, window=shape.window, implementation=implementation,
                                     interpret=interpret)
    return jax.jit(function, donate_argnames=("k_pages", "v_pages"))


def run_case(shape, implementations, sessions, chunk, fill, dtype, reps, *, early, interpret, baseline, seed=0):
    """Rows (one per implementation) of one (shape, sessions, chunk, fill) case, timed alternately."""
    pages_per_window = -(-shape.window // shape.page_size)
    num_pages = 1 + sessions * pages_per_window
    length = fill_length(shape, fill, early)
    key_q, key_k, key_v, key_new = jax.random.split(jax.random.key(seed), 4)
    pool_shape = (num_pages, shape.kv_heads, shape.page_size, shape.head_dim)
    q = jax.random.normal(key_q, (sessions, chunk, shape.kv_heads * shape.group, shape.head_dim), dtype)
    k_new = jax.random.normal(key_new, (sessions, chunk, shape.kv_heads, shape.head_dim), dtype)
    rng = np.random.default_rng(seed)
    page_table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(sessions, pages_per_window), jnp.int32)
    lengths = jnp.full((sessions,), length, jnp.int32)
    num_new = jnp.full((sessions,), chunk, jnp.int32)

    def caller(implementation):
        step = stepper(implementation, shape, interpret and implementation != "xla", baseline)
        pages = [jax.random.normal(key_k, pool_shape, dtype), jax.random.normal(key_v, pool_shape, dtype)]

        def call():
            out, pages[0], pages[1] = step(q, k_new, k_new, pages[0], pages[1], page_table, lengths, num_new)
            return out
        return call

    seconds = timed_alternately([caller(name) for name in implementations], reps)
    _, visited = positions.visible_pages(lengths, num_new, shape.window, shape.page_size, pages_per_window)
    row_bytes = shape.kv_heads * shape.head_dim * jnp.dtype(dtype).itemsize
    moved = 2 * int(jnp.sum(visited)) * shape.page_size * row_bytes + 2 * sessions * chunk * row_bytes + 2 * q.nbytes
    return [dict(shape=shape.name, window=shape.window, implementation=name, sessions=sessions, chunk=chunk,
                 fill=fill, length=length, dtype=jnp.dtype(dtype).name, ms=s * 1e3, bytes=moved, gbps=moved / s / 1e9)
            for name, s in zip(implementations, seconds)]


def markdown(rows, copy_rate):
    """One line per (shape, implementation, S, C): time and bandwidth at each fill side by side."""
    by_case = {}
    for r in rows:
        by_case.setdefault((r["shape"], r["implementation"], r["sessions"], r["chunk"]), {})[r["fill"]] = r
    lines = [f"copy bandwidth: {copy_rate:.1f} GB/s", "",
             "| shape | impl | S | C | " + " | ".join(f"ms {f}" for f in FILLS) + " | "
             + " | ".join(f"GB/s {f}" for f in FILLS) + " | % copy full |",
             "| --- | --- | ---: | ---: |" + " ---: |" * (2 * len(FILLS) + 1)]
    for (shape, implementation, sessions, chunk), fills in by_case.items():
        cells = [f"{fills[f]['ms']:.3f} (L={fills[f]['length']})" if f in fills else "" for f in FILLS]
        cells += [f"{fills[f]['gbps']:.1f}" if f in fills else "" for f in FILLS]
        cells.append(f"{100 * fills['full']['gbps'] / copy_rate:.0f}" if "full" in fills else "")
        lines.append(f"| {shape} | {implementation} | {sessions} | {chunk} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and batches (CPU)")
    parser.add_argument("--shapes", nargs="+",
                        help="only these shapes (decoder, encoder, or their -mid and -mini versions)")
    parser.add_argument("--implementations", nargs="+", choices=api.IMPLEMENTATIONS,
                        help="default: the dispatcher's choice on this backend, and xla")
    parser.add_argument("--baseline", metavar="XLA_PY", help="also time `ring_attention_xla` from this file (e.g. "
                        "`git show HEAD:tpu_kernels/ring_attention/xla.py`), alternating with the others")
    parser.add_argument("--interpret", action="store_true", help="run Pallas implementations in the interpreter")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="default: bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--sessions", type=int, nargs="+", help="decode batch sizes (default 1 8 64 256; quick 1 8)")
    parser.add_argument("--no-prefill", action="store_true", help="decode (C = 1) only")
    parser.add_argument("--early", type=int, default=125, help="positions of the nearly-empty fill (default 125)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case (default 20, quick 5)")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if argv is None:  # a process of its own: on the allocator the jaxstream commands use
        allocator.reexecute_with_tcmalloc()

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    reps = args.reps or (5 if args.quick else 20)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    if args.shapes:
        shapes = [s for s in FULL_SHAPES + MID_SHAPES + QUICK_SHAPES if s.name in args.shapes]
    session_counts = args.sessions or ((1, 8) if args.quick else (1, 8, 64, 256))
    prefill_sessions = () if args.no_prefill else ((1, 8) if args.quick else (1, 8, 64))
    if args.implementations:
        implementations = list(args.implementations)
    else:
        probe = jax.ShapeDtypeStruct((1, shapes[0].kv_heads, shapes[0].page_size, shapes[0].head_dim), dtype)
        implementations = sorted({api.choose_implementation(probe), "xla"})
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        implementations.append("baseline")

    copy_rate = copy_gbps((64 if args.quick else 1024) * 2**20, reps)
    print(f"jax {jax.__version__}, backend {backend} ({jax.devices()[0].device_kind}), {dtype.name}", file=sys.stderr)
    rows = []
    for shape in shapes:
        cases = [(s, 1) for s in session_counts] + [(s, c) for s in prefill_sessions for c in (16, 64)]
        for sessions, chunk in cases:
            for fill in FILLS:
                for row in run_case(shape, implementations, sessions, chunk, fill, dtype, reps, early=args.early,
                                    interpret=args.interpret, baseline=baseline):
                    print(f"{row['shape']} {row['implementation']} S={sessions} C={chunk} {fill} (L={row['length']}): "
                          f"{row['ms']:.3f} ms, {row['gbps']:.1f} GB/s", file=sys.stderr)
                    rows.append(row)
    print(markdown(rows, copy_rate))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, jax=jax.__version__,
                           copy_gbps=copy_rate, baseline=args.baseline, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
