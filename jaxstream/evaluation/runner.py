"""Runs a corpus through the engine's realtime transcription sessions, `concurrency` sessions at a time.

Every utterance is one `engine.start_transcription` session, so evaluation exercises the serving path with
real cross-session batching. Two ways to feed audio:

- as fast as possible (default): the audio is appended in large pieces as soon as the engine takes them
  (its `append` awaits while too much is queued) — measures quality and throughput (RTFx);
- real time (`realtime=True`): 80 ms of audio is appended every 80 ms, each piece when its last sample
  would have been spoken — measures latency as a live user sees it, and whether the engine keeps up.

Clocks and latency definitions (milliseconds in the results):

- stream start = the moment the session's audio starts (first append; in real time the first piece goes in
  80 ms later, when it is complete).
- `first_token_ms`: wall time from stream start to the first delta with text.
- `finalize_ms`: wall time from `finish()` (end of audio) to the final result.
- emission position of a token: the real audio the model had consumed when it generated the token. The
  model generates one token per 80 ms slot, `delay_ms` behind the audio it reads, so after `n` generated ids
  (counted from the deltas' `token_ids`) it has read `n * 80 ms + delay` of audio (at most the whole
  recording; the rest is the end-of-stream padding). A delta's text is split back into its tokens' texts
  (one delta carries every token of a multi-step dispatch, several when audio is queued), so a word's
  emission position is that of the token carrying its last character, not of the delta's last token.
- `word_latencies_ms` (needs corpus word times): emission position - reference word end: the algorithmic
  latency (delay + waiting for the word's last token), identical at any load and in either feeding mode.
- `word_latencies_wall_ms` (real time only): wall time of the delta since stream start - reference word end:
  what a live listener sees, including batching and compute.
- `max_lag_ms` (real time only): the largest (wall time since stream start - emission position) over the
  session's text deltas, i.e. how far processing trailed the arrival of the audio. A stream *fell behind* when
  it exceeded `REALTIME_LAG_LIMIT_S`.
- streams: `peak` and time-weighted `mean` number of sessions in flight; `sustained` (real time only) is
  the peak when no stream fell behind, otherwise one less than the number in flight when the first stream
  fell behind — the concurrency the engine held in real time.
"""
import asyncio
import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from jaxstream.errors import UserError
from jaxstream.evaluation.corpora import Corpus, Utterance, select_utterances
from jaxstream.evaluation.metrics import (
    UtteranceResult, emitted_words, is_scored_reference, make_normalizer, score, word_emission_latencies,
)
from jaxstream.evaluation.reports import (
    build_report, combine_streams, limit_flag, resume_mismatch, run_entry, run_results, setting_differences,
    shard_flag,
)
from jaxstream.models.audio import SAMPLES_PER_SLOT, SAMPLING_RATE, SLOT_SECONDS

REALTIME_CHUNK_SAMPLES = SAMPLES_PER_SLOT  # 80 ms, one decoder step
FAST_CHUNK_SAMPLES = 30 * SAMPLING_RATE
REALTIME_LAG_LIMIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class RunOptions:
    delay_ms: int | None = None  # None: the engine's default
    concurrency: int = 8
    realtime: bool = False
    quantization: str | None = None  # the engine's weights (`--quantization`): results of another are not this run's
    kv_cache_dtype: str = "auto"  # the engine's KV cache (`--kv-cache-dtype`): likewise


class StreamTracker:
    """Counts sessions in flight over time and notes when a real-time stream first fell behind."""

    def __init__(self):
        self.in_flight = 0
        self.peak = 0
        self._area = 0.0  # integral of in_flight over time
        self._started = self._changed = time.perf_counter()
        self.fell_behind_at: int | None = None  # sessions in flight when a stream first fell behind

    def _advance(self) -> None:
        now = time.perf_counter()
        self._area += self.in_flight * (now - self._changed)
        self._changed = now

    def opened(self) -> None:
        self._advance()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def closed(self) -> None:
        self._advance()
        self.in_flight -= 1

    def lagged(self, lag_seconds: float) -> None:
        if lag_seconds > REALTIME_LAG_LIMIT_S and self.fell_behind_at is None:
            self.fell_behind_at = self.in_flight

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def summary(self, realtime: bool) -> dict:
        self._advance()
        elapsed = self._changed - self._started
        sustained = None
        if realtime:
            sustained = self.peak if self.fell_behind_at is None else max(0, self.fell_behind_at - 1)
        return {"peak": self.peak, "mean": self._area / elapsed if elapsed > 0 else 0.0, "sustained": sustained}


