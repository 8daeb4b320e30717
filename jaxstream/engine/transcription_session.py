"""Realtime transcription sessions (the API of `jaxstream.transcription`): events, word timings and the
async `TranscriptionSession` handle the server, the CLI, the eval harness and the notebook use.

Time bases: the stream is left-padded with 32 silent 80 ms slots and the model writes the text of an
audio slot `n_delay` slots late, so the i-th generated token (0-based) describes real audio around
`(i + 1) * 80 ms`: its decoder slot is `prompt_len + i = 33 + n_delay + i`, minus the 32 padding slots
and the delay. Word timings use that mapping: a word starts at its `[STREAMING_WORD]` marker (or at its
first text token when no marker precedes it) and ends 80 ms after its last text token, clamped to the
audio received. Every time in the events is rounded to the millisecond. The words are the text's own: a marker
between two ASCII letters or digits (which a small model can emit inside a word: the text reads "overhead", not
"over head") does not split the word; elsewhere a marker does, as a space does (Chinese and Japanese text has no
spaces: its markers are its word boundaries).
"""
import asyncio
import dataclasses
import functools
import logging
import typing

import numpy as np

from jaxstream.errors import BacklogError, EngineError, InvalidAudioError, InvalidRequestError, SessionClosedError
from jaxstream.models.audio import SAMPLING_RATE, SLOT_SECONDS, AudioError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WordTiming:
    word: str
    start: float  # seconds of real audio
    end: float


@dataclasses.dataclass(frozen=True)
class TranscriptionUsage:
    audio_seconds: float
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class TranscriptionDelta:
    """New text, streamed as soon as it is complete UTF-8, with the raw ids since the previous delta."""

    text: str
    token_ids: list[int]
    # Real-audio time the newest token of this delta describes (`token_time`); it was emitted once
    # `delay_ms` more audio had been consumed.
    audio_seconds: float
    # Each of `token_ids`' log-probability under the model (decoding is greedy: the step's highest). Left out of
    # the repr, which people print.
    logprobs: list[float] = dataclasses.field(repr=False)


class GeneratedIds(typing.NamedTuple):
    """What the engine thread hands a transcription stream: ids it generated since the last hand-off (with at
    least one text id among them, or its end), their log-probabilities, the real audio the engine had
    received then (16 kHz samples), and whether the stream ended. `TranscriptAssembler` turns these into the
    stream's events on the consumer's side, so detokenizing stays off the engine thread (as vLLM's output
    processor detokenizes outside its engine core)."""

    ids: list[int]
    logprobs: list[float]
    samples: float
    ended: bool


@dataclasses.dataclass(frozen=True)
class TranscriptionDone:
    text: str
    token_ids: list[int]  # every generated id (control ids included), in order
    words: list[WordTiming]
    usage: TranscriptionUsage
    delay_ms: int
    logprobs: list[float] = dataclasses.field(repr=False)  # each of `token_ids`' log-probability


def transcription_prompt(model_cfg, n_delay: int) -> list[int]:
    """The decoder prompt of a stream: BOS, then `[STREAMING_PAD]` for the 32 left-pad slots and the
    `n_delay` delay slots (mistral-common's streaming prefix; spec voxtral_realtime.md §4)."""
    return [model_cfg.bos_id] + [model_cfg.streaming_pad_id] * (model_cfg.n_left_pad_tokens + n_delay)


def to_ms(seconds: float) -> float:
    """Seconds rounded to the millisecond, as the events report times (a product such as 35 * 0.08 is
    2.8000000000000003 in floating point, which would otherwise reach every JSON client)."""
    return round(seconds, 3)


def to_ms_at_most(seconds: float) -> float:
    """`seconds` to the millisecond, never above it: a word clipped at the end of a 2.99675 s recording
    ends at 2.996, not at 2.997, after the recording."""
    rounded = to_ms(seconds)
    return rounded if rounded <= seconds else to_ms(rounded - 0.001)


def token_time(index: int) -> float:
    """Real-audio time (s) the `index`-th generated token describes (delay already taken off)."""
    return to_ms((index + 1) * SLOT_SECONDS)


