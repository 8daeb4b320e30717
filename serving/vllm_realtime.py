"""vLLM's realtime protocol (`GET /v1/realtime`; SageMaker's `/invocations-bidirectional-stream` too) over
the engine's transcription sessions. Wire reference: specs/realtime_protocols.md §1-§3, §6.

One connection holds at most one running utterance (one engine session): `commit{}` starts it,
`append`s feed it, `commit{final: true}` ends its audio, and the server sends `transcription.delta`s and
one `transcription.done`. Then the next utterance may start on the same socket.

Where vLLM 0.33 silently misbehaves, the default ("strict") mode answers instead ([B] items); with
`compat="vllm"` a client sees what vLLM would send:

| situation                         | strict                                  | vllm                    |
|-----------------------------------|-----------------------------------------|-------------------------|
| valid session.update              | `session.updated`                       | nothing                 |
| `"model": ""`                     | `model_not_found`                       | accepted                |
| base64 with junk characters       | `invalid_audio`                         | junk dropped, decoded   |
| commit{} while an utterance runs  | `generation_in_progress`                | ignored                 |
| commit{} after final, before done | queued: starts when `done` is sent      | ignored                 |
| append after final, before done   | kept for the next utterance             | dropped                 |
| final with no utterance running   | `no_active_generation` (nothing else)   | ignored                 |
| final with no audio (empty commit)| `input_audio_buffer_commit_empty`       | empty `done`            |
| binary frame                      | `invalid_frame`, socket kept            | socket closed (1003)    |
| `transcription.done` extras       | `words`, `usage.audio_seconds`          | none                    |
| engine error in a generation      | the engine's code (`engine_dead`, ...)  | `processing_error`      |
| drain ends an utterance's audio   | `server_draining` error, then its done  | its done only           |
|                                   | with `truncated`, `truncation`          |                         |

Neither mode reproduces vLLM's bugs: a stray `final` never poisons the next utterance, and deltas are never
empty (the engine streams text only). On the SageMaker route binary frames are UTF-8 JSON.

A draining server (SIGTERM: app.drain) ends the audio of an utterance the client has not finalised by its
deadline, as a final commit would; its `transcription.done` then covers only the audio received, and strict
mode says so first: an `error` `server_draining` after its last delta, naming the seconds of audio transcribed.
The done says it again, for a client that reads the done alone (one that passes over `error` events, or takes
the transcript from the done): `"truncated": true, "truncation": {"code": "server_draining", "message",
"audio_seconds"}` (the notice's code and message, the seconds transcribed); the done of an utterance the client
ended has neither field. Audio appended after that is dropped, and the socket closes with 1001 after the done.
A connection with no utterance taking audio gets only that close ("server shutting down"): no transcript of it is
cut short.

Server VAD, a jaxstream extension (strict mode only; `--compat vllm` ignores the field as vLLM does):
`session.update` may carry OpenAI's `turn_detection` object (`{"type": "server_vad", "threshold",
"prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"}`, `{"type": "semantic_vad", "eagerness"}`, or
null to turn it off; serving/vad.py), echoed in `session.updated`. Then the server segments the audio with
Silero and the client's commits are not needed:

- speech start: `jaxstream.speech_started{audio_start_ms}`; an utterance starts with `prefix_padding_ms` of
  the audio before the speech. Audio outside speech is not transcribed.
- speech end: `jaxstream.speech_stopped{audio_end_ms}`; the utterance's audio ends (as `commit{final}`), its
  `transcription.done` follows. Each `speech_started` is answered by exactly one `transcription.done` or
  `error`, in order: a turn that starts while the previous one finishes transcribes at once, and its
  events follow the previous `done`.
- `idle_timeout_ms` of no speech: `jaxstream.timeout_triggered{audio_start_ms, audio_end_ms}` (nothing to
  transcribe: no utterance).
- `commit{}` does nothing; `commit{final: true}` ends the turn in progress there (its `done` follows, no
  `speech_stopped`), and the next speech is a new turn.
- Times are milliseconds of the connection's audio stream; `turn_detection` changes only while no
  utterance takes audio, and audio held for the next commit when it is turned on is segmented too.
"""
import asyncio
import json
import logging
import secrets
import time