async def run_utterances(engine, utterances: Iterable[Utterance], options: RunOptions,
                         normalizer: Callable[[str], str], on_result: Callable[[UtteranceResult], None],
                         load_audio: Callable[[str], np.ndarray], tracker: "StreamTracker") -> None:
    """Transcribes `utterances` with `options.concurrency` sessions in flight; calls `on_result` for each.

    Failures (unreadable audio, an engine error for that stream) become results with `error` set; the run
    goes on. `tracker` follows the sessions in flight (and the wall time) even when the run is interrupted.
    """
    pending = iter(utterances)

    async def worker():
        for utterance in pending:  # one shared iterator: each worker takes the next utterance
            on_result(await evaluate_utterance(engine, utterance, options, normalizer, tracker, load_audio))

    await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))


async def evaluate_utterance(engine, utterance: Utterance, options: RunOptions, normalizer: Callable[[str], str],
                             tracker: StreamTracker, load_audio: Callable[[str], np.ndarray]) -> UtteranceResult:
    reference_normalized = normalizer(utterance.text)
    result = UtteranceResult(utterance.id, utterance.audio, utterance.text, speaker=utterance.speaker,
                             reference_normalized=reference_normalized)
    try:
        pcm = await asyncio.to_thread(load_audio, utterance.audio)
    except (ValueError, OSError) as exc:  # models.audio.AudioError is a ValueError naming the file
        result.error = str(exc)
        return result
    result.audio_seconds = pcm.size / SAMPLING_RATE
    tracker.opened()
    try:
        stream = await stream_audio(engine, pcm, delay_ms=options.delay_ms, realtime=options.realtime,
                                    tracker=tracker)
    except Exception as exc:  # an engine/input error of this stream: report it, keep evaluating the rest
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        tracker.closed()
    score(result, stream.done.text, normalizer)
    result.first_token_ms = _ms(stream.first_token_s)
    result.finalize_ms = _ms(stream.finalize_s)
    if options.realtime:
        result.max_lag_ms = _ms(stream.max_lag_s)
    if utterance.words:
        by_position = emitted_words((text, position) for text, position, _ in stream.deltas)
        result.word_latencies_ms = [1000 * v for v in word_emission_latencies(utterance.words, by_position)]
        if options.realtime:
            by_wall = emitted_words((text, wall) for text, _, wall in stream.deltas)
            result.word_latencies_wall_ms = [1000 * v for v in word_emission_latencies(utterance.words, by_wall)]
    return result


@dataclasses.dataclass
class StreamRecord:
    """What one transcription session produced, with the timings the metrics need."""

    done: object = None  # the session's TranscriptionDone
    # (text, emission position s, wall s since start) per token with text (see `stream_audio`)
    deltas: list = dataclasses.field(default_factory=list)
    first_token_s: float | None = None
    finalize_s: float | None = None
    max_lag_s: float | None = None


