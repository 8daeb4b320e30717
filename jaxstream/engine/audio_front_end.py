"""The transcription sessions' audio front end, off the event loop: one worker thread per engine turns every
session's appended PCM into log-mel slots, in batches.

Why one worker and batches: at 80 ms per append, 64 real-time streams make ~800 appends a second. A thread
hop per append (`asyncio.to_thread`) plus a dozen numpy calls on 8 x 400 samples each costs more in
wake-ups and call overhead than in arithmetic, on a machine whose cores the engine thread needs. The worker
instead takes every job queued since its last pass, applies each to its session's `StreamingLogMel` in
queue order (cheap: validation and a copy), then computes the log-mel of all of them with one FFT, one
filterbank matmul and one log (`models.audio.take_ready`), and hands the results back with one
`call_soon_threadsafe` per event loop per pass. Each stream's band check (an FFT of its first 3 s, for the
narrowband warning) runs after the passes, one per pass and the rest while no append waits: 32 streams
reaching 3 s together made one 13 ms pass, holding back every stream's features.

Contract kept from the per-append hop: a session's jobs run in submission order; a job's `AudioError`
fails that job alone (its stream is left unchanged, other sessions' jobs in the same pass are unaffected);
a session closed (aborted) while its jobs wait is skipped; the caller awaits its own result, so
backpressure stays with the caller.
"""
import asyncio
import collections
import dataclasses
import logging
import queue
import threading

import numpy as np

from jaxstream.errors import EngineDeadError
from jaxstream.models.audio import (
    MEL_FRAMES_PER_SLOT, NUM_MEL_BINS, SAMPLING_RATE, AudioError, StreamingLogMel, check_pcm, clip_resampled,
    take_ready,
)
from jaxstream.models.audio_checks import BandProbe, narrowband_warning

logger = logging.getLogger(__name__)


class StreamFrontEnd:
    """One session's front end: optional soxr resampling to 16 kHz, then `StreamingLogMel`. Its methods are
    called on the session's event loop; the arrays are touched only by the worker thread."""

    def __init__(self, worker: "FrontEndWorker", log_mel: StreamingLogMel, sample_rate: int = SAMPLING_RATE):
        self._worker = worker
        self.log_mel = log_mel
        self.resampler = None
        if sample_rate != SAMPLING_RATE:
            import soxr

            self.resampler = soxr.ResampleStream(sample_rate, SAMPLING_RATE, 1, dtype="float32", quality="HQ")
        self.sample_rate = sample_rate
        self.band = BandProbe(sample_rate)  # worker thread only
        # Read by the worker, set on the event loop: once set, queued jobs are skipped (a benign race; a
        # job already running completes and its result is simply not used).
        self.closed = False

    def push(self, pcm: np.ndarray) -> asyncio.Future:
        """Queues float PCM at the session's rate; the future gives the mel slots `[n, 8, 128]` it made
        ready, or the `AudioError` of unusable audio (the stream is then unchanged)."""
        return self._worker.submit(self, pcm)

    def finish(self) -> asyncio.Future:
        """End of stream: flushes the resampler, adds the right padding; the future gives the remaining
        slots."""
        return self._worker.submit(self, None)

    def slots_at(self, samples: int) -> int:
        """The slots made ready in all once `samples` samples at the session's rate have been pushed: exact
        at 16 kHz; through the resampler never too few, and up to two too many once the prompt is out (its
        filter delay holds up to ~0.12 s back until the end: 1,850 samples at 16 kHz from 8 kHz input),
        the whole prompt early at its start. Safe to call while the worker runs."""
        if self.resampler is not None:
            samples = samples * SAMPLING_RATE // self.sample_rate
        return self.log_mel.slots_at(samples)

    @property
    def total_slots(self) -> int | None:
        return self.log_mel.total_slots

    def close(self) -> None:
        self.closed = True


@dataclasses.dataclass
class _Job:
    stream: StreamFrontEnd
    pcm: np.ndarray | None  # None: finish
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    slots: int = 0  # ready slots to take once every job of the pass has been applied
    result: object = None  # the slots array or the exception, for the future


_STOP = object()
_NO_SLOTS = np.zeros((0, MEL_FRAMES_PER_SLOT, NUM_MEL_BINS), np.float32)