import numpy as np

from jaxstream.engine.transcription_session import TranscriptionDelta, TranscriptionDone
from jaxstream.errors import EngineError
from jaxstream.models.audio import SAMPLING_RATE  # the protocol's audio rate, never negotiated
from jaxstream.serving import wire_json
from jaxstream.serving.audio_codecs import AudioDecodeError, decode_pcm16_base64
from jaxstream.serving.engine_sessions import failure_of, start_session
from jaxstream.serving.limits import CLOSE_UNSUPPORTED_DATA, Breach, drain_notice, drain_truncation
from jaxstream.serving.vad import (TurnDetectionError, TurnSegmenter, parse_turn_detection, start_turn_segmenter,
                                   vad_config)
from jaxstream.serving.websocket import ConnectionClosed

logger = logging.getLogger(__name__)

MODEL_NOT_VALIDATED = ("Model not validated. Make sure to validate the model by sending a session.update "
                       "event.")

# How binary frames are treated: an error (strict /v1/realtime), a close (vLLM), or text (SageMaker).
BINARY_ERROR, BINARY_CLOSE, BINARY_AS_TEXT = "error", "close", "text"


class ProtocolError(Exception):
    """A client mistake answered with an `error` event; the socket stays open."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class _Utterance:
    """One engine transcription session and its timings."""

    def __init__(self, session):
        self.session = session
        self.samples = 0
        self.finalizing = False  # the final commit was received (no more audio for this one)
        self.drained = False  # the server's drain ended its audio, not the client: its done comes with a notice
        self.failed = False  # an error was already reported for it (report once)
        self.first_audio_at: float | None = None
        self.final_at: float | None = None
        self.first_delta_seen = False
        self.pump: asyncio.Task | None = None
        self.after: asyncio.Task | None = None  # VAD: the previous turn's pump, whose events go out first


class VllmRealtime:
    """The protocol on one connection (see the module docstring); built per connection by the app."""

    def __init__(self, conn, server, *, binary_frames: str):
        self.conn = conn
        self.server = server
        self.compat = server.config.vllm_compat
        self.binary_frames = binary_frames
        self.limits = server.config.limits
        self.session_id = f"sess-{secrets.token_hex(8)}"
        self.validated = False
        self.delay_ms: int | None = None  # None: the engine's default
        self.pending: list[np.ndarray] = []  # audio appended while no utterance runs
        self.pending_samples = 0
        self.utterance: _Utterance | None = None
        self.next_commit = False  # strict: commit{} received during finalisation, starts at done
        # ... and its final commit too: the number of `pending` chunks that are its audio (later ones are the
        # next utterance's); None: no final yet
        self.next_final: int | None = None
        self.discarding = False  # strict: the engine ended the utterance early; drop audio until a commit
        self.turn_detection: dict | None = None  # VAD settings (the extension in the module docstring)
        self.segmenter: TurnSegmenter | None = None
        self.stream_samples = 0  # audio appended on this connection, the VAD's clock
        self._live: set[_Utterance] = set()  # every utterance whose engine session is not over
        self._last_pump: asyncio.Task | None = None  # the latest utterance's
        self._lock = asyncio.Lock()  # one state transition at a time (reader vs. event pumps)
        self._pumps: set[asyncio.Task] = set()
        self._handlers = {
            "session.update": self._on_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.commit": self._on_commit,
        }

    # -- protocol interface (serving.websocket) --------------------------------------------------------
    async def run(self) -> None:
        await self.conn.send({"type": "session.created", "id": self.session_id, "created": int(time.time())})
        async for kind, data in self.conn.frames():
            if kind == "binary":
                if self.binary_frames == BINARY_CLOSE:
                    self.conn.stop(Breach("binary_frame", CLOSE_UNSUPPORTED_DATA, None,
                                          "binary frames are not supported"))
                    return
                if self.binary_frames == BINARY_ERROR:
                    await self._error("invalid_frame", "Binary frames are not supported: send each event as "
                                      "a JSON text frame")
                    continue
                try:
                    data = data.decode("utf-8")
                except UnicodeDecodeError:
                    await self._error("invalid_json", "Invalid JSON" if self.compat
                                      else "Invalid JSON: the binary frame is not UTF-8 text")
                    continue
            async with self._lock:
                await self._handle(data)
            if self.server.draining and not self.busy():
                self.conn.stop(self.server.drain_breach())

    def busy(self) -> bool:
        return self.utterance is not None or self.next_commit or bool(self._live)

    async def finish_for_drain(self) -> None:
        async with self._lock:
            self.next_commit, self.next_final = False, None
            utterance = self.utterance
            if utterance is not None and not utterance.finalizing:
                utterance.drained = True
                try:
                    await self._finalize(utterance)
                except (ProtocolError, EngineError) as exc:
                    logger.info("%s: finishing the utterance for the drain: %s", self.conn.id, exc)
            if not self.busy():  # nothing was running, or it was empty and dropped
                self.conn.stop(self.server.drain_breach())

    async def release(self) -> None:
        self.pending.clear()
        if self.segmenter is not None:
            self.segmenter.close()
        live, self._live = list(self._live), set()  # before the pumps end and forget them
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self.utterance = None
        for utterance in live:
            utterance.failed = True
            await utterance.session.abort(reason="client_disconnected")
            self.server.metrics.utterances.labels(outcome="aborted").inc()

    def error_event(self, code: str, message: str) -> dict:
        return {"type": "error", "error": message, "code": code}

    # -- client events --------------------------------------------------------------------------------
    async def _handle(self, text: str) -> None:
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):
            await self._error("invalid_json", "Invalid JSON")
            return
        try:
            if not isinstance(event, dict):
                raise ProtocolError("processing_error", "Each event must be a JSON object with a type field")
            kind = event.get("type")
            handler = self._handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise ProtocolError("unknown_event", f"Unknown event type: {wire_json.shown(kind)}")
            await handler(event)
        except ProtocolError as exc:
            await self._error(exc.code, exc.message)
        except EngineError as exc:
            await self._error(exc.code, str(exc))
        except ConnectionClosed:
            raise
        except Exception:  # noqa: BLE001 - a bug must not cost the client its socket (vLLM does the same)
            logger.exception("%s: error handling an event", self.conn.id)
            await self._error("processing_error", "Internal error while handling the event")

    async def _on_update(self, event: dict) -> None:
        model = event.get("model")
        if model is None:
            raise ProtocolError("invalid_event", "Missing required field: model")
        if not isinstance(model, str) or not self.server.serves_model(model, allow_empty=self.compat):
            raise ProtocolError("model_not_found", f"The model `{wire_json.shown(model)}` does not exist.")
        delay = event.get("transcription_delay_ms")
        if delay is not None:
            allowed = self.server.allowed_delays_ms
            if isinstance(delay, bool) or not isinstance(delay, int) or delay not in allowed:
                # Shown as JSON would write it: a string "480" must not read as the number it holds.
                got = json.dumps(wire_json.shown(delay)) if isinstance(delay, str) else wire_json.shown(delay)
                raise ProtocolError("invalid_request", f"transcription_delay_ms must be an integer, one of "
                                    f"{', '.join(map(str, allowed))}; got {got}")
        vad_asked = "turn_detection" in event and not self.compat  # vLLM ignores unknown fields
        turn_detection = self._parse_turn_detection(event["turn_detection"]) if vad_asked else self.turn_detection
        vad_moves = turn_detection != self.turn_detection
        if vad_moves and (self.next_commit or (self.utterance is not None and not self.utterance.finalizing)):
            raise ProtocolError("invalid_request", "turn_detection cannot change while a transcription takes "
                                "audio: send input_audio_buffer.commit with final=true first")
        # Built before anything changes (building may fail): a failed update leaves the session as it was.
        segmenter = None
        if vad_moves and turn_detection is not None:  # its clock starts with the audio held for a commit
            segmenter = await start_turn_segmenter(vad_config(turn_detection), SAMPLING_RATE,
                                                   self.stream_samples - self.pending_samples)
        self.delay_ms = delay if delay is not None else self.delay_ms
        self.validated = True
        if self.compat:
            return
        session = {"id": self.session_id, "model": self.server.model_id,
                   "transcription_delay_ms": self.delay_ms or self.server.engine.default_delay_ms}
        if vad_asked or self.turn_detection is not None:  # clients that never ask see vLLM's fields only
            session["turn_detection"] = turn_detection
        if vad_moves:
            self.turn_detection = turn_detection
            if self.segmenter is not None:
                self.segmenter.close()
            self.segmenter = segmenter
            self.discarding = False  # an utterance the engine ended early is no one's once the turns change
        await self.conn.send({"type": "session.updated", "session": session})
        if segmenter is not None:  # audio held for the next commit goes through the new VAD (no utterance runs)
            held, self.pending, self.pending_samples = self.pending, [], 0
            for pcm in held:
                await self._segment(pcm)

    def _parse_turn_detection(self, value) -> dict | None:
        try:
            return parse_turn_detection(value)
        except TurnDetectionError as exc:
            raise ProtocolError("invalid_request", f"turn_detection.{exc}" if exc.field else str(exc)) from None

    async def _on_append(self, event: dict) -> None:
        if "audio" not in event:
            raise ProtocolError("processing_error", "Missing required field: audio")
        if not isinstance(event["audio"], str):
            raise ProtocolError("processing_error", "Field audio must be a base64 string")
        try:
            pcm = decode_pcm16_base64(event["audio"], strict=not self.compat,
                                      max_samples=int(self.limits.max_append_seconds * SAMPLING_RATE))
        except AudioDecodeError as exc:
            logger.debug("%s: invalid audio: %s", self.conn.id, exc)
            raise ProtocolError("invalid_audio", "Invalid audio data" if self.compat
                                else f"Invalid audio data: {exc}") from None
        seconds = pcm.size / SAMPLING_RATE
        if self.conn.audio_seconds + seconds > self.limits.max_audio_seconds:
            raise ProtocolError("audio_limit_exceeded", f"This connection reached its limit of "
                                f"{self.limits.max_audio_seconds:g} s of audio; open a new one")
        if self.segmenter is None:
            await self._route(pcm)
        else:
            await self._segment(pcm)
        self.stream_samples += pcm.size
        self.conn.audio_seconds += seconds
        self.server.metrics.audio_seconds.inc(seconds)

    async def _route(self, pcm: np.ndarray) -> None:
        """Audio to the running utterance, or held for the next one, or dropped (see the module docstring)."""
        utterance = self.utterance
        if utterance is not None and not utterance.finalizing:
            await self._feed(utterance, pcm)
        elif ((utterance is not None and self.compat) or self.discarding or self.segmenter is not None
              or self.server.draining):
            pass  # vLLM drains audio sent between final and done; strict drops audio the engine won't use, and
            # with VAD a turn's audio belongs to no later turn; a draining server starts no later utterance (held,
            # it would only reach max_pending_seconds and answer a client whose utterance the drain ended with
            # audio_limit_exceeded)
        else:
            if self.pending_samples + pcm.size > self.limits.max_pending_seconds * SAMPLING_RATE:
                raise ProtocolError("audio_limit_exceeded", f"More than {self.limits.max_pending_seconds:g} s "
                                    "of audio appended while no transcription runs; send "
                                    "input_audio_buffer.commit to start one")
            self.pending.append(pcm)
            self.pending_samples += pcm.size

    async def _segment(self, pcm: np.ndarray) -> None:
        """VAD: each turn is an utterance, started at speech start and finalised at speech end. A turn whose
        start or audio fails is reported and the rest of it dropped; the next turn starts afresh."""
        segmenter = self.segmenter
        for turn in await segmenter.push(pcm):
            try:
                if turn.kind == "started":
                    await self.conn.send({"type": "jaxstream.speech_started",
                                          "audio_start_ms": segmenter.ms(turn.sample)})
                    await self._start(after=self._last_pump)  # a previous turn's events go out first
                    await self._route(turn.audio)
                elif turn.kind == "speech":
                    await self._route(turn.audio)
                elif turn.kind == "stopped":
                    await self._route(turn.audio)
                    await self.conn.send({"type": "jaxstream.speech_stopped",
                                          "audio_end_ms": segmenter.ms(turn.sample)})
                    await self._end_turn()
                else:
                    await self.conn.send({"type": "jaxstream.timeout_triggered", "audio_start_ms":
                                          segmenter.ms(turn.idle_from), "audio_end_ms": segmenter.ms(turn.sample)})
            except (ProtocolError, EngineError) as exc:  # the rest of the turn has no utterance: dropped
                await self._error(exc.code, str(exc))

    async def _end_turn(self) -> None:
        utterance = self.utterance
        if utterance is not None and not utterance.finalizing:
            await self._finalize(utterance)

    async def _on_commit(self, event: dict) -> None:
        if not self.validated:
            raise ProtocolError("model_not_validated", MODEL_NOT_VALIDATED)
        final = event.get("final", False)
        if not isinstance(final, bool):
            raise ProtocolError("processing_error", f"Field final must be a boolean, got {wire_json.shown(final)}")
        if self.segmenter is not None:  # VAD: the server commits; final ends the turn in progress
            if final:
                self.segmenter.restart()
                await self._end_turn()
            return
        utterance = self.utterance
        if not final:
            self.discarding = False
            if utterance is None:
                await self._start()
            elif self.compat:
                logger.debug("%s: commit ignored, a generation is running (vLLM behaviour)", self.conn.id)
            elif not utterance.finalizing or self.next_commit:
                raise ProtocolError("generation_in_progress", "A transcription is already running: send "
                                    "input_audio_buffer.commit with final=true and wait for transcription.done")
            else:
                self.next_commit = True
        elif utterance is not None and not utterance.finalizing:
            await self._finalize(utterance)
        elif self.next_commit and self.next_final is None:
            self.next_final = len(self.pending)
        elif self.discarding:
            self.discarding = False  # the engine had already ended this utterance and sent its done
        elif self.compat:
            return
        elif utterance is not None:  # a second final: the code says no generation takes audio; the words why
            raise ProtocolError("no_active_generation", "The running transcription's audio has already ended "
                                "(final was sent): wait for its transcription.done")
        else:
            raise ProtocolError("no_active_generation", "No transcription is running: send "
                                "input_audio_buffer.commit without final to start one")

    # -- utterances -----------------------------------------------------------------------------------
    async def _start(self, after: asyncio.Task | None = None, held: int | None = None) -> None:
        """A new utterance, fed the first `held` chunks of `pending` (None: all of them)."""
        if self.server.draining:
            raise ProtocolError("draining", "The server is shutting down and starts no new transcription")
        session = await start_session(self.server.engine, self.delay_ms,
                                      max_audio_seconds=self.limits.max_audio_seconds)
        utterance = _Utterance(session)
        utterance.after = after
        self.utterance = utterance
        self._live.add(utterance)
        self.conn.utterances += 1
        utterance.pump = asyncio.create_task(self._pump(utterance), name=f"{self.conn.id}-events")
        self._pumps.add(utterance.pump)
        utterance.pump.add_done_callback(self._pumps.discard)
        self._last_pump = utterance.pump
        held = len(self.pending) if held is None else held
        mine, self.pending = self.pending[:held], self.pending[held:]
        self.pending_samples -= sum(pcm.size for pcm in mine)
        for pcm in mine:
            await self._feed(utterance, pcm)

    async def _feed(self, utterance: _Utterance, pcm: np.ndarray) -> None:
        if utterance.first_audio_at is None:
            utterance.first_audio_at = time.monotonic()
        try:
            await utterance.session.append(pcm)  # waits while the engine has too much audio queued
        except EngineError:
            reported = utterance.failed  # the event pump may have reported the same failure already
            utterance.failed = True
            await self._drop(utterance, outcome=None if reported else "error")
            if not reported:
                raise
            return
        utterance.samples += pcm.size

    async def _finalize(self, utterance: _Utterance) -> None:
        utterance.finalizing = True
        if utterance.samples == 0 and not self.compat:
            utterance.failed = True
            await self._drop(utterance, outcome="empty")
            raise ProtocolError("input_audio_buffer_commit_empty", "Cannot finalise an empty transcription: no "
                                "audio was appended since input_audio_buffer.commit")
        utterance.final_at = time.monotonic()
        await utterance.session.finish()

    async def _drop(self, utterance: _Utterance, *, outcome: str | None) -> None:
        """Ends `utterance` without a done (the caller reports why; outcome None: counted already)."""
        if self.utterance is utterance:
            self.utterance = None
        self._live.discard(utterance)
        await utterance.session.abort(reason=outcome or "error")
        if outcome is not None:
            self.server.metrics.utterances.labels(outcome=outcome).inc()

    async def _pump(self, utterance: _Utterance) -> None:
        """Engine events -> wire events, for one utterance; then the next queued utterance starts."""
        metrics = self.server.metrics
        finished = False
        try:
            if utterance.after is not None:  # no item ids in this protocol: one utterance's events at a time
                await asyncio.wait({utterance.after})
            async for event in utterance.session:
                if isinstance(event, TranscriptionDelta):
                    if not utterance.first_delta_seen and utterance.first_audio_at is not None:
                        utterance.first_delta_seen = True
                        metrics.first_delta.observe(time.monotonic() - utterance.first_audio_at)
                    await self.conn.send({"type": "transcription.delta", "delta": event.text})
                elif isinstance(event, TranscriptionDone):
                    if utterance.final_at is not None:
                        metrics.finalize.observe(time.monotonic() - utterance.final_at)
                    notice = None
                    if utterance.drained and not self.compat:  # vLLM has no such notice: --compat vllm sends none
                        # After the last delta and before the done: a client that stops at an error (vLLM's
                        # example does) has the whole text, one that reads to the done has seen the notice.
                        notice = drain_notice(event.usage.audio_seconds)
                        await self._error("server_draining", notice, budget=False)
                    await self.conn.send(self._done_event(event, notice))
                    finished = True
                    metrics.utterances.labels(outcome="done").inc()
        except ConnectionClosed:
            return
        except Exception as exc:  # noqa: BLE001 - EngineError by contract; anything else is a bug, same answer
            code, message = failure_of(self.conn.id, exc)
            if not utterance.failed:
                utterance.failed = True
                metrics.utterances.labels(outcome="error").inc()
                await self._error("processing_error" if self.compat else code, message)
        if not finished and not utterance.failed:  # ended with neither a result nor an error: say so
            utterance.failed = True
            metrics.utterances.labels(outcome="error").inc()
            await self._error("processing_error", "The transcription ended without a result")
        self._live.discard(utterance)
        async with self._lock:
            await self._ended(utterance, early=finished and not utterance.finalizing)

    async def _ended(self, utterance: _Utterance, *, early: bool) -> None:
        if self.utterance is not utterance:  # dropped (empty commit, append failure), or a VAD turn behind
            if self.server.draining and not self.busy():  # a newer one: the last one out closes a draining
                self.conn.stop(self.server.drain_breach())  # connection
            return
        self.utterance = None
        self.discarding = early and not self.compat
        if self.server.draining:
            self.conn.stop(self.server.drain_breach())
            return
        if self.next_commit:
            final, self.next_commit, self.next_final = self.next_final, False, None
            try:
                await self._start(held=final)
                if final is not None:
                    await self._finalize(self.utterance)
            except (ProtocolError, EngineError) as exc:
                await self._error(getattr(exc, "code", "processing_error"), str(exc))

    def _done_event(self, done: TranscriptionDone, notice: str | None = None) -> dict:
        """vLLM's `transcription.done`; strict mode adds `words`, `usage.audio_seconds` and, for an utterance the
        drain ended (`notice`: the `server_draining` message sent before it), `truncated` and `truncation`."""
        prompt, completion = done.usage.prompt_tokens, done.usage.output_tokens
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                 "prompt_tokens_details": None, "completion_tokens_details": None}  # vLLM's UsageInfo order
        event = {"type": "transcription.done", "text": done.text, "usage": usage}
        if not self.compat:
            usage["audio_seconds"] = done.usage.audio_seconds
            event["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]
        if notice is not None:  # the notice again, for a client that reads the done alone
            event.update(drain_truncation(notice, done.usage.audio_seconds))
        return event

    async def _error(self, code: str, message: str, *, budget: bool = True) -> None:
        """`budget`: whether it counts against the connection's error budget (the client's conduct)."""
        self.conn.count_error(code, budget=budget)
        await self.conn.send(self.error_event(code, message))