async def stream_audio(engine, pcm: np.ndarray, *, delay_ms: int | None = None, realtime: bool = False,
                       tracker: StreamTracker | None = None) -> StreamRecord:
    """Transcribes `pcm` in one session, fed in real time or as fast as the engine takes it (any length:
    large pieces, waiting out the engine's backpressure), collecting deltas, timings and the final result.

    `record.deltas` splits each delta's text into the texts of its tokens, each at its own emission position
    (all at the delta's wall time); a delta whose tokens do not decode to its text (the final flush of an
    incomplete character) stays whole, at the position of its last token."""
    from jaxstream.engine.transcription_session import TranscriptionDone

    loop = asyncio.get_running_loop()
    duration = pcm.size / SAMPLING_RATE
    session = await engine.start_transcription(delay_ms=delay_ms, max_audio_seconds=max(duration, 1 / SAMPLING_RATE))
    record = StreamRecord()
    generated = 0  # ids generated so far: one per 80 ms slot, `delay_ms` behind the audio consumed
    decoder = engine.tokenizer.stream_decoder()  # the session's detokenizer, replayed to split deltas by token
    start = loop.time()
    finish_time = None

    async def feed():
        nonlocal finish_time
        try:
            if realtime:
                for begin in range(0, pcm.size, REALTIME_CHUNK_SAMPLES):
                    end = min(begin + REALTIME_CHUNK_SAMPLES, pcm.size)
                    await asyncio.sleep(max(0.0, start + end / SAMPLING_RATE - loop.time()))
                    await session.append(pcm[begin:end])
            else:
                for begin in range(0, pcm.size, FAST_CHUNK_SAMPLES):
                    await session.append(pcm[begin:begin + FAST_CHUNK_SAMPLES])  # awaits under backpressure
            finish_time = loop.time()
            await session.finish()
        except Exception:
            await session.abort()  # ends the event stream, which would otherwise wait for audio forever
            raise

    feeder = asyncio.create_task(feed())
    try:
        async for event in session:
            wall = loop.time() - start
            if isinstance(event, TranscriptionDone):
                record.done = event
                if finish_time is not None:  # else the model ended the text on its own before the audio did
                    record.finalize_s = wall + start - finish_time
                break
            pieces = []  # (text, ids generated once it was)
            for token in event.token_ids:
                generated += 1
                pieces.append((decoder.push(token), generated))
            if "".join(text for text, _ in pieces) != event.text:
                pieces = [(event.text, generated)]
            for text, count in pieces:
                if text:
                    record.deltas.append((text, min(count * SLOT_SECONDS + session.delay_ms / 1000, duration), wall))
            position = min(generated * SLOT_SECONDS + session.delay_ms / 1000, duration)
            if record.first_token_s is None and event.text.strip():
                record.first_token_s = wall
            if realtime:
                lag = wall - position
                record.max_lag_s = lag if record.max_lag_s is None else max(record.max_lag_s, lag)
                if tracker is not None:
                    tracker.lagged(lag)
        else:
            await feeder  # a feeding error ended the stream early: report that error
            raise RuntimeError("the session ended without a final result")
    except BaseException as exc:
        feeder.cancel()
        (feed_outcome,) = await asyncio.gather(feeder, return_exceptions=True)
        try:
            await session.abort()
        except Exception:  # the stream already failed; its first error is the one to report
            pass
        if isinstance(exc, Exception) and isinstance(feed_outcome, Exception) and feed_outcome is not exc:
            raise feed_outcome from None  # feeding failed first and ended the stream: that is the cause
        raise
    feeder.cancel()  # normally done already; still pacing only when the model ended the text early
    await asyncio.gather(feeder, return_exceptions=True)
    return record


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


class Evaluation:
    """The state of one evaluation: selected utterances, results per delay, and the report they make.

    Utterances whose normalized reference is empty are excluded up front (see metrics.py). `resume_from`
    takes over the successful results of an earlier report; failed ones are run again.
    """

    def __init__(self, corpus: Corpus, *, model: str, delays: list[int | None], options: RunOptions,
                 normalizer_name: str, limit: int | None = None, shard: tuple[int, int] | None = None):
        self.normalizer = make_normalizer(normalizer_name)
        selected = select_utterances(corpus.utterances, limit, shard)
        scored = [is_scored_reference(self.normalizer(u.text)) for u in selected]
        self.utterances = [u for u, keep in zip(selected, scored) if keep]
        self.corpus = {
            "path": str(Path(corpus.path).resolve()), "layout": corpus.layout, "utterances": len(corpus.utterances),
            "selected": len(selected), "limit": limit, "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
            "excluded": [u.id for u, keep in zip(selected, scored) if not keep],
        }
        self.model = model
        self.options = options
        self.settings = {"concurrency": options.concurrency, "realtime": options.realtime,
                         "normalizer": normalizer_name, "quantization": options.quantization,
                         "kv_cache_dtype": options.kv_cache_dtype}
        self.delays = list(delays)
        self._results = {delay: {} for delay in self.delays}  # delay -> id -> UtteranceResult
        self._wall = dict.fromkeys(self.delays, 0.0)
        self._streams = {delay: [] for delay in self.delays}
        self._other_runs: list[dict] = []  # runs of an earlier report at delays not evaluated now

    def resume_from(self, report: dict) -> int:
        """Keeps the earlier report's successful results of the selected utterances; returns how many."""
        mine = self.report()
        if (differences := setting_differences(report, mine)) is not None:
            raise UserError(resume_mismatch(*differences))
        if shard_flag(report) != shard_flag(mine):
            raise UserError(resume_mismatch(shard_flag(report), shard_flag(mine)))
        wanted = {u.id for u in self.utterances}
        kept = 0
        for run in report["runs"]:
            if run["delay_ms"] not in self._results:
                self._other_runs.append(run)
                continue
            for result in run_results(run):
                if result.id not in wanted:  # dropping it would lose work and skew the RTFx
                    if limit_flag(report) != limit_flag(mine):
                        raise UserError(resume_mismatch(limit_flag(report), limit_flag(mine)))
                    raise UserError(f"the report holds utterance {result.id!r}, which this run does not select "
                                    "(the corpus changed?): give another --report PATH to start a new run")
                if result.ok:
                    self._results[run["delay_ms"]][result.id] = result
                    kept += 1
            self._wall[run["delay_ms"]] += run["wall_seconds"]
            self._streams[run["delay_ms"]].append(run["streams"])
        return kept

    def todo(self, delay: int | None) -> list[Utterance]:
        return [u for u in self.utterances if u.id not in self._results[delay]]

    def add(self, delay: int | None, result: UtteranceResult) -> None:
        self._results[delay][result.id] = result

    def add_timing(self, delay: int | None, tracker: "StreamTracker") -> None:
        self._wall[delay] += tracker.elapsed()
        self._streams[delay].append(tracker.summary(self.options.realtime))

    def snapshot(self, running: tuple[int | None, "StreamTracker"] | None = None) -> "Evaluation":
        """A copy that later results do not change (to write on another thread); `running` = (delay,
        tracker) of the part in progress, whose timing is counted so far."""
        copied = copy.copy(self)
        copied._results = {delay: dict(results) for delay, results in self._results.items()}
        copied._wall = dict(self._wall)
        copied._streams = {delay: list(streams) for delay, streams in self._streams.items()}
        if running is not None:
            copied.add_timing(*running)
        return copied

    def results(self, delay: int | None) -> list[UtteranceResult]:
        return [self._results[delay][key] for key in sorted(self._results[delay])]

    def report(self) -> dict:
        runs = list(self._other_runs)
        for delay in self.delays:
            results = self.results(delay)
            runs.append(run_entry(delay, results, self._wall[delay], combine_streams(self._streams[delay]),
                                  complete=len(results) == len(self.utterances)))
        return build_report(model=self.model, corpus=self.corpus, settings=self.settings, runs=runs)


