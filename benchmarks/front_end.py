"""CPU per pass of the engine's audio front-end thread: N streams each append one 80 ms piece, and the worker
turns them into log-mel slots in one pass, as it does for paced streams (validation, buffering, the batched
log-mel). Streams are past their prompt and narrowband probe, as in a long session.

    python benchmarks/front_end.py --streams 1,8,256 --passes 100

The thread's CPU time is the number: on a machine where XLA's threads hold the cores, every millisecond here
is taken from the engine's steps.
"""
import argparse
import asyncio
import time

import numpy as np

from jaxstream.engine.audio_front_end import FrontEndWorker, _Job
from jaxstream.models.audio import SAMPLES_PER_SLOT, StreamingLogMel

WARM_UP_PASSES = 60  # the prompt's slots and the 3 s band probe


def run(streams: int, passes: int, seed: int = 0) -> np.ndarray:
    """Thread CPU seconds of each measured pass."""
    worker = FrontEndWorker()
    loop = asyncio.new_event_loop()
    rng = np.random.default_rng(seed)
    fronts = [worker.stream(StreamingLogMel(n_delay=6)) for _ in range(streams)]

    def one_pass() -> float:
        # The worker's own pass over job records, called here on this thread; their futures are answered on
        # `loop`, which never runs: only the pass's CPU is measured.
        jobs = [_Job(front, (0.1 * rng.standard_normal(SAMPLES_PER_SLOT)).astype(np.float32), loop,
                     loop.create_future()) for front in fronts]
        start = time.thread_time()
        worker._process(jobs)  # noqa: SLF001 - the pass itself, without the queue and the thread
        return time.thread_time() - start

    try:
        for _ in range(WARM_UP_PASSES):
            one_pass()
        return np.array([one_pass() for _ in range(passes)])
    finally:
        worker.close()
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--streams", default="1,8,256", help="streams per pass, one run each (default: 1,8,256)")
    parser.add_argument("--passes", type=int, default=100, help="measured passes per run (default: 100)")
    args = parser.parse_args()
    for streams in (int(n) for n in args.streams.split(",")):
        seconds = run(streams, args.passes)
        p50 = float(np.median(seconds))
        print(f"streams={streams}: front-end CPU per pass p50 {p50 * 1e3:.2f} ms, {p50 / streams * 1e6:.1f} us per "
              f"80 ms append ({p50 / 0.08 * 100:.1f} % of a core at real time)", flush=True)


if __name__ == "__main__":
    main()
