"""Engine start-up: the same engine built several times in one process, each build timed (load, trace, lower,
compile, first runs) and split into the time its programs took to trace and compile and the rest.

    python benchmarks/engine_startup.py                               # the embedded model, no compilation cache
    python benchmarks/engine_startup.py --persistent-cache DIR --builds 2   # run twice: the second run loads from DIR

Build 1 traces, lowers and compiles every program (or loads them from `--persistent-cache`'s folder: tracing and
lowering still run); later builds in the process get the jitted steps, traces and executables the first one made
(jaxstream/engine/steps.py), so only loading the weights, allocating the cache and the programs' first runs remain.
"""
import argparse
import asyncio
import time

import jax

from jaxstream import allocator
from jaxstream.engine import steps
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model name, directory or hub id (default: tiny)")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--builds", type=int, default=3, help="engines built one after another (default 3)")
    parser.add_argument("--persistent-cache", metavar="DIR",
                        help="JAX's compilation cache folder (default: none, every first build compiles)")
    args = parser.parse_args()
    allocator.reexecute_with_tcmalloc()  # as the jaxstream commands start
    if args.persistent_cache:
        jax.config.update("jax_compilation_cache_dir", args.persistent_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    else:
        jax.config.update("jax_enable_compilation_cache", False)

    programs_time = [0.0]
    compile_program = steps.Programs.compile

    def timed_compile(self, key, step, batch):
        start = time.perf_counter()
        try:
            compile_program(self, key, step, batch)
        finally:
            programs_time[0] += time.perf_counter() - start

    steps.Programs.compile = timed_compile
    config = EngineConfig(max_sessions=args.max_sessions)
    print(f"{args.model}, max_sessions {args.max_sessions}, {jax.default_backend()}, persistent cache "
          f"{args.persistent_cache or 'off'}")
    for build in range(1, args.builds + 1):
        programs_time[0] = 0.0
        start = time.perf_counter()
        engine = AsyncEngine.from_pretrained(args.model, config=config)
        total = time.perf_counter() - start
        print(f"build {build}: {total:6.2f} s ({len(engine.core.programs)} step programs traced and compiled in "
              f"{programs_time[0]:.2f} s, the rest {total - programs_time[0]:.2f} s)")
        asyncio.run(engine.shutdown())


if __name__ == "__main__":
    main()