def word_timings(token_ids, tokenizer, audio_seconds: float, first_index: int = 0) -> list[WordTiming]:
    """Words and their times from generated ids (see the module docstring for the rule); `token_ids` may be
    a stream's ids from its `first_index`-th on (times stay the stream's, computed as for the whole)."""
    words: list[WordTiming] = []
    current: list[int] = []  # text ids of the word being built
    start = None
    marker = None  # time of a [STREAMING_WORD] not yet attached to a word
    last_time = 0.0

    def close():
        nonlocal current, start
        text = tokenizer.decode(current).strip()
        if text:
            end = to_ms(max(last_time + SLOT_SECONDS, start))
            if end > audio_seconds:  # clipped at the end of the audio, in whole milliseconds within it
                end = to_ms_at_most(audio_seconds)
            words.append(WordTiming(text, min(to_ms(start), end), end))
        current, start = [], None

    tail = b""  # the last text piece of the word being built
    for index, token in enumerate(token_ids):
        if token == tokenizer.streaming_word_id:
            marker = token_time(first_index + index)
            continue
        if tokenizer.is_control(token):
            continue
        piece = tokenizer.token_bytes(token)
        # A marker ends the word unless it falls between two ASCII letters or digits, inside a word of a script
        # written with spaces: Chinese or Japanese text has no spaces, and its markers are its word boundaries.
        if current and (piece[:1].isspace() or marker is not None and not (tail[-1:].isalnum()
                                                                              and piece[:1].isalnum())):
            close()
        if not current:
            start = marker if marker is not None else token_time(first_index + index)
        marker = None  # used by the word it opens, or inside a word, where it marks nothing
        current.append(token)
        tail = piece
        last_time = token_time(first_index + index)
    if current:
        close()
    return words


class TranscriptAssembler:
    """One stream's transcript, built from its `GeneratedIds`: a `TranscriptionDelta` as soon as new text is
    complete UTF-8 (carrying every id since the previous delta, control ids included), then, at the end, a
    delta with any held-back bytes and the `TranscriptionDone` with the whole text, ids and word timings."""

    def __init__(self, tokenizer, *, delay_ms: int, prompt_len: int):
        self._tokenizer = tokenizer
        self._decoder = tokenizer.stream_decoder()
        self._delay_ms = delay_ms
        self._prompt_len = prompt_len
        self._generated: list[int] = []
        self._logprobs: list[float] = []
        self._undelivered = 0  # trailing ids of `_generated` not yet carried by a delta

    def events(self, out: GeneratedIds) -> list:
        """The events `out` completes (raises ValueError for an id outside the tokenizer's vocabulary)."""
        self._generated += out.ids
        self._logprobs += out.logprobs
        self._undelivered += len(out.ids)
        events = []
        audio_seconds = out.samples / SAMPLING_RATE
        received = to_ms_at_most(audio_seconds)  # a time within the audio, as the words' (rounding went past it)
        text = self._decoder.push_many(out.ids)
        if text:
            events.append(self._delta(text, min(token_time(len(self._generated) - 1), received)))
        if out.ended:
            tail = self._decoder.flush()
            if tail:
                events.append(self._delta(tail, received))
            usage = TranscriptionUsage(audio_seconds, self._prompt_len, len(self._generated))
            words = word_timings(self._generated, self._tokenizer, audio_seconds)
            events.append(TranscriptionDone(self._decoder.text, list(self._generated), words, usage, self._delay_ms,
                                            list(self._logprobs)))
        return events

    def _delta(self, text: str, audio_seconds: float) -> TranscriptionDelta:
        first = len(self._generated) - self._undelivered
        self._undelivered = 0
        return TranscriptionDelta(text, self._generated[first:], audio_seconds, self._logprobs[first:])


def transcript_sink(target, tokenizer, *, delay_ms: int, prompt_len: int):
    """A sink for the scheduler's `add_session` that hands `target` a stream's events as its session sees
    them (deltas, done, errors, PROGRESS): for driving the scheduler directly, without an `AsyncEngine`."""
    transcript = TranscriptAssembler(tokenizer, delay_ms=delay_ms, prompt_len=prompt_len)

    def sink(item) -> None:
        for event in transcript.events(item) if isinstance(item, GeneratedIds) else (item,):
            target(event)

    return sink


