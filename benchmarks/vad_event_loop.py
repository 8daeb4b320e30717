"""What server VAD costs the event loop: N streams push 80 ms of audio each every 80 ms (real time) through
`SpeechDetector`, scored on the loop (the old inline call) or on worker threads (`await detector.push`).
Reported side by side: the loop's busy share and the lateness of a 5 ms ticker, the delay every other
connection's events would see.

    python benchmarks/vad_event_loop.py --streams 16,64 --seconds 5
"""
import argparse
import asyncio
import time

import numpy as np

from jaxstream.models.audio import SAMPLING_RATE, load_audio
from jaxstream.models.loading import BUILTIN_MODELS
from jaxstream.serving.vad import SpeechDetector, VadConfig

APPEND_S = 0.08


async def run(streams: int, seconds: float, threaded: bool, audio: np.ndarray) -> dict:
    detectors = [SpeechDetector(VadConfig(), SAMPLING_RATE) for _ in range(streams)]
    step = int(APPEND_S * SAMPLING_RATE)
    busy = 0.0  # seconds the loop spent scoring inline
    lateness: list[float] = []

    async def stream(index: int, detector: SpeechDetector) -> None:
        nonlocal busy
        start = time.perf_counter() + index * APPEND_S / streams  # spread over the 80 ms period
        for k in range(int(seconds / APPEND_S)):
            await asyncio.sleep(max(0.0, start + k * APPEND_S - time.perf_counter()))
            begin = (k * step) % (audio.size - step)
            pcm = audio[begin:begin + step]
            if threaded:
                await detector.push(pcm)
            else:
                began = time.perf_counter()
                detector._push_locked(pcm)  # noqa: SLF001 - the inline call, for comparison
                busy += time.perf_counter() - began

    async def ticker(done: asyncio.Event) -> None:
        while not done.is_set():
            began = time.perf_counter()
            await asyncio.sleep(0.005)
            lateness.append(time.perf_counter() - began - 0.005)

    done = asyncio.Event()
    tick = asyncio.create_task(ticker(done))
    began = time.perf_counter()
    await asyncio.gather(*(stream(i, d) for i, d in enumerate(detectors)))
    wall = time.perf_counter() - began
    done.set()
    await tick
    for detector in detectors:
        detector.close()
    late = np.array(lateness) * 1e3
    return {"wall_s": wall, "loop_busy": busy / wall if not threaded else None,
            "tick_late_p50_ms": float(np.percentile(late, 50)), "tick_late_p99_ms": float(np.percentile(late, 99))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    audio = load_audio(BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav").astype(np.float32)
    for streams in (int(n) for n in args.streams.split(",")):
        for threaded in (False, True):
            result = asyncio.run(run(streams, args.seconds, threaded, audio))
            busy = "" if result["loop_busy"] is None else f", loop busy {100 * result['loop_busy']:.0f} %"
            print(f"{streams:3d} streams, VAD {'on threads' if threaded else 'inline    '}: "
                  f"{args.seconds:g} s of audio in {result['wall_s']:.2f} s{busy}, "
                  f"5 ms ticker late p50 {result['tick_late_p50_ms']:.2f} ms / p99 {result['tick_late_p99_ms']:.2f} ms")


if __name__ == "__main__":
    main()
