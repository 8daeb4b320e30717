"""Realtime transcription sessions (the API of `jaxstream.transcription`): events, word timings and the
async `TranscriptionSession` handle the server, the CLI, the eval harness and the notebook use.

Time bases: the stream is left-padded with 32 silent 80 ms slots and the model writes the text of an
audio slot `n_delay` slots late, so the i-th generated token (0-based) describes real audio around
`(i + 1) * 80 ms`: its decoder slot is `prompt_len + i = 33 + n_delay + i`, minus the 32 padding slots
and the delay. Word timings use that mapping: a word starts at its `[STREAMING_WORD]` marker (or at its
first text token when no marker precedes it) and ends 80 ms after its last text token, clamped to the
audio received.
"""
import asyncio
import dataclasses

import numpy as np

SLOT_SECONDS = 0.08


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


@dataclasses.dataclass(frozen=True)
class TranscriptionDone:
    text: str
    token_ids: list[int]  # every generated id (control ids included), in order
    words: list[WordTiming]
    usage: TranscriptionUsage
    delay_ms: int


def token_time(index: int) -> float:
    """Real-audio time (s) the `index`-th generated token describes (delay already taken off)."""
    return (index + 1) * SLOT_SECONDS


def word_timings(token_ids, tokenizer, audio_seconds: float) -> list[WordTiming]:
    """Words and their times from generated ids (see the module docstring for the rule)."""
    words: list[WordTiming] = []
    current: list[int] = []  # text ids of the word being built
    start = None
    marker = None  # time of a [STREAMING_WORD] not yet attached to a word
    last_time = 0.0

    def close():
        nonlocal current, start
        text = tokenizer.decode(current).strip()
        if text:
            end = min(max(last_time + SLOT_SECONDS, start), audio_seconds)
            words.append(WordTiming(text, round(min(start, end), 3), round(end, 3)))
        current, start = [], None

    for index, token in enumerate(token_ids):
        if token == tokenizer.streaming_word_id:
            if current:
                close()
            marker = token_time(index)
            continue
        if tokenizer.is_control(token):
            continue
        piece = tokenizer.token_bytes(token)
        if current and piece[:1].isspace() and marker is None:
            close()
        if not current:
            start = marker if marker is not None else token_time(index)
            marker = None
        current.append(token)
        last_time = token_time(index)
    if current:
        close()
    return words


class TranscriptionSession:
    """One realtime transcription stream. Feed it PCM with `append`, end it with `finish`, and iterate it
    for `TranscriptionDelta`s followed by one `TranscriptionDone` (an engine or input error is raised from
    the iterator). Created by `AsyncEngine.start_transcription`."""

    def __init__(self, engine, session_id: str, delay_ms: int, front_end):
        self.session_id = session_id
        self.delay_ms = delay_ms
        self._engine = engine
        self._front = front_end  # models.audio.StreamingLogMel; used on the event-loop thread only
        self._events: asyncio.Queue = asyncio.Queue()
        self._closed = False  # finish() or abort() called
        self._ended = False  # the iterator has returned its last event

    async def append(self, pcm: np.ndarray) -> None:
        """Queues float32 mono 16 kHz PCM of any size. Raises on bad audio, after finish/abort, or when more
        than `max_queued_audio_seconds` are waiting (backpressure). Audio that arrives after the model
        ended the transcription on its own (end-of-text token) is ignored."""
        if self._closed:
            raise RuntimeError(f"transcription session {self.session_id} is finished; cannot append audio")
        pcm = np.asarray(pcm)
        if pcm.ndim != 1 or not np.issubdtype(pcm.dtype, np.floating):
            raise ValueError(f"pcm must be a 1-D float array of 16 kHz mono samples, got {pcm.dtype} "
                             f"{pcm.shape}")
        if self._ended:
            return
        self._engine._check_backlog(self.session_id, pcm.size)
        self._front.push(pcm)
        self._engine._send_audio(self.session_id, self._front.take(), pcm.size)

    async def finish(self) -> None:
        """End of the audio: right padding is added and the remaining text flushed."""
        if self._closed:
            return
        self._closed = True
        self._front.finish()
        self._engine._send_audio(self.session_id, self._front.take(), 0, total_slots=self._front.total_slots)

    async def abort(self) -> None:
        """Stops the session now; the iterator ends without a `TranscriptionDone`."""
        if not self._ended:
            self._closed = True
            self._engine._abort_transcription(self.session_id)

    def _put(self, event) -> None:
        self._events.put_nowait(event)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    self._ended = True
                    raise event
                if event is None:  # aborted
                    self._ended = True
                    return
                if isinstance(event, TranscriptionDone):
                    self._ended = True
                yield event
                if self._ended:
                    return
        finally:
            if not self._ended:  # the consumer stopped listening before the end: free the session
                self._engine._abort_transcription(self.session_id)
            self._ended = True