class AudioBacklog:
    """Slots of one session's audio handed to the engine but not yet computed, shared by two threads.

    `sent` is the event loop's count. `consumed` is read from the engine's own state (its stream's row:
    slots dispatched, plus the cached prefix's slots dropped), so the engine thread counts what a tick
    dispatches with one array operation over all its rows, not a Python update per session; once the
    stream lets go of its row the last count is kept. `queued` (the difference) counts audio still in the
    command queue too, which the scheduler's own state cannot see. `collected` counts the same way the slots
    whose generated ids the engine has collected: it is raised after their text was handed to the stream
    (and posted to its event loop: the scheduler's `hand_off_barrier`), so once a reader sees it reach a slot,
    the text of the audio up to there is already on its way (events the engine posted run on the event loop
    ahead of anything scheduled after the read). While an appender
    waits for room it is in the engine's set of waiters, and the scheduler wakes it after a tick that
    consumed some of its audio (the `PROGRESS` event).
    """

    def __init__(self):
        self.sent = 0
        # Engine thread: reads its stream's (consumed, collected) counts while the stream holds a row.
        self._counts = None
        self._last = (0, 0)  # the counts once detached (or before the engine took the stream)
        self._waiters: set | None = None  # the engine's set of waiting backlogs, once it took the stream
        self._joined: set | None = None  # event loop: the set this backlog was added to while waiting
        self.waiting = False
        self.stream = None  # the engine's session (where PROGRESS goes), once it took the stream

    def _read(self, which: int) -> int:
        counts = self._counts
        if counts is not None:
            value = counts[which]()
            # Still attached after the read, so the row was this stream's: `detach` stores the last counts
            # and drops the readers before the row is reset.
            if self._counts is counts:
                return value
        return self._last[which]

    @property
    def consumed(self) -> int:
        return self._read(0)

    @property
    def collected(self) -> int:
        return self._read(1)

    @property
    def queued(self) -> int:
        return self.sent - self.consumed

    def start_waiting(self) -> None:
        """Event loop: an append waits for room; the next tick that consumes this stream's audio wakes it."""
        self.waiting = True
        self._joined = self._waiters  # the set joined, even if the engine lets go of the stream meanwhile
        if self._joined is not None:
            self._joined.add(self)

    def stop_waiting(self) -> None:
        self.waiting = False
        if self._joined is not None:
            self._joined.discard(self)
            self._joined = None
        waiters = self._waiters
        if waiters is not None:  # `attach` added it there if it began waiting before the engine took the stream
            waiters.discard(self)

    def attach(self, consumed, collected, waiters: set, stream) -> None:
        """Engine thread: the stream now counts its consumed and collected slots with `consumed()` and
        `collected()`; `waiters` is the engine's set of waiting backlogs."""
        self.stream, self._waiters, self._counts = stream, waiters, (consumed, collected)
        if self.waiting:  # began waiting before the engine took the stream
            waiters.add(self)

    def detach(self) -> None:
        """Engine thread, before the stream's row is reset: keeps its last counts; no more wake-ups."""
        if self._counts is not None:
            self._last = tuple(count() for count in self._counts)
            self._counts = None
        self.stream = None  # no cycle back through the engine's session
        waiters, self._waiters = self._waiters, None
        if waiters is not None:
            waiters.discard(self)


PROGRESS = object()  # delivered to a session's events when it consumed audio while an append waits