async def run_evaluation(evaluation: Evaluation, engine, *, load_audio: Callable[[str], np.ndarray],
                         progress: bool = True, save: Callable[[Evaluation], None] | None = None,
                         save_interval_s: float = 10.0) -> None:
    """Runs every delay of `evaluation` over its remaining utterances.

    `save(snapshot)` is called every `save_interval_s` (or more rarely, when writing takes long) on a worker
    thread with a frozen copy of the evaluation, so writing a large report never stalls real-time feeding.
    Timing of a run that is interrupted still counts, so a resumed report's RTFx stays right.
    """
    from tqdm import tqdm

    loop = asyncio.get_running_loop()
    saver = _PeriodicSaver(save, save_interval_s)
    for delay in evaluation.delays:
        todo = evaluation.todo(delay)
        if not todo:
            continue
        options = dataclasses.replace(evaluation.options, delay_ms=delay)
        label = "default delay" if delay is None else f"{delay} ms"
        errors = np.zeros(2, dtype=np.int64)  # running (edits, reference words) for the progress bar
        tracker = StreamTracker()
        with tqdm(total=len(todo), desc=label, unit="utt", disable=None if progress else True) as bar:

            def on_result(result: UtteranceResult) -> None:
                evaluation.add(delay, result)
                if result.word_counts is not None:
                    hits, substitutions, deletions, insertions = result.word_counts
                    errors[:] += (substitutions + deletions + insertions, hits + substitutions + deletions)
                    bar.set_postfix_str(f"WER {100 * errors[0] / max(1, errors[1]):.2f}%", refresh=False)
                bar.update()
                saver.maybe_save(loop, lambda: evaluation.snapshot(running=(delay, tracker)))

            try:
                await run_utterances(engine, todo, options, evaluation.normalizer, on_result, load_audio, tracker)
            finally:
                evaluation.add_timing(delay, tracker)
                await saver.wait()


class _PeriodicSaver:
    """At most one report write in flight, started at most every `interval_s` (longer for slow writes)."""

    def __init__(self, save: Callable[[Evaluation], None] | None, interval_s: float):
        self._save, self._min_interval, self._interval = save, interval_s, interval_s
        self._last = time.perf_counter()
        self._pending: asyncio.Future | None = None

    def maybe_save(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], Evaluation]) -> None:
        busy = self._pending is not None and not self._pending.done()
        if self._save is None or busy or time.perf_counter() - self._last < self._interval:
            return
        self._pending = loop.run_in_executor(None, self._timed_save, snapshot())

    def _timed_save(self, frozen: Evaluation) -> None:
        began = time.perf_counter()
        try:
            self._save(frozen)
        except OSError as exc:  # the run goes on; the final write reports the problem if it persists
            print(f"warning: could not write the report: {exc}", file=sys.stderr)
        self._last = time.perf_counter()
        # Big reports take a while to write: keep writing to a small share of the run time.
        self._interval = max(self._min_interval, 20 * (self._last - began))

    async def wait(self) -> None:
        if self._pending is not None:
            await asyncio.gather(self._pending, return_exceptions=True)
