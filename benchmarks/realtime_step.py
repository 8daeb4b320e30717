"""Cost of one realtime transcription dispatch: the compiled decode program of B rows and K steps, called
alone (no scheduler, no front end) at a given fill of every row's windows.

    python benchmarks/realtime_step.py --model /tmp/vt_mid --rows 32 --steps 1,16 --fill 40,125,375
    python benchmarks/realtime_step.py --model /tmp/vt_mid --rows 32 --steps 1 --fill 125 --profile 20

`--fill N`: every row has N decoder positions (N x 80 ms of audio) and 4N encoder frames behind it, so the
attention reads what a stream of that age reads (the reach buckets follow the longest filled length).
Paced real-time streams run K = 1 dispatches; a stream behind real time (or `jaxstream bench --fast`)
runs several steps per dispatch, which reads each row's keys once for K steps. Reports the median time per
call, per 80 ms step, and how many streams of that age one device keeps at real time by this program alone
(rows x 80 ms / time per step; the host's work and the prefills come on top), and the process's minor page
faults and kernel CPU time per call. `--profile N` lists the N costliest XLA operations of the last case by
thread time (JAX operation and output shape).
"""
import argparse
import resource
import statistics
import sys
import time

import jax
import numpy as np

from jaxstream import allocator
from jaxstream.engine import steps
from jaxstream.engine.builders import build_realtime_core
from jaxstream.engine.config import EngineConfig
from jaxstream.models import loading
from jaxstream.models.audio import SLOT_SECONDS
from train_step import thread_time_by_operation


def filled_batch(core, rows: int, num_steps: int, fill: int, rng) -> dict:
    """A decode batch of `rows` live rows, each with `fill` positions behind it in its own pages."""
    cfg = core.model_cfg
    enc, dec = core.cache.specs["encoder"], core.cache.specs["decoder"]
    batch = steps.realtime_batch(rows, num_steps, cfg, enc.pages_per_window, dec.pages_per_window, with_tokens=False)
    batch["slot"][:] = np.arange(rows)
    batch["num_slots"][:] = num_steps
    batch["dec_lengths"][:] = fill
    batch["mel"][:] = rng.standard_normal(batch["mel"].shape)
    for name, key in (("encoder", "enc_table"), ("decoder", "dec_table")):
        per_row = core.cache.specs[name].pages_per_window
        capacity = core.cache.pools[name].capacity  # page 0 is the null page
        batch[key][:] = np.arange(rows * per_row).reshape(rows, per_row) % (capacity - 1) + 1
    return batch


def page_faults_and_system_time(before: resource.struct_rusage, calls: int) -> tuple[float, float]:
    """Minor page faults and kernel CPU seconds per call since `before` (this process, every thread).

    With glibc's malloc a K = 1 call of the mid model at 24 rows faulted ~9,600 times (its gathered encoder
    window, 37 MB, in fresh pages at every call) and spent 17-19 ms of its ~80 in the kernel. The script runs
    on TCMalloc when it is installed, as the `jaxstream` commands do (jaxstream/allocator.py);
    JAXSTREAM_ALLOCATOR=system measures glibc's malloc."""
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_minflt - before.ru_minflt) / calls, (after.ru_stime - before.ru_stime) / calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model name or directory (default: the embedded tiny)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", default="1,16", help="steps per dispatch, comma-separated")
    parser.add_argument("--fill", default="40,125,375", help="decoder positions behind each row, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N costliest operations of the last case by thread time")
    args = parser.parse_args(argv)
    if argv is None:  # a process of its own: on the allocator the jaxstream commands use
        allocator.reexecute_with_tcmalloc()
    step_counts = [int(k) for k in args.steps.split(",")]
    fills = [int(n) for n in args.fill.split(",")]

    directory = loading.resolve_model_dir(args.model)
    loaded = loading.load_model(directory, dtype="float32")
    tokenizer = loading.load_checkpoint_tokenizer(directory, loaded.tokenizer_path)
    config = EngineConfig(max_sessions=args.rows, batch_buckets=(args.rows,), realtime_step_buckets=tuple(step_counts),
                          realtime_prefill_buckets=((1, 16),), cache_silent_prefix=False)
    core = build_realtime_core(loaded.model, config, tokenizer)
    rng = np.random.default_rng(0)
    print(f"{args.model}: {args.rows} rows on {jax.devices()[0].device_kind}")
    print(f"{'K':>3} {'fill':>5} {'ms/call':>9} {'ms/step':>9} {'streams at real time':>21} {'faults/call':>12} "
          f"{'sys ms/call':>12}")
    for num_steps in step_counts:
        for fill in fills:
            key, batch = ("decode", args.rows, num_steps), filled_batch(core, args.rows, num_steps, fill, rng)

            def call():
                jax.block_until_ready(core.programs.run(key, dict(batch)))

            call()
            times = []
            usage = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(args.reps):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            faults, system = page_faults_and_system_time(usage, args.reps)
            per_call = statistics.median(times)
            per_step = per_call / num_steps
            print(f"{num_steps:3d} {fill:5d} {per_call * 1e3:9.2f} {per_step * 1e3:9.2f} "
                  f"{args.rows * SLOT_SECONDS / per_step:21.1f} {faults:12.0f} {system * 1e3:12.1f}", flush=True)
    if args.profile:
        by_operation = thread_time_by_operation(core.programs.hlo_text(key), call)
        print(f"K={num_steps}, fill {fill}: thread time per call {sum(by_operation.values()):.1f} ms, the costliest "
              "operations:")
        for (operation, shape), ms in by_operation.most_common(args.profile):
            print(f"{ms:8.2f} ms  {operation.removeprefix('jit(_merged_step)/')}  {shape}")


if __name__ == "__main__":
    sys.exit(main())
