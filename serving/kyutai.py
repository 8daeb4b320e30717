"""Kyutai's STT protocol (`GET /api/asr-streaming`, specs/realtime_protocols.md §9), as Kyutai's
moshi-server speaks it, over the engine's transcription sessions.

Every message is a binary WebSocket frame holding one msgpack map tagged by `type`:

    client -> server   Init (optional, ignored) · Audio{pcm: [f32], mono 24 kHz} · Marker{id: int}
    server -> client   Ready · Word{text, start_time} · EndWord{stop_time} · Step{step_idx, prs, buffered_pcm}
                       Marker{id} · Error{message}

One connection is one stream is one engine session, as a Kyutai socket holds one batch slot: the session
starts when the socket opens and `Ready` says it is held; when the engine has none free the client gets
`Error{"message": "no free channels"}` and the socket closes (the connection cap answers the same). The
stream has no end-of-audio message: it ends when the client closes. Keys: `kyutai-api-key` or `?auth_id=`
(auth.py), refused with 401 before the upgrade, as Kyutai.

How our engine's output maps onto Kyutai's events (jaxstream choices):

- Words. `WordStream` applies the engine's own word-timing rule (`jaxstream.transcription.word_timings`) to
  the token ids as the deltas bring them. A word is complete once the next one begins (its
  `[STREAMING_WORD]` marker or a space-led token), at a client Marker, or when the stream ends; then its
  `Word` and `EndWord` go out together. The times are exactly `TranscriptionDone.words`' (seconds of the
  audio sent, the model delay taken off), so they are as exact as the model's word markers: 80 ms steps,
  and the tiny model places its markers coarsely (a slot or two off).
- Markers come back once every slot of audio sent before them, plus the delay, has been computed and its
  text sent, so a client that sends trailing audio (Kyutai's clients send silence to flush) knows all the
  words before the marker are in. A marker ends the word in progress.
- `Step`: one per 80 ms frame of audio received (1920 samples), not per model step. We have no pause
  predictor: `prs` (Kyutai: probability of a pause of 0.5 / 1 / 2 / 3 s) is the length of the current
  silence, by Silero VAD (vad.py), over each horizon, capped at 1; 0 while the client speaks. Unmute reads
  `prs[2]` to end a turn, which then means "2 s of silence". `buffered_pcm`: samples handed to the engine
  and not yet computed.
- A frame we cannot use (not msgpack, not a map, an unknown type, bad pcm, OggOpus, a text frame) gets an
  `Error` and the socket stays open, where Kyutai drops the connection. Errors that end the stream (the
  engine failed) send `Error` and close.
- Timeouts are the server's shared limits (serving/limits.py), not Kyutai's 10 s ping / 20 s / 120 s.
- A draining server (app.drain) ends the stream's audio itself: the last words go out, then an `Error` saying
  the server is shutting down and the words cover only the first N s of audio received (audio sent after it is
  dropped), then every pending `Marker`, then the close (1001). Kyutai's server has no drain to follow.
"""
import asyncio
import logging
import math
import typing

import msgpack
import numpy as np

from jaxstream.errors import CapacityError, DrainingError, EngineError, InvalidAudioError
from jaxstream.models.audio import MAX_SAMPLE_MAGNITUDE, SLOT_SECONDS, n_delay_from_ms, prompt_length
from jaxstream.serving import wire_json
from jaxstream.serving.engine_sessions import start_session
from jaxstream.serving.limits import CLOSE_CAPACITY, CLOSE_GOING_AWAY, CLOSE_INTERNAL_ERROR, Breach, drain_notice
from jaxstream.serving.vad import SpeechDetector, VadConfig
from jaxstream.serving.websocket import ConnectionClosed
from jaxstream.transcription import TranscriptionDelta, TranscriptionDone, WordTiming, word_timings

logger = logging.getLogger(__name__)

