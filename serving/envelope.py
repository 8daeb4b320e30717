"""The `/ws` JSON-envelope protocol (specs/realtime_protocols.md §5, from the Voxtral-on-vLLM server guide in
seeds/) over the engine's transcription sessions.

Every frame, both ways, is one JSON object `{type, session_id, request_id, payload}`. The client names its
conversation (`session_id`) and each utterance or control request (`request_id`); the server echoes the ids
of the message it answers (a message without a `session_id` gets the connection's latest one) and tags an
utterance's `transcription.delta` / `transcription.done` with the ids of the commit that started it. What
the server sends before the client named anything carries nulls.

`ping` gets `pong`; `end` gets `session_end`, then close 1000. `session.update` takes `model` (only the served
one), `transcription_delay_ms` (jaxstream: the delay of the utterances that start after it) and
`turn_detection`, all optional, and answers `session.updated` with the effective settings.

Manual turns (the default): `commit{final:false}` starts an utterance (one engine session), `append`s feed
it, `commit{final:true}` ends its audio; deltas stream, then one `transcription.done` (`text`, `usage`,
`words`). A `commit{final:false}` while an utterance still runs, its final sent or not, aborts it first
(barge-in); `cancel` aborts it and drops the audio appended outside an utterance. Both answer `cancelled`
listing the aborted `request_ids` (jaxstream sends it on barge-in too, so the client knows no `done`
follows). Audio appended while no utterance takes audio waits, up to `max_pending_seconds`, for the next one.
When the model ends an utterance before its final commit, its remaining audio and that final are dropped.

Server VAD, jaxstream's opt-in extension: `session.update` with `turn_detection` (OpenAI's `server_vad` or
`semantic_vad` object, serving/vad.py; null: manual turns again). The server then starts an utterance where
speech starts (`input_audio_buffer.speech_started`, request_id `vad-<n>`) and finalises it where speech
stops (`input_audio_buffer.speech_stopped`); earlier utterances finish while the next one streams, and audio
outside speech is not transcribed. `idle_timeout_ms` without speech: `input_audio_buffer.timeout_triggered`
opens a turn of its own holding the prefix padding (or nothing), which ends with its `done` as every turn does.
`commit{final:true}` ends the speech in progress (end of stream); `commit{final:false}` is refused.

Limits: the API key (`?api_key=`, `X-API-Key`, or Bearer) is checked after the upgrade, so a bad one gets an
`error` and close 4001 (the auth middleware leaves this route to us). The connection cap (4002), idle
timeout (4000), maximum duration (4003), error budget (1008) and drain are the shared runner's
(serving.websocket). The message and cancel rate limits are rolling windows per connection
(ServerConfig.ws_*): a message over a limit is dropped with an `error` `rate_limited`, and the socket stays
open (those errors do not count against the error budget).

Error payloads are `{code, message, reason_code, details}` (§5.7); `code` is the class, `reason_code` the
cause (the same word where there is nothing more precise to say):

    unauthorized / invalid_api_key            bad or missing key, then close 4001
    capacity / max_connections                the connection cap, then close 4002 (max_sessions: the engine's)
    idle_timeout, max_duration / max_duration_exceeded    the deadlines, then close 4000 / 4003
    rate_limited / message_rate_limited, cancel_rate_limited    details: limit, window_seconds, retry_after_seconds
    invalid_json; invalid_frame / binary_frame                  not a JSON text frame
    invalid_request / invalid_envelope        not an object; ids not short strings; payload not an object
    unknown_event                             missing or unknown `type`
    invalid_request / invalid_payload, model_not_allowed, no_active_utterance, turn_detection_enabled,
                      utterance_in_progress
    invalid_audio, audio_limit_exceeded, input_audio_buffer_commit_empty, draining    as on /v1/realtime
    server_draining                           the drain ended the utterance's audio: its done (next) covers
                                              only the audio received; details: audio_seconds (the done
                                              carries `truncated: true` and `truncation` too)
    the engine's code (engine_dead, ...), processing_error      a failed start or transcription (no `done`)
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
from jaxstream.serving.limits import (
    CLOSE_NORMAL, CLOSE_UNAUTHORIZED, Breach, RollingWindowLimiter, drain_notice, drain_truncation,
)
from jaxstream.serving.vad import (TurnDetectionError, TurnSegmenter, parse_turn_detection, start_turn_segmenter,
                                   vad_config)
from jaxstream.serving.websocket import ConnectionClosed

logger = logging.getLogger(__name__)

ROUTE = "/ws"
MAX_ID_CHARS = 256  # ids are echoed on every event they tag: a long one would multiply the outgoing bytes
_UNCOUNTED = frozenset({"ping", "pong", "end"})  # not counted by the message rate limit (§5.6)
# The shared runner's breach codes -> this protocol's (code, reason_code); others keep their code for both.
_BREACH_CODES = {"invalid_api_key": ("unauthorized", "invalid_api_key"),
                 "capacity": ("capacity", "max_connections"),
                 "max_duration_exceeded": ("max_duration", "max_duration_exceeded")}
_ENGINE_REASONS = {"capacity": "max_sessions"}  # the engine's cap, not the connection cap


class EnvelopeError(Exception):
    """A client mistake or a refusal, answered with an `error` envelope; the socket stays open."""

    def __init__(self, code: str, reason_code: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason_code, self.message, self.details = code, reason_code, message, details or {}


def _invalid_payload(message: str, **details) -> EnvelopeError:
    return EnvelopeError("invalid_request", "invalid_payload", message, details)


class _Utterance:
    """One engine transcription session, the ids it is tagged with, and its timings."""

    def __init__(self, session, session_id: str | None, request_id: str | None):
        self.session = session
        self.session_id = session_id
        self.request_id = request_id
        self.samples = 0
        self.first_audio_at: float | None = None
        self.final_at: float | None = None
        self.pump: asyncio.Task | None = None
        self.drained = False  # the server's drain ended its audio, not the client: its done comes with a notice
        self.reported = False  # its done or error went out: aborting it now cancels nothing the client awaits


class EnvelopeProtocol:
    """The protocol on one `/ws` connection (see the module docstring); built per connection by the app.
    `authorized`: whether the handshake carried a valid key (checked by the app before the upgrade)."""

    def __init__(self, conn, server, *, authorized: bool):
        self.conn = conn
        self.server = server
        self.authorized = authorized
        self.limits = server.config.limits
        config = server.config
        self.messages = RollingWindowLimiter(config.ws_max_messages_per_window, config.ws_message_window_s)
        self.cancels = RollingWindowLimiter(config.ws_max_cancels_per_window, config.ws_cancel_window_s)
        self.id = f"sess-{secrets.token_hex(8)}"
        self.session_id: str | None = None  # the client's latest
        self.delay_ms: int | None = None  # None: the engine's default
        self.turn_detection: dict | None = None
        self.segmenter: TurnSegmenter | None = None
        self.vad_turns = 0
        self.stream_samples = 0  # audio appended on this connection: the clock of the VAD's positions
        self.open: _Utterance | None = None  # the utterance audio goes to
        self.live: list[_Utterance] = []  # every utterance whose engine session is not over, oldest first
        self.pending: list[np.ndarray] = []  # audio appended while no utterance takes audio
        self.pending_samples = 0
        self.discarding = False  # the model ended the open utterance early: drop audio until the next commit
        self._lock = asyncio.Lock()  # one state transition at a time (reader vs. event pumps)
        self._handlers = {
            "ping": self._on_ping, "pong": self._on_pong, "end": self._on_end, "cancel": self._on_cancel,
            "session.update": self._on_update, "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.commit": self._on_commit,
        }

    # -- protocol interface (serving.websocket) --------------------------------------------------------
    async def run(self) -> None:
        if not self.authorized:
            self.conn.stop(Breach("unauthorized", CLOSE_UNAUTHORIZED, "invalid_api_key",
                                  "Missing or invalid API key: pass ?api_key= or the X-API-Key header"))
            return
        await self._send("session.created", None, None, id=self.id, created=int(time.time()),
                         model=self.server.model_id)
        async for kind, data in self.conn.frames():
            async with self._lock:
                await self._handle(kind, data)
            if self.server.draining and not self.busy():
                self.conn.stop(self.server.drain_breach())

    def busy(self) -> bool:
        return bool(self.live)

    async def finish_for_drain(self) -> None:
        async with self._lock:
            self._drop_pending()
            if self.open is not None:
                self.open.drained = True
                try:
                    await self._finalize(self.open)
                except (EnvelopeError, EngineError) as exc:
                    logger.info("%s: finishing the utterance for the drain: %s", self.conn.id, exc)
            if not self.busy():
                self.conn.stop(self.server.drain_breach())

    async def release(self) -> None:
        self._drop_pending()
        for utterance in list(self.live):
            await self._abort(utterance, outcome="aborted", reason="client_disconnected")
        if self.segmenter is not None:
            self.segmenter.close()

    def error_event(self, code: str, message: str) -> dict:
        """The `error` sent before the shared runner closes the socket (auth, capacity, deadlines, drain)."""
        code, reason_code = _BREACH_CODES.get(code, (code, code))
        return _envelope("error", self.session_id, None, code=code, message=message, reason_code=reason_code,
                         details={})

    # -- client messages ------------------------------------------------------------------------------
    async def _handle(self, frame_kind: str, data) -> None:
        session_id, request_id = self.session_id, None
        try:
            try:
                message = _parse(frame_kind, data)
                session_id, request_id = self._ids(message)
            except EnvelopeError:
                self._count_message(None)  # a broken message counts too (over the limit, that is the answer)
                raise
            kind = message.get("type")
            self._count_message(kind)
            payload = message.get("payload")
            payload = {} if payload is None else payload
            if not isinstance(payload, dict):
                raise EnvelopeError("invalid_request", "invalid_envelope", "payload must be a JSON object")
            handler = self._handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise EnvelopeError("unknown_event", "unknown_event", f"Unknown message type: {wire_json.shown(kind)}")
            await handler(session_id, request_id, payload)
        except EnvelopeError as exc:
            await self._error(session_id, request_id, exc.code, exc.reason_code, exc.message, exc.details)
        except EngineError as exc:
            await self._error(session_id, request_id, exc.code, _ENGINE_REASONS.get(exc.code, exc.code), str(exc))
        except ConnectionClosed:
            raise
        except Exception:  # noqa: BLE001 - a bug must not cost the client its socket
            logger.exception("%s: error handling a message", self.conn.id)
            await self._error(session_id, request_id, "processing_error", "processing_error",
                              "Internal error while handling the message")

    def _count_message(self, kind) -> None:
        """Counts a message against the message rate limit (§5.6: all but ping, pong and end)."""
        if not (isinstance(kind, str) and kind in _UNCOUNTED) and not self.messages.allow():
            raise _rate_error("message", self.messages)

    def _ids(self, message: dict) -> tuple[str | None, str | None]:
        """The message's (session_id, request_id); a missing session_id is the connection's latest."""
        ids = []
        for field in ("session_id", "request_id"):
            value = message.get(field)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
                raise EnvelopeError("invalid_request", "invalid_envelope",
                                    f"{field} must be a string of at most {MAX_ID_CHARS} characters")
            ids.append(value)
        if ids[0] is None:
            return self.session_id, ids[1]
        self.session_id = ids[0]
        return ids[0], ids[1]

    async def _on_ping(self, session_id, request_id, payload: dict) -> None:
        await self._send("pong", session_id, request_id)

    async def _on_pong(self, session_id, request_id, payload: dict) -> None:
        """Nothing to answer: received messages are activity (the idle timer), and pong is not counted."""

    async def _on_end(self, session_id, request_id, payload: dict) -> None:
        await self._send("session_end", session_id, request_id)
        self.conn.stop(Breach("client_end", CLOSE_NORMAL, None, "session ended by the client"))

    async def _on_cancel(self, session_id, request_id, payload: dict) -> None:
        reason = payload.get("reason", "client_request")
        if not isinstance(reason, str) or len(reason) > MAX_ID_CHARS:
            raise _invalid_payload(f"payload.reason must be a string of at most {MAX_ID_CHARS} characters")
        if not self.cancels.allow():
            raise _rate_error("cancel", self.cancels)
        aborted = [u.request_id for u in self.live if not u.reported]
        for utterance in list(self.live):
            await self._abort(utterance, outcome="cancelled", reason="cancelled")
        self._drop_pending()
        self.discarding = False
        if self.segmenter is not None:
            self.segmenter.restart()  # speech in progress is forgotten: the next speech is a new utterance
        await self._send("cancelled", session_id, request_id, reason=reason, request_ids=aborted)

    async def _on_update(self, session_id, request_id, payload: dict) -> None:
        model_id = self.server.model_id
        if "model" in payload:
            model = payload["model"]
            if not isinstance(model, str) or not self.server.serves_model(model, allow_empty=False):
                raise EnvelopeError("invalid_request", "model_not_allowed", f"Only the configured model "
                                    f"`{model_id}` is served here, got `{wire_json.shown(model)}`", {"model": model_id})
        # Everything is checked before anything changes: a refused update leaves the session as it was.
        delay = payload.get("transcription_delay_ms", self.delay_ms)
        allowed = self.server.allowed_delays_ms
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay not in allowed):
            raise _invalid_payload(f"transcription_delay_ms must be one of {', '.join(map(str, allowed))}",
                                   field="transcription_delay_ms")
        turn_detection = self.turn_detection
        if "turn_detection" in payload:
            try:
                turn_detection = parse_turn_detection(payload["turn_detection"])
            except TurnDetectionError as exc:
                raise _invalid_payload(f"turn_detection: {exc}", field=f"turn_detection.{exc.field}".rstrip(".")
                                       ) from None
        if turn_detection != self.turn_detection:
            if self.open is not None or self.pending:
                raise EnvelopeError("invalid_request", "utterance_in_progress", "turn_detection cannot change while "
                                    "an utterance takes audio or audio waits for one: finish or cancel it first")
            # Built before anything changes: a segmenter that fails to start leaves the session as it was.
            segmenter = (await start_turn_segmenter(vad_config(turn_detection), SAMPLING_RATE, self.stream_samples)
                         if turn_detection else None)
            if self.segmenter is not None:
                self.segmenter.close()
            self.segmenter, self.turn_detection = segmenter, turn_detection
            self.discarding = False  # an utterance the model ended early is no one's once the turns change
        self.delay_ms = delay
        await self._send("session.updated", session_id, request_id, model=model_id,
                         transcription_delay_ms=delay or self.server.engine.default_delay_ms,
                         turn_detection=self.turn_detection)

    async def _on_append(self, session_id, request_id, payload: dict) -> None:
        audio = payload.get("audio")
        if not isinstance(audio, str):
            raise _invalid_payload("payload.audio must be a base64 string of PCM16 LE mono 16 kHz audio",
                                   field="audio")
        try:
            pcm = decode_pcm16_base64(audio, max_samples=int(self.limits.max_append_seconds * SAMPLING_RATE))
        except AudioDecodeError as exc:
            raise EnvelopeError("invalid_audio", "invalid_audio", f"Invalid audio data: {exc}") from None
        seconds = pcm.size / SAMPLING_RATE
        if self.conn.audio_seconds + seconds > self.limits.max_audio_seconds:
            raise EnvelopeError("audio_limit_exceeded", "audio_limit_exceeded", f"This connection reached its "
                                f"limit of {self.limits.max_audio_seconds:g} s of audio; open a new one")
        # A draining server starts no later utterance: audio no utterance takes is dropped, not held (it would
        # only fill max_pending_seconds and answer audio_limit_exceeded to a client whose utterance it ended).
        if self.segmenter is None and self.open is None and not self.discarding and not self.server.draining:
            if self.pending_samples + pcm.size > self.limits.max_pending_seconds * SAMPLING_RATE:
                raise EnvelopeError("audio_limit_exceeded", "audio_limit_exceeded", f"More than "
                                    f"{self.limits.max_pending_seconds:g} s of audio appended while no utterance "
                                    "takes audio; send input_audio_buffer.commit to start one")
            self.pending.append(pcm)
            self.pending_samples += pcm.size
        self.conn.audio_seconds += seconds
        self.stream_samples += pcm.size
        self.server.metrics.audio_seconds.inc(seconds)
        if self.segmenter is not None:
            await self._segment(pcm, session_id)
        elif self.open is not None:
            await self._feed(self.open, pcm)

    async def _on_commit(self, session_id, request_id, payload: dict) -> None:
        final = payload.get("final", False)
        if not isinstance(final, bool):
            raise _invalid_payload("payload.final must be a boolean", field="final")
        if final:
            await self._commit_final()
            return
        if self.segmenter is not None:
            raise EnvelopeError("invalid_request", "turn_detection_enabled", "With turn_detection the server starts "
                                "utterances where speech starts; send session.update with turn_detection null to "
                                "commit by hand")
        if self.live:  # barge-in: the new utterance replaces whatever still runs
            aborted = [u.request_id for u in self.live if not u.reported]
            for utterance in list(self.live):
                await self._abort(utterance, outcome="barge_in", reason="barge_in")
            await self._send("cancelled", session_id, request_id, reason="barge_in", request_ids=aborted)
        self.discarding = False
        utterance = await self._start(session_id, request_id)
        pending = self.pending
        self._drop_pending()
        for pcm in pending:
            await self._feed(utterance, pcm)

    async def _commit_final(self) -> None:
        if self.segmenter is not None:  # the end of the stream: the speech in progress ends here
            self.segmenter.restart()
            if self.open is not None:
                await self._finalize(self.open)
            return
        if self.discarding:  # the model had already ended this utterance and sent its done
            self.discarding = False
            return
        if self.open is None:
            raise EnvelopeError("invalid_request", "no_active_utterance", "No utterance takes audio: send "
                                "input_audio_buffer.commit with final=false to start one")
        await self._finalize(self.open)

    # -- server VAD -----------------------------------------------------------------------------------
    async def _segment(self, pcm: np.ndarray, session_id: str | None) -> None:
        """Routes `pcm` by the segmenter's turn events: speech (with its prefix padding) to the utterance it
        opens, the rest nowhere."""
        segmenter = self.segmenter
        for turn in await segmenter.push(pcm):
            if turn.kind in ("started", "timeout"):
                self.vad_turns += 1
                utterance = await self._start(session_id, f"vad-{self.vad_turns}")
                if turn.kind == "started":
                    await self._send("input_audio_buffer.speech_started", session_id, utterance.request_id,
                                     audio_start_ms=segmenter.ms(turn.sample))
                else:  # nobody spoke for idle_timeout_ms: the buffer (the prefix padding) is committed, as OpenAI
                    # does, even with none kept: its done (empty) answers vad-N as a done answers every turn.
                    await self._send("input_audio_buffer.timeout_triggered", session_id, utterance.request_id,
                                     audio_start_ms=segmenter.ms(turn.idle_from),
                                     audio_end_ms=segmenter.ms(turn.sample))
                await self._feed(utterance, turn.audio)
                if turn.kind == "timeout":
                    await self._finalize(utterance, empty_ok=True)
                continue
            utterance = self.open  # None when the model (or a failure) ended the turn early: audio dropped
            if utterance is not None:
                await self._feed(utterance, turn.audio)
            if turn.kind == "stopped":
                # The turn's id even when the model ended its utterance early (it answered speech_started).
                await self._send("input_audio_buffer.speech_stopped", session_id, f"vad-{self.vad_turns}",
                                 audio_end_ms=segmenter.ms(turn.sample))
                if utterance is not None and self.open is utterance:
                    await self._finalize(utterance, empty_ok=True)

    # -- utterances -----------------------------------------------------------------------------------
    async def _start(self, session_id: str | None, request_id: str | None) -> _Utterance:
        if self.server.draining:
            raise EnvelopeError("draining", "draining", "The server is shutting down and starts no new utterance")
        session = await start_session(self.server.engine, self.delay_ms,
                                      max_audio_seconds=self.limits.max_audio_seconds)
        utterance = _Utterance(session, session_id, request_id)
        self.open = utterance
        self.live.append(utterance)
        self.conn.utterances += 1
        utterance.pump = asyncio.create_task(self._pump(utterance), name=f"{self.conn.id}-events")
        return utterance

    async def _feed(self, utterance: _Utterance, pcm: np.ndarray) -> None:
        if pcm.size == 0:
            return
        if utterance.first_audio_at is None:
            utterance.first_audio_at = time.monotonic()
        try:
            await utterance.session.append(pcm)  # waits while the engine has too much audio queued
        except EngineError as exc:
            if utterance.session.outcome is None:
                raise  # the session lives: only this audio was refused
            # The session failed: its pump reports that once, with the utterance's ids; the rest is dropped.
            logger.info("%s: audio for an ended utterance dropped: %s", self.conn.id, exc)
            if self.open is utterance:
                self.open = None
                self.discarding = self.segmenter is None
            return
        utterance.samples += pcm.size

    async def _finalize(self, utterance: _Utterance, *, empty_ok: bool = False) -> None:
        """Ends `utterance`'s audio. An empty one is the client's mistake (commit_empty), unless the server
        committed it (`empty_ok`)."""
        if self.open is utterance:
            self.open = None
        if utterance.samples == 0 and not empty_ok:
            await self._abort(utterance, outcome="empty", reason="empty")
            raise EnvelopeError("input_audio_buffer_commit_empty", "input_audio_buffer_commit_empty", "Cannot "
                                "finalise an empty utterance: no audio was appended since its commit")
        utterance.final_at = time.monotonic()
        await utterance.session.finish()

    async def _abort(self, utterance: _Utterance, *, outcome: str, reason: str) -> None:
        """Ends `utterance` now without a done: its events stop first, then the engine frees it."""
        if utterance.pump is not None:
            utterance.pump.cancel()
            await asyncio.gather(utterance.pump, return_exceptions=True)
        if utterance in self.live:
            self.live.remove(utterance)
        if self.open is utterance:
            self.open = None
        await utterance.session.abort(reason=reason)
        if not utterance.reported:  # else its pump counted it already
            self.server.metrics.utterances.labels(outcome=outcome).inc()

    def _drop_pending(self) -> None:
        self.pending, self.pending_samples = [], 0

    async def _pump(self, utterance: _Utterance) -> None:
        """Engine events -> envelopes tagged with the utterance's ids. Cancelled when the server aborts it."""
        metrics = self.server.metrics
        ids = (utterance.session_id, utterance.request_id)
        try:
            outcome = None
            try:
                async for event in utterance.session:
                    if isinstance(event, TranscriptionDelta):
                        if utterance.first_audio_at is not None:
                            metrics.first_delta.observe(time.monotonic() - utterance.first_audio_at)
                            utterance.first_audio_at = None
                        await self._send("transcription.delta", *ids, delta=event.text)
                    elif isinstance(event, TranscriptionDone):
                        if utterance.final_at is not None:
                            metrics.finalize.observe(time.monotonic() - utterance.final_at)
                        truncation = {}
                        if utterance.drained:  # after the last delta, before the done: both kinds of client see it
                            seconds, notice = event.usage.audio_seconds, drain_notice(event.usage.audio_seconds)
                            await self._error(utterance.session_id, utterance.request_id, "server_draining",
                                              "server_draining", notice, {"audio_seconds": seconds})
                            truncation = drain_truncation(notice, seconds)  # again, for a client reading the done
                        await self._send("transcription.done", *ids, **_done_payload(event), **truncation)
                        outcome = "done"
            except ConnectionClosed:
                raise
            except Exception as exc:  # noqa: BLE001 - EngineError by contract; anything else is a bug, same answer
                outcome = "error"
                code, message = failure_of(self.conn.id, exc)
                await self._error(*ids, code, _ENGINE_REASONS.get(code, code), message)
            if outcome is None:  # the engine ended it with neither a result nor an error
                outcome = "error"
                await self._error(*ids, "processing_error", "processing_error",
                                  "The transcription ended without a result")
            utterance.reported = True
            metrics.utterances.labels(outcome=outcome).inc()
            async with self._lock:
                self._ended(utterance)
        except ConnectionClosed:
            return  # the runner releases what is left

    def _ended(self, utterance: _Utterance) -> None:
        if utterance in self.live:
            self.live.remove(utterance)
        if self.open is utterance:  # ended before its final commit (the model's end, or a failure)
            self.open = None
            self.discarding = self.segmenter is None
        if self.server.draining and not self.busy():
            self.conn.stop(self.server.drain_breach())

    # -- sending --------------------------------------------------------------------------------------
    async def _send(self, kind: str, session_id: str | None, request_id: str | None, **payload) -> None:
        await self.conn.send(_envelope(kind, session_id, request_id, **payload))

    async def _error(self, session_id, request_id, code: str, reason_code: str, message: str,
                     details: dict | None = None) -> None:
        # The rate limits answer with their own error and keep the socket open (§5.6), and the drain's notice is
        # the server's doing: neither is the error budget's.
        self.conn.count_error(code, budget=code not in ("rate_limited", "server_draining"))
        await self._send("error", session_id, request_id, code=code, message=message, reason_code=reason_code,
                         details=details or {})