class TranscriptionSession:
    """One realtime transcription stream. Feed it PCM with `append`, end it with `finish`, and iterate it
    for `TranscriptionDelta`s followed by one `TranscriptionDone` (an engine or input error is raised from
    the iterator as an `EngineError`). Created by `AsyncEngine.start_transcription`.

    The front end (resampling and log-mel) runs on the engine's front-end worker thread, batched with
    the other sessions' appends (engine/audio_front_end.py); appends and `finish` of one session run in
    call order.
    """

    def __init__(self, link, session_id: str, delay_ms: int, front_end, transcript: TranscriptAssembler, *,
                 sample_rate: int = SAMPLING_RATE, max_queued_slots: int, max_audio_seconds: float | None = None):
        self.session_id = session_id
        self.delay_ms = delay_ms
        self._transcript = transcript  # the engine's GeneratedIds -> this session's events, on the event loop
        self.sample_rate = sample_rate
        self.max_audio_seconds = max_audio_seconds  # None: no limit
        self._samples = 0  # appended, at `sample_rate`
        self._link = link  # the engine's `SessionLink`: sends commands, never touches scheduler state
        self._front = front_end  # audio_front_end.StreamFrontEnd at `sample_rate`
        self.backlog = AudioBacklog()
        self._max_queued_slots = max_queued_slots
        self._room = asyncio.Event()  # set when the engine consumed audio or the session ended
        self._order = asyncio.Lock()  # appends and finish reach the front end in call order
        self._events: asyncio.Queue = asyncio.Queue()
        self._closed = False  # finish() or abort() called
        self._finishing: asyncio.Future | None = None  # finish()'s hand-over of the end, once called
        self.outcome: str | BaseException | None = None  # "done", an abort reason, or the error; None while live
        self._iterated = False  # the iterator has returned its last event

    async def append(self, pcm: np.ndarray, *, wait: bool = True) -> None:
        """Queues float mono PCM at the session's sample rate, of any size.

        While more than `max_queued_audio_seconds` of this session's audio waits to be computed, it waits
        for the engine to catch up (backpressure), or raises `BacklogError` with `wait=False`. Raises
        `InvalidAudioError` for unusable audio, `InvalidRequestError` for audio past the session's
        `max_audio_seconds` (these three refuse the append whole; the session goes on), `SessionClosedError`
        after `finish`/`abort` or once the session failed. Audio that arrives after the model ended the
        transcription on its own (end-of-text token) is ignored. Cancelling an append does not take back
        audio the front end already has (it still reaches the engine, in order), nor does cancelling
        `finish` take back the end.
        """
        if self._closed or (self.outcome is not None and self.outcome != "done"):
            raise SessionClosedError(f"transcription session {self.session_id} is "
                                     f"{self._describe_end()}; it takes no more audio")
        pcm = np.asarray(pcm)
        if pcm.ndim != 1 or pcm.dtype.kind != "f":
            raise self._rejected(InvalidAudioError(
                f"pcm must be a 1-D float array of mono samples, got {pcm.dtype} {pcm.shape}"))
        if self.outcome == "done":
            return
        async with self._order:
            limit = self.max_audio_seconds
            if limit is not None and (self._samples + pcm.size) / self.sample_rate > limit:
                raise self._rejected(InvalidRequestError(
                    f"session {self.session_id}: this append would pass the session's limit of {limit:g} s of "
                    f"audio (it has {self._samples / self.sample_rate:g} s); none of it was queued"))
            if not wait:  # refused whole, before the front end takes any of it
                made_ready = self._front.slots_at(self._samples + pcm.size) - self._front.slots_at(self._samples)
                if self._over_bound(made_ready):
                    raise self._rejected(BacklogError(
                        f"session {self.session_id}: more than {self._max_queued_slots * SLOT_SECONDS:g} s of "
                        "audio queued; the engine is behind (none of this append was queued)"))
            computed = self._front.push(pcm)
            self._samples += pcm.size  # now: the next append's checks count it even if this one is cancelled
            try:
                slots = await asyncio.shield(computed)
            except asyncio.CancelledError:
                # The front end takes the audio all the same: its slots must follow when they come, or the
                # stream has a hole and the engine waits for the missing slots forever.
                computed.add_done_callback(functools.partial(self._hand_on_late, pcm.size))
                raise
            except BaseException as exc:
                self._samples -= pcm.size  # refused (or the front end failed): the stream is as it was
                if isinstance(exc, AudioError):
                    raise self._rejected(InvalidAudioError(str(exc))) from None
                raise
            try:
                if wait:
                    await self._wait_for_room(len(slots))
            finally:  # cancelled while waiting too: the slots are handed on over the bound, not dropped
                self._hand_on(slots, pcm.size)

    def _hand_on(self, slots: np.ndarray, samples: int, total_slots: int | None = None) -> None:
        """Sends slots (from `samples` at the session's rate; the stream's `total_slots` at its end) to the
        engine, unless the session ended meanwhile (aborted, failed or the model finished)."""
        if self.outcome is None:
            self.backlog.sent += len(slots)
            self._link.send_audio(slots, samples * SAMPLING_RATE / self.sample_rate, total_slots=total_slots)

    def _hand_on_late(self, samples: int, computed: asyncio.Future) -> None:
        """The slots of an append cancelled while the front end had it, in append order (the worker resolves
        a stream's futures in order, before a later append's)."""
        if computed.cancelled() or computed.exception() is not None:
            self._samples -= samples  # refused: the stream is as it was
            return
        self._hand_on(computed.result(), samples)

    def _rejected(self, error: EngineError) -> EngineError:
        logger.info("transcription session %s: audio rejected (%s): %s", self.session_id, error.code, error)
        return error

    def _over_bound(self, slots: int) -> bool:
        """Whether `slots` more would pass the backlog bound; a lone oversized append always fits."""
        queued = self.backlog.queued
        return bool(queued) and queued + slots > self._max_queued_slots

    async def _wait_for_room(self, slots: int) -> None:
        """Returns once `slots` more fit under the backlog bound (or the session ended)."""
        backlog = self.backlog
        while self._over_bound(slots) and self.outcome is None:
            self._room.clear()
            backlog.start_waiting()  # before the re-check below: no wake-up is missed
            try:
                if self._over_bound(slots):
                    await asyncio.wait_for(self._room.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass  # re-check; the engine may be slow, and a wake-up is only a hint
            finally:  # a cancelled append too: the engine's set of waiters must not keep it
                backlog.stop_waiting()

    async def finish(self) -> None:
        """End of the audio: right padding is added and the remaining text flushed. Idempotent: a second call
        waits for the same end. Cancelling it does not take the end back. Should the front end fail on the
        end, the session ends with an `EngineError` that its iterator raises (finish itself returns)."""
        if self._finishing is None:
            if self._closed:  # aborted
                return
            self._closed = True
            # A task of its own: a finish() cancelled while an append holds the order lock must still end
            # the stream once the append is done (the session takes no more audio: nothing else would).
            self._finishing = asyncio.ensure_future(self._finish_in_order())
        await asyncio.shield(self._finishing)

    async def _finish_in_order(self) -> None:
        async with self._order:
            if self.outcome is not None:
                return
            computed = self._front.finish()
            computed.add_done_callback(self._hand_on_end)
            # Its error, if any, ends the session through `_hand_on_end`: the iterator raises it, not finish().
            await asyncio.wait([computed])

    def _hand_on_end(self, computed: asyncio.Future) -> None:
        if computed.cancelled():
            return
        if computed.exception() is None:
            self._hand_on(computed.result(), 0, total_slots=self._front.total_slots)
        else:
            self._end_with_error(computed.exception())

    def _end_with_error(self, exc: BaseException) -> None:
        """The front end failed on the end of the stream: the engine would wait for its last slots forever,
        so the session ends now, freeing what it holds, and its iterator raises the error."""
        if self.outcome is not None:
            return
        logger.error("transcription session %s: the front end failed on the end of its audio; ending it",
                     self.session_id, exc_info=exc)
        error = EngineError(f"transcription session {self.session_id}: the end of its audio could not be "
                            f"processed ({type(exc).__name__}: {exc}); the session is ended")
        error.__cause__ = exc
        self._link.abort("front_end_failed")
        self._put(error)

    async def abort(self, reason: str = "aborted") -> None:
        """Stops the session now and frees what it holds in the engine; the iterator ends without a
        `TranscriptionDone`. `reason` is kept in `outcome`. Idempotent."""
        self._abort_now(reason)

    def _abort_now(self, reason: str) -> None:
        self._closed = True
        if self.outcome is None:
            self.outcome = reason
            self._room.set()
            self._front.close()  # its queued front-end work is skipped
            self._link.abort(reason)

    def _describe_end(self) -> str:
        if isinstance(self.outcome, BaseException):
            return f"failed ({self.outcome})"
        return "finished" if self.outcome in (None, "done") else f"ended ({self.outcome})"

    def _put(self, event) -> None:
        """Called on the event loop with the engine's events (see `AsyncEngine`)."""
        if isinstance(event, GeneratedIds):
            if self.outcome is not None:
                return  # ids in flight when the session ended (aborted, or its decoding failed): nobody reads them
            try:
                events = self._transcript.events(event)
            except Exception as exc:  # noqa: BLE001 - an id the tokenizer rejects ends this session alone
                logger.exception("transcription session %s: decoding its tokens failed; ending it", self.session_id)
                if not event.ended:
                    self._link.abort("its tokens could not be decoded")
                events = [exc]
            for item in events:
                self._put(item)
            return
        if event is PROGRESS:
            self._room.set()
            return
        if self.outcome is None:
            if isinstance(event, TranscriptionDone):
                self.outcome = "done"
            elif isinstance(event, BaseException):
                self.outcome = event
            elif event is None:
                self.outcome = "aborted"
        if self.outcome is not None:
            self._room.set()
            self._front.close()
        self._events.put_nowait(event)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        if self._iterated:
            return  # a finished session's events were all given out once
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    self._iterated = True
                    raise event if isinstance(event, EngineError) else _as_engine_error(event)
                if event is None:  # aborted
                    self._iterated = True
                    return
                if isinstance(event, TranscriptionDone):
                    self._iterated = True
                yield event
                if self._iterated:
                    return
        finally:
            if not self._iterated:  # the consumer stopped listening before the end: free the session
                self._abort_now("consumer_stopped")
            self._iterated = True


def _as_engine_error(exc: BaseException) -> EngineError:
    """An unexpected failure inside the engine, raised to the caller with a stable code."""
    error = EngineError(f"the transcription failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