ROUTE = "/api/asr-streaming"
INPUT_RATE = 24000  # Kyutai's audio rate (Mimi's); the engine resamples
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: Kyutai's frame, one Step each
PAUSE_HORIZONS_S = (0.5, 1.0, 2.0, 3.0)  # what each of Step's `prs` is about (Kyutai's heads)
NO_FREE_CHANNELS = "no free channels"  # Kyutai's exact words: clients match them to mean "at capacity"
_VAD_SILENCE_MS = 100  # silence the VAD must see before it reports it (then dated from its start)
_OUTBOX_LIMIT = 256  # messages queued for a slow reader before the connection stops reading audio
_MARKER_POLL_S = 0.02


class KyutaiError(Exception):
    """A frame the protocol cannot use: answered with an `Error` message, the socket stays open."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


class WordStream:
    """Complete words, with times, from a stream's generated token ids as they arrive.

    It runs `word_timings` (the engine's rule, so the words equal `TranscriptionDone.words`) over a window
    that starts where the word in progress starts, not over the whole stream: cost per delta stays
    small on streams of any length. `base` is the stream index of the window's first id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window: list[int] = []
        self.base = 0  # index of window[0] among every generated id
        self.generated = 0  # ids received so far

    def push(self, token_ids, audio_seconds: float) -> list[WordTiming]:
        """The words `token_ids` completed (the last word may still grow: it is kept); `audio_seconds`:
        the audio received, which bounds the times as `word_timings` does."""
        self.window += token_ids
        self.generated += len(token_ids)
        bounds = word_timings(self.window, self.tokenizer, math.inf)  # unclamped: where each word lies
        if len(bounds) < 2:
            return []
        # The kept word starts at its marker or its first text id i, at token_time(i) = (i + 1) * 80 ms.
        return self._take(len(bounds) - 1, round(bounds[-1].start / SLOT_SECONDS) - 1, audio_seconds)

    def flush(self, token_ids=(), audio_seconds: float = math.inf) -> list[WordTiming]:
        """Every word so far, the last one too: a marker closes it, or the end of the stream (then
        `token_ids` are the ids no delta carried and `audio_seconds` the stream's length)."""
        self.window += token_ids
        self.generated += len(token_ids)
        bounds = word_timings(self.window, self.tokenizer, math.inf)
        if not bounds:
            return []
        # Keep what follows the last word's last text id i (a `[STREAMING_WORD]` opening the next word):
        # its unclamped end is token_time(i) + 80 ms = (i + 2) * 80 ms.
        return self._take(len(bounds), round(bounds[-1].end / SLOT_SECONDS) - 1, audio_seconds)

    def _take(self, count: int, keep_from: int, audio_seconds: float) -> list[WordTiming]:
        """The window's first `count` words in stream time; the window then starts at its id `keep_from`.
        (Stream times come from the ids' stream indices, not from shifting window times by an offset,
        whose float rounding moved a time by a millisecond.)"""
        words = word_timings(self.window, self.tokenizer, audio_seconds, first_index=self.base)[:count]
        self.window = self.window[keep_from:]
        self.base += keep_from
        return words


class _Marker(typing.NamedTuple):
    id: int
    slot: int  # slots whose ids the engine must have collected for the audio before it, plus the delay


class KyutaiAsr:
    """The protocol on one connection (see the module docstring); built per connection by the app."""

    def __init__(self, conn, server):
        self.conn = conn
        self.server = server
        self.limits = server.config.limits
        self.session = None
        self.words: WordStream | None = None
        self.detector: SpeechDetector | None = None
        self.samples = 0  # 24 kHz samples received
        self.steps = 0  # Step messages sent
        self.silence_from: int | None = 0  # sample where the current silence began; None while speaking
        self.ended = False  # the engine finished the stream (model end of text, or the drain)
        self.draining = False
        self.markers: list[_Marker] = []
        self._marker_added = asyncio.Event()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._room = asyncio.Event()  # set while the outbox is under its limit
        self._room.set()
        self._tasks: list[asyncio.Task] = []

    # -- protocol interface (serving.websocket) --------------------------------------------------------
    async def run(self) -> None:
        if not await self._start():
            return
        async for kind, data in self.conn.frames():
            try:
                if kind == "text":
                    raise KyutaiError("invalid_frame", "Text frames are not part of this protocol: send each "
                                      "message as a msgpack map in a binary frame")
                await self._handle(data)
            except KyutaiError as exc:
                self._error(exc.code, exc.message)
            except EngineError as exc:
                if isinstance(exc, InvalidAudioError):
                    self._error(exc.code, f"Invalid audio: {exc}")
                else:  # the stream is over (engine stopped, session failed): nothing more can be done
                    self._fail(exc)
                    return
            if self._outbox.qsize() > _OUTBOX_LIMIT:  # a client that does not read stops being read
                self._room.clear()
                await self._room.wait()

    def busy(self) -> bool:
        return self.session is not None and not self.ended

    async def finish_for_drain(self) -> None:
        """Ends the audio now: the last words and every pending marker go out, then the socket closes."""
        self.draining = True
        if self.session is not None and not self.ended:
            await self.session.finish()  # `_forward_events` queues the rest, then the close
        elif self._tasks:
            self._put(_CLOSE)  # after what is queued
        else:
            self.conn.stop(self.server.drain_breach())

    async def release(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.detector is not None:
            self.detector.close()
        session, self.session = self.session, None
        if session is not None and not self.ended:
            await session.abort(reason="client_disconnected")
            self.server.metrics.utterances.labels(outcome="aborted").inc()

    def error_event(self, code: str, message: str) -> bytes:
        return pack({"type": "Error", "message": NO_FREE_CHANNELS if code == "capacity" else message})

    # -- start ----------------------------------------------------------------------------------------
    async def _start(self) -> bool:
        engine = self.server.engine
        if engine.kind != "realtime":
            self.conn.stop(Breach("not_realtime", CLOSE_INTERNAL_ERROR, "invalid_request",
                                  "This server serves a text model: speech-to-text is not available"))
            return False
        try:
            self.session = await start_session(engine, None, sample_rate=INPUT_RATE,
                                               max_audio_seconds=self.limits.max_audio_seconds)
        except CapacityError:
            self.conn.stop(Breach("refused_capacity", CLOSE_CAPACITY, "capacity", NO_FREE_CHANNELS))
            return False
        except DrainingError as exc:
            self.conn.stop(Breach("refused_draining", CLOSE_GOING_AWAY, exc.code, str(exc)))
            return False
        except EngineError as exc:
            self.conn.stop(Breach("engine_error", CLOSE_INTERNAL_ERROR, exc.code, str(exc)))
            return False
        self.conn.utterances += 1
        self.words = WordStream(engine.tokenizer)
        self.detector = SpeechDetector(VadConfig(silence_duration_ms=_VAD_SILENCE_MS), INPUT_RATE)
        for work in (self._send_outbox, self._forward_events, self._answer_markers):
            task = asyncio.create_task(work(), name=f"{self.conn.id}-{work.__name__.strip('_')}")
            task.add_done_callback(self._task_ended)
            self._tasks.append(task)
        self._put({"type": "Ready"})
        return True

    # -- client messages ------------------------------------------------------------------------------
    async def _handle(self, data: bytes) -> None:
        try:
            message = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            # msgpack's FormatError (a byte no message starts with) has no text of its own.
            reason = str(exc) or f"{type(exc).__name__}: byte {data[:1].hex()} starts no msgpack value"
            raise KyutaiError("invalid_msgpack", f"The frame is not one msgpack message: {reason}") from None
        if not isinstance(message, dict):
            raise KyutaiError("invalid_message", "Each message must be a msgpack map with a `type` key")
        kind = message.get("type")
        if kind == "Audio":
            await self._on_audio(message.get("pcm"))
        elif kind == "Marker":
            self._on_marker(message.get("id"))
        elif kind == "Init":
            pass  # Kyutai's batched server sends Ready for it; ours was sent when the socket opened
        elif kind == "OggOpus":
            raise KyutaiError("unsupported_format", "OggOpus is not supported: send Audio with float PCM, "
                              "mono, 24 kHz")
        else:
            raise KyutaiError("unknown_message", f"Unknown message type: {wire_json.shown(repr(kind))} "
                              "(expected Audio, Marker or Init)")

    async def _on_audio(self, pcm) -> None:
        if not isinstance(pcm, list):
            raise KyutaiError("invalid_audio", "Audio.pcm must be an array of float samples")
        if len(pcm) > self.limits.max_append_seconds * INPUT_RATE:
            raise KyutaiError("invalid_audio", f"Audio.pcm holds more than {self.limits.max_append_seconds:g} s "
                              "of audio; send it in frames of 1920 samples")
        if not all(type(v) in (float, int) for v in pcm):
            raise KyutaiError("invalid_audio", "Audio.pcm must hold numbers only")
        samples = np.asarray(pcm, np.float64)
        # Checked here: the error is then Kyutai's, and neither the engine nor the VAD sees the samples.
        if not np.isfinite(samples).all():
            raise KyutaiError("invalid_audio", "Audio.pcm holds a NaN or an infinity")
        if samples.size and np.abs(samples).max() > MAX_SAMPLE_MAGNITUDE:
            raise KyutaiError("invalid_audio", "Audio.pcm must be float samples in [-1, 1], got one of magnitude "
                              f"{np.abs(samples).max():.6g}")
        samples = samples.astype(np.float32)
        seconds = samples.size / INPUT_RATE
        if self.conn.audio_seconds + seconds > self.limits.max_audio_seconds:
            raise KyutaiError("audio_limit_exceeded", f"This connection reached its limit of "
                              f"{self.limits.max_audio_seconds:g} s of audio; open a new one")
        if not samples.size or self.draining:
            return  # while draining, the session's audio is already finished
        await self.session.append(samples)  # waits while the engine has too much of this stream queued
        self.conn.audio_seconds += seconds
        self.server.metrics.audio_seconds.inc(seconds)
        await self._steps(samples)

    def _on_marker(self, marker_id) -> None:
        if type(marker_id) is not int or not -2**63 <= marker_id < 2**63:
            raise KyutaiError("invalid_marker",
                              f"Marker.id must be a 64-bit integer, got {wire_json.shown(repr(marker_id))}")
        if self.ended:  # every word is out already
            self._put({"type": "Marker", "id": marker_id})
            return
        frames = -(-self.samples // FRAME_SAMPLES)
        # Generated token i comes from decoder position prompt_len - 1 + i and describes the audio up to
        # (i + 1) * 80 ms; one mel slot is consumed per position. The last frame before the marker is
        # token frames - 1, dispatched once prompt_len - 1 + frames slots are consumed.
        n_delay = n_delay_from_ms(self.session.delay_ms)
        slot = prompt_length(n_delay, self.server.engine.model_config.n_left_pad_tokens) - 1 + frames
        self.markers.append(_Marker(marker_id, slot))
        self._marker_added.set()

    async def _steps(self, samples: np.ndarray) -> None:
        """One Step per 80 ms frame the new samples complete, with the VAD's pause estimates."""
        self.samples += samples.size
        events = await self.detector.push(samples)  # in stream order; the VAD reports a little late
        buffered = self.session.backlog.queued * FRAME_SAMPLES
        for step in range(self.steps, self.samples // FRAME_SAMPLES):
            end = (step + 1) * FRAME_SAMPLES
            while events and events[0].sample < end:
                event = events.pop(0)
                self.silence_from = None if event.kind == "started" else event.sample
            silence = 0.0 if self.silence_from is None else (end - self.silence_from) / INPUT_RATE
            prs = [min(1.0, silence / horizon) for horizon in PAUSE_HORIZONS_S]
            self._put({"type": "Step", "step_idx": step, "prs": prs, "buffered_pcm": buffered})
        self.steps = self.samples // FRAME_SAMPLES
        for event in events:  # inside the frame not yet complete: they count from its Step on
            self.silence_from = None if event.kind == "started" else event.sample

    # -- server messages ------------------------------------------------------------------------------
    def _put(self, message: dict) -> None:
        self._outbox.put_nowait(message)

    def _put_words(self, words) -> None:
        for word in words:
            self._put({"type": "Word", "text": word.word, "start_time": word.start})
            self._put({"type": "EndWord", "stop_time": word.end})

    def _error(self, code: str, message: str, *, budget: bool = True) -> None:
        """`budget`: whether it counts against the connection's error budget (the client's conduct)."""
        self.conn.count_error(code, budget=budget)
        self._put({"type": "Error", "message": message})

    def _fail(self, exc: EngineError) -> None:
        logger.warning("%s: the stream failed: %s", self.conn.id, exc)
        self.conn.stop(Breach("engine_error", CLOSE_INTERNAL_ERROR, exc.code, str(exc) or type(exc).__name__))

    async def _send_outbox(self) -> None:
        """Sends the queued messages in order, one at a time (a slow reader stalls only itself)."""
        while True:
            message = await self._outbox.get()
            if message is _CLOSE:
                self.conn.stop(self.server.drain_breach())
                return
            await self.conn.send(pack(message))
            if self._outbox.qsize() <= _OUTBOX_LIMIT:
                self._room.set()

    async def _forward_events(self) -> None:
        """Engine events -> Word/EndWord. Never waits but for the next event, so that once the engine has
        handed events over they are in the outbox within two loop turns (`_answer_markers` counts on it)."""
        metrics = self.server.metrics
        try:
            async for event in self.session:
                if isinstance(event, TranscriptionDelta):
                    self._put_words(self.words.push(event.token_ids, self.samples / INPUT_RATE))
                elif isinstance(event, TranscriptionDone):
                    tail = event.token_ids[self.words.generated:]
                    self._put_words(self.words.flush(tail, event.usage.audio_seconds))
                    if self.draining:  # after the last words, before the markers a client waits for
                        self._error("server_draining", drain_notice(event.usage.audio_seconds), budget=False)
                    self.ended = True
                    metrics.utterances.labels(outcome="done").inc()
        except EngineError as exc:
            metrics.utterances.labels(outcome="error").inc()
            self.ended = True
            self._fail(exc)
            return
        if not self.ended:  # aborted: the connection is ending anyway
            return
        for marker in self.markers:  # all the audio is computed: every marker is due
            self._put({"type": "Marker", "id": marker.id})
        self.markers.clear()
        if self.draining:
            self._put(_CLOSE)

    async def _answer_markers(self) -> None:
        """Sends each marker once the text of the audio before it is out: the engine has collected the ids
        of the marker's last frame (`AudioBacklog.collected`), so their events are already on this loop."""
        backlog = self.session.backlog
        while True:
            if not self.markers:
                self._marker_added.clear()
                await self._marker_added.wait()
            await asyncio.sleep(_MARKER_POLL_S)
            collected = backlog.collected
            due = next((i for i, marker in enumerate(self.markers) if marker.slot > collected), len(self.markers))
            if not due or self.ended:
                continue  # after the end, `_forward_events` answers them all
            # The engine posted those events before it raised the count: two loop turns let them run through
            # `_forward_events` into the outbox, ahead of the markers.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if self.ended:
                continue
            self._put_words(self.words.flush(audio_seconds=self.samples / INPUT_RATE))
            for marker in self.markers[:due]:
                self._put({"type": "Marker", "id": marker.id})
            del self.markers[:due]

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, ConnectionClosed):
            logger.error("%s: %s failed", self.conn.id, task.get_name(), exc_info=error)
            self.conn.stop(Breach("server_error", CLOSE_INTERNAL_ERROR, "processing_error",
                                  "Internal server error; the connection is closed"))


_CLOSE = object()  # in the outbox: everything before it is sent; close for the drain