def _envelope(kind: str, session_id: str | None, request_id: str | None, **payload) -> dict:
    return {"type": kind, "session_id": session_id, "request_id": request_id, "payload": payload}


def _parse(frame_kind: str, data) -> dict:
    if frame_kind == "binary":
        raise EnvelopeError("invalid_frame", "binary_frame", "Binary frames are not supported: send each message "
                            "as a JSON text frame")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        raise EnvelopeError("invalid_json", "invalid_json", "Invalid JSON") from None
    if not isinstance(message, dict):
        raise EnvelopeError("invalid_request", "invalid_envelope", "Each message must be a JSON object "
                            "{type, session_id, request_id, payload}")
    return message


def _rate_error(what: str, limiter: RollingWindowLimiter) -> EnvelopeError:
    return EnvelopeError("rate_limited", f"{what}_rate_limited", f"{what} rate limit: at most {limiter.limit} "
                         f"per {limiter.window_s:g} s on one connection; the message was dropped",
                         {"limit": limiter.limit, "window_seconds": limiter.window_s,
                          "retry_after_seconds": round(limiter.retry_after(), 3)})


def _done_payload(done: TranscriptionDone) -> dict:
    prompt, completion = done.usage.prompt_tokens, done.usage.output_tokens
    return {"text": done.text, "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                         "total_tokens": prompt + completion,
                                         "audio_seconds": done.usage.audio_seconds},
            "words": [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]}