class FrontEndWorker:
    """The engine's front-end thread (see the module docstring). `close` ends it; jobs submitted before
    `close` are still answered, later ones raise `EngineDeadError`. `warn(message)` is called on the worker
    thread when a stream turns out narrowband (models/audio_checks.py)."""

    def __init__(self, warn=lambda message: None):
        self._warn = warn
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._accepting = True
        self._lock = threading.Lock()  # orders `submit` against `close`: no job lands behind the stop mark
        self._unjudged: collections.deque[StreamFrontEnd] = collections.deque()  # worker thread only
        self._thread = threading.Thread(target=self._run, name="jaxstream-front-end", daemon=True)
        self._thread.start()

    def stream(self, log_mel: StreamingLogMel, sample_rate: int = SAMPLING_RATE) -> StreamFrontEnd:
        return StreamFrontEnd(self, log_mel, sample_rate)

    def submit(self, stream: StreamFrontEnd, pcm: np.ndarray | None) -> asyncio.Future:
        """Queues `pcm` for `stream` (None: its end); the future resolves on the calling event loop with the
        slots it made ready, or the job's error. At most one job of a stream should be queued at a time for
        the best batching (a session's appends run in order anyway); more are still correct."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self._accepting:
                raise EngineDeadError("the engine is shut down")
            self._jobs.put(_Job(stream, pcm, loop, future))
        return future

    def close(self) -> None:
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
            self._jobs.put(_STOP)
        self._thread.join()

    # -- worker thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._unjudged and self._jobs.empty():
                self._judge(self._unjudged.popleft())  # nothing waits: a good time
                continue
            if self._one_pass():
                return
            if self._unjudged:  # one per pass even when appends never stop coming
                self._judge(self._unjudged.popleft())

    def _one_pass(self) -> bool:
        """Waits for a job and processes it with everything queued meanwhile; True at the stop mark. (A frame
        of its own: jobs held in `_run` while it waits for the next would keep their streams alive.)"""
        jobs = [self._jobs.get()]
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        stop = jobs[-1] is _STOP
        if stop:
            jobs.pop()
        self._process(jobs)
        return stop

    def _process(self, jobs: list[_Job]) -> None:
        batch: list[_Job] = []
        in_batch: set[int] = set()
        for job in jobs:
            if id(job.stream) in in_batch:
                # A second job of the same stream in one pass: its slots must not include the first's.
                self._compute(batch)
                batch, in_batch = [], set()
            if job.stream.closed:
                job.result = _NO_SLOTS
            else:
                try:
                    job.slots, probe_full = _apply(job.stream, job.pcm)
                    if job.pcm is None:
                        self._judge(job.stream)  # a short stream's one verdict, or one still waiting
                    elif probe_full:
                        self._unjudged.append(job.stream)
                except AudioError as exc:
                    job.result = exc
                except Exception as exc:  # noqa: BLE001 - a front-end bug fails this append, not the worker
                    logger.exception("the audio front end failed on an append")
                    job.result = exc
                if job.result is None:
                    batch.append(job)
                    in_batch.add(id(job.stream))
        self._compute(batch)
        by_loop: dict = {}
        for job in jobs:
            by_loop.setdefault(job.loop, []).append((job.future, job.result))
        for loop, results in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_all, results)
            except RuntimeError:
                pass  # that event loop is closed: nobody is waiting any more

    def _judge(self, stream: StreamFrontEnd) -> None:
        if stream.closed:
            return
        try:
            reason = stream.band.judge()
        except Exception:  # noqa: BLE001 - a warning's check must not end the worker
            logger.exception("the audio front end failed to judge a stream's band")
            return
        if reason is not None:
            self._warn(narrowband_warning(reason))

    @staticmethod
    def _compute(batch: list[_Job]) -> None:
        if not batch:
            return
        try:
            slots = take_ready([(job.stream.log_mel, job.slots) for job in batch])
        except Exception as exc:  # noqa: BLE001 - reported to every append of the pass
            logger.exception("the audio front end failed on a batch of %d appends", len(batch))
            for job in batch:
                job.result = exc
            return
        for job, features in zip(batch, slots):
            job.result = features


def _apply(stream: StreamFrontEnd, pcm: np.ndarray | None) -> tuple[int, bool]:
    """Applies one job to its stream (resampling, validation, buffering); returns the slots now ready and
    whether the stream's band probe has just got the audio it judges."""
    log_mel = stream.log_mel
    if pcm is None:
        if stream.resampler is not None:
            # The flushed tail rings like any other output (an 8 kHz square wave of magnitude 2, the most an
            # append takes, comes out at up to 2.7): clipped as the appends are, or the push refuses it and
            # the stream can never end.
            log_mel.push(clip_resampled(stream.resampler.resample_chunk(np.zeros(0, np.float32), last=True)))
        return log_mel.finish(), False
    if stream.resampler is not None:
        # Checked before the resampler sees it: a refused append must not reach the filter's state, or its
        # NaN or out-of-range samples would come out of every later append. The filter's ringing can
        # overshoot valid input a little; clipping keeps it within what the input was checked against.
        pcm = clip_resampled(stream.resampler.resample_chunk(check_pcm(pcm).astype(np.float32)))
    slots = log_mel.push(pcm)  # validates: the probe sees only audio the stream accepted
    return slots, stream.band.feed(pcm)


def _resolve_all(results) -> None:
    for future, result in results:
        if future.done():
            continue  # its append was cancelled
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
