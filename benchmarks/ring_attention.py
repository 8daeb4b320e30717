"""Achieved bandwidth of `ring_attention` against a measured device-to-device copy.

    python benchmarks/ring_attention.py            # Voxtral shapes on the present accelerator
    python benchmarks/ring_attention.py --quick    # small shapes, minutes on a CPU
    python benchmarks/ring_attention.py --json out.json --implementations pallas_tpu xla

Bytes per call are what an ideal kernel must move: the K and V pages that hold positions inside the
window of each session (as `positions.visible_pages` counts them), the new K/V rows written, q and the
output. Bandwidth = bytes / median time per call; "% copy" compares it with a jitted copy of a large
array (read + write). Every call donates the pages and feeds the returned pages to the next call, as
the engine does, so writes happen in place. Decode (C = 1) runs with full windows (sessions past a
wrap-around) and half-full windows; chunked prefill (C in 16, 64) with full windows.
"""
import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.tpu_kernels.ring_attention import api, positions


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
QUICK_SHAPES = (Shape("decoder-mini", kv_heads=2, group=4, head_dim=128, window=512, page_size=64),
                Shape("encoder-mini", kv_heads=4, group=1, head_dim=64, window=96, page_size=32))


def timed(function, reps):
    """Median seconds per call of `function()` (which returns arrays) after one warm-up call."""
    jax.block_until_ready(function())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(function())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_gbps(num_bytes, reps):
    """GB/s of a jitted elementwise copy: a fresh output buffer, one full read and one full write."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(jnp.negative)  # Unlike x * 1 or x + 0, never folded away.
    return 2 * x.nbytes / timed(lambda: copy(x), reps) / 1e9


def run_case(shape, implementation, interpret, sessions, chunk, fill, dtype, reps, seed=0):
    pages_per_window = -(-shape.window // shape.page_size)
    num_pages = 1 + sessions * pages_per_window
    length = shape.window * 3 + 5 if fill == "full" else shape.window // 2
    key_q, key_k, key_v, key_new = jax.random.split(jax.random.key(seed), 4)
    pool_shape = (num_pages, shape.kv_heads, shape.page_size, shape.head_dim)
    k_pages = jax.random.normal(key_k, pool_shape, dtype)
    v_pages = jax.random.normal(key_v, pool_shape, dtype)
    q = jax.random.normal(key_q, (sessions, chunk, shape.kv_heads * shape.group, shape.head_dim), dtype)
    k_new = jax.random.normal(key_new, (sessions, chunk, shape.kv_heads, shape.head_dim), dtype)
    rng = np.random.default_rng(seed)
    page_table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(sessions, pages_per_window), jnp.int32)
    lengths = jnp.full((sessions,), length, jnp.int32)
    num_new = jnp.full((sessions,), chunk, jnp.int32)

    step = jax.jit(functools.partial(api.ring_attention, window=shape.window, implementation=implementation,
                                     interpret=interpret), donate_argnames=("k_pages", "v_pages"))
    pages = [k_pages, v_pages]

    def call():
        out, pages[0], pages[1] = step(q, k_new, k_new, pages[0], pages[1], page_table, lengths, num_new)
        return out

    seconds = timed(call, reps)
    _, visited = positions.visible_pages(lengths, num_new, shape.window, shape.page_size, pages_per_window)
    row_bytes = shape.kv_heads * shape.head_dim * jnp.dtype(dtype).itemsize
    kv_read = 2 * int(jnp.sum(visited)) * shape.page_size * row_bytes
    kv_written = 2 * sessions * chunk * row_bytes
    q_and_out = 2 * q.nbytes
    return dict(shape=shape.name, implementation=implementation, sessions=sessions, chunk=chunk, fill=fill,
                dtype=jnp.dtype(dtype).name, ms=seconds * 1e3, bytes=kv_read + kv_written + q_and_out,
                gbps=(kv_read + kv_written + q_and_out) / seconds / 1e9)


def markdown(rows, copy_rate):
    lines = [f"copy bandwidth: {copy_rate:.1f} GB/s", "",
             "| shape | impl | S | C | window | ms/call | MB moved | GB/s | % copy |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['implementation']} | {r['sessions']} | {r['chunk']} | {r['fill']} | "
                     f"{r['ms']:.3f} | {r['bytes'] / 1e6:.2f} | {r['gbps']:.1f} | {100 * r['gbps'] / copy_rate:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and batches (CPU)")
    parser.add_argument("--implementations", nargs="+", choices=api.IMPLEMENTATIONS,
                        help="default: the dispatcher's choice on this backend, and xla")
    parser.add_argument("--interpret", action="store_true", help="run Pallas implementations in the interpreter")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="default: bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case (default 20, quick 5)")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    reps = args.reps or (5 if args.quick else 20)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    session_counts = (1, 8) if args.quick else (1, 8, 64, 256)
    prefill_sessions = (1, 8) if args.quick else (1, 8, 64)
    if args.implementations:
        implementations = args.implementations
    else:
        probe = jax.ShapeDtypeStruct((1, shapes[0].kv_heads, shapes[0].page_size, shapes[0].head_dim), dtype)
        implementations = sorted({api.choose_implementation(probe), "xla"})

    copy_rate = copy_gbps((64 if args.quick else 1024) * 2**20, reps)
    print(f"jax {jax.__version__}, backend {backend} ({jax.devices()[0].device_kind}), {dtype.name}", file=sys.stderr)
    rows = []
    for shape in shapes:
        cases = [(s, 1, fill) for s in session_counts for fill in ("full", "half")]
        cases += [(s, c, "full") for s in prefill_sessions for c in (16, 64)]
        for implementation in implementations:
            interpret = args.interpret and implementation != "xla"
            for sessions, chunk, fill in cases:
                row = run_case(shape, implementation, interpret, sessions, chunk, fill, dtype, reps)
                print(f"{row['shape']} {implementation} S={sessions} C={chunk} {fill}: {row['ms']:.3f} ms, "
                      f"{row['gbps']:.1f} GB/s", file=sys.stderr)
                rows.append(row)
    print(markdown(rows, copy_rate))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, jax=jax.__version__,
                           copy_gbps=copy_rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
