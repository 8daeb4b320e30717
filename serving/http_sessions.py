"""Mode B streaming input: a transcription whose audio arrives over several HTTP requests
(specs/realtime_protocols.md §7.2, from the vllm-omni streaming-input RFC).

    POST /v1/streaming_input/sessions                    {model?, modality: audio, params?, stream?,
                                                          start_policy?, chunk?} -> {session_id, expires_in}
    POST /v1/streaming_input/sessions/{id}/chunks        {sequence_id, modality?, payload, end_of_input?}
    POST /v1/streaming_input/sessions/{id}/finish        ends the input; idempotent
    GET  /v1/streaming_input/sessions/{id}/result        waits for and returns the final transcription
    GET  /v1/streaming_input/sessions/{id}/events        SSE (sessions created with stream: true)

Audio payloads are base64 PCM16 LE mono 16 kHz. The engine takes streaming input natively (the RFC's
"Option 2"), so with the `on_first_chunk` start policy (the only one implemented) the engine session starts
with the first in-order chunk and every later chunk is appended to it as it arrives. Chunks are applied in
`sequence_id` order: one that arrives early is held until the gap fills; a repeated `sequence_id` with the
same content is acknowledged and ignored, with other content refused (409). The payload bytes a session
received (held chunks included) are capped; crossing the cap answers 413, closes the session and aborts
its engine session.

A session with unfinished input and no chunk for `session_timeout_s` is closed (410 afterwards), as is one
whose event stream dropped and was not resumed within `resume_grace_s`; a finished session stays readable
for `session_timeout_s`. Output events are kept in the session's bounded `EventLog`, so a client resumes a
dropped `…/events` stream with `Last-Event-ID` and gets every event once.
"""
import asyncio
import collections
import hashlib
import json
import logging
import time
import uuid

from aiohttp import web

from jaxstream.errors import EngineError
from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving import sse
from jaxstream.serving.audio_codecs import AudioDecodeError, decode_pcm16_base64
from jaxstream.serving.http_transcriptions import (
    RequestError, check_model, check_ready, engine_request_error, error_response, pump_transcription,
    server_state, text_usage,
)

logger = logging.getLogger(__name__)

PREFIX = "/v1/streaming_input/sessions"
START_POLICIES = ("on_first_chunk",)
_TOMBSTONES = 4096  # ids of closed sessions remembered, so that late calls get 410 rather than 404
_REAP_EVERY_S = 0.5


class InputSession:
    """One Mode B session: the ordering state of its chunks, its engine session and its output."""

    def __init__(self, delay_ms: int | None, stream: bool):
        self.id = uuid.uuid4().hex
        self.delay_ms = delay_ms
        self.log = sse.EventLog() if stream else None
        self.lock = asyncio.Lock()  # chunks and finish are applied one at a time, in sequence order
        self.next_seq = 0
        self.held: dict[int, tuple] = {}  # sequence_id -> (pcm or None, end_of_input), waiting for a gap
        self.digests: dict[int, bytes] = {}  # sequence_id -> digest of what was received, for duplicates
        self.end_seq: int | None = None
        self.input_ended = False
        self.closed = False
        self.payload_bytes = 0
        self.engine_session = None
        self.pump: asyncio.Task | None = None
        self.result = None
        self.error: EngineError | None = None
        self.done = asyncio.Event()
        self.last_activity = self.done_at = time.monotonic()
        self.listeners = 0
        self.detached_at: float | None = None

    @property
    def state(self) -> str:
        if self.closed:
            return "closed"
        if self.input_ended:
            return "finished"
        return "started" if self.engine_session is not None else "open"

    def acknowledgement(self, **extra) -> dict:
        return {"session_id": self.id, "state": self.state, "started": self.engine_session is not None,
                "next_sequence_id": self.next_seq, "held": sorted(self.held), **extra}


class StreamingInputSessions:
    """The open sessions of one app and their settings (attributes, so an embedder or a test can tune
    them on `app[STREAMING_INPUT]` before use)."""

    session_timeout_s = 300.0  # the RFC's streaming_input.session_timeout_sec
    resume_grace_s = 30.0  # a dropped event stream is kept this long for a Last-Event-ID resume
    max_payload_bytes = 256 << 20  # PCM per session: about 2 h 20 min of 16 kHz audio
    max_held_chunks = 256  # out-of-order chunks waiting for a gap

    def __init__(self, state):
        self.server = state
        self.sessions: dict[str, InputSession] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # closed id -> why

    def get(self, session_id: str) -> InputSession:
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        if session_id in self.gone:
            raise RequestError(410, "session_expired", f"Session {session_id} is closed: {self.gone[session_id]}")
        raise RequestError(404, "session_not_found", f"No streaming input session {session_id}")

    async def close(self, session: InputSession, reason: str) -> None:
        """Closes `session` for good: its engine session is aborted and later calls answer 410."""
        if not session.closed:
            session.closed = True
            logger.info("streaming input session %s closed: %s", session.id, reason)
            if session.engine_session is not None:
                await session.engine_session.abort(reason)
            elif session.log is not None:
                session.log.close()
            session.done.set()
        self.sessions.pop(session.id, None)
        self.gone[session.id] = reason
        while len(self.gone) > _TOMBSTONES:
            self.gone.popitem(last=False)

    async def reap(self) -> None:
        """Closes idle, abandoned and long-finished sessions."""
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.done.is_set() and now - session.done_at > self.session_timeout_s:
                    await self.close(session, "expired after its result was kept "
                                              f"{self.session_timeout_s:g} s")
                elif not session.input_ended and now - session.last_activity > self.session_timeout_s:
                    await self.close(session, f"no chunk for {self.session_timeout_s:g} s")
                elif (session.detached_at is not None and not session.listeners and not session.done.is_set()
                      and now - session.detached_at > self.resume_grace_s):
                    await self.close(session, f"its event stream was not resumed within {self.resume_grace_s:g} s")

    # -- applying chunks ----------------------------------------------------------------------------------
    async def add_chunk(self, session: InputSession, chunk: dict) -> dict:
        """Applies one validated chunk (see `_parse_chunk`); the acknowledgement, or RequestError."""
        seq, payload, end = chunk["sequence_id"], chunk["payload"], chunk["end_of_input"]
        async with session.lock:
            if session.closed:
                raise RequestError(410, "session_expired", f"Session {session.id} is closed")
            session.last_activity = time.monotonic()
            digest = hashlib.sha256(f"{int(end)}:{payload}".encode()).digest()
            if seq in session.digests:
                if session.digests[seq] != digest:
                    raise RequestError(409, "sequence_conflict", f"sequence_id {seq} was already received "
                                       "with different content", "sequence_id")
                return session.acknowledgement(sequence_id=seq, duplicate=True)
            if session.input_ended or (session.end_seq is not None and seq > session.end_seq):
                raise RequestError(409, "input_finished", f"The input ended; sequence_id {seq} comes after it",
                                   "sequence_id")
            if end and session.end_seq is not None:
                raise RequestError(409, "input_finished", f"sequence_id {session.end_seq} already ended the "
                                   "input", "sequence_id")
            if end and any(held > seq for held in session.held):
                raise RequestError(409, "input_finished", f"end_of_input at {seq} precedes chunks already "
                                   "received", "sequence_id")
            if len(session.held) >= self.max_held_chunks and seq != session.next_seq:
                raise RequestError(422, "too_many_held_chunks", f"{len(session.held)} chunks already wait "
                                   f"for sequence_id {session.next_seq}", "sequence_id")
            pcm = self._decode(payload)
            session.payload_bytes += 0 if pcm is None else 2 * pcm.size
            if session.payload_bytes > self.max_payload_bytes:
                await self.close(session, f"payload over the {self.max_payload_bytes}-byte cap")
                raise RequestError(413, "payload_too_large", f"The session received more than "
                                   f"{self.max_payload_bytes} bytes of payload; it is closed")
            session.digests[seq] = digest
            session.held[seq] = (pcm, end)
            if end:
                session.end_seq = seq
            while session.next_seq in session.held:
                pcm, end = session.held.pop(session.next_seq)
                session.next_seq += 1
                await self._apply(session, pcm, end)
            return session.acknowledgement(sequence_id=seq)

    def _decode(self, payload: str):
        if payload == "":
            return None
        limits = self.server.config.limits
        try:
            return decode_pcm16_base64(payload, max_samples=int(limits.max_append_seconds * SAMPLING_RATE))
        except AudioDecodeError as exc:
            raise RequestError(422, "invalid_audio", f"payload: {exc}", "payload") from None

    async def _apply(self, session: InputSession, pcm, end: bool) -> None:
        """Hands one in-order chunk to the engine, starting its session on the first (on_first_chunk)."""
        await self._start(session)
        try:
            if pcm is not None:
                self.server.metrics.audio_seconds.inc(pcm.size / SAMPLING_RATE)
                await session.engine_session.append(pcm)
            if end:
                session.input_ended = True
                await session.engine_session.finish()
        except EngineError as exc:
            await self.close(session, f"the engine refused the audio: {exc}")
            raise engine_request_error(exc) from None

    async def _start(self, session: InputSession) -> None:
        if session.engine_session is not None:
            return
        try:
            session.engine_session = await self.server.engine.start_transcription(session.delay_ms)
        except EngineError as exc:
            await self.close(session, f"the engine could not start it: {exc}")
            raise engine_request_error(exc) from None
        session.pump = asyncio.create_task(self._pump(session))

    async def _pump(self, session: InputSession) -> None:
        try:
            session.result = await pump_transcription(session.engine_session, session.log, self.server.metrics,
                                                      time.monotonic())
        except EngineError as exc:
            session.error = exc
        finally:
            session.done_at = time.monotonic()
            session.done.set()

    async def finish(self, session: InputSession) -> dict:
        async with session.lock:
            if session.closed:
                raise RequestError(410, "session_expired", f"Session {session.id} is closed")
            if not session.input_ended:
                if session.held:
                    missing = sorted(set(range(session.next_seq, max(session.held))) - set(session.held))
                    raise RequestError(409, "chunks_missing", f"Chunks {missing} have not arrived; send them "
                                       "before finishing")
                if session.engine_session is None:
                    raise RequestError(422, "no_audio", "The session received no audio; send a chunk first")
                session.end_seq = session.next_seq - 1
                await self._apply(session, None, True)
            return session.acknowledgement()


STREAMING_INPUT = web.AppKey("jaxstream_streaming_input", StreamingInputSessions)


# -- requests ---------------------------------------------------------------------------------------------
async def _read_json(request: web.Request) -> dict:
    """The JSON object of a request body, read up to the protocol's frame limit (the app's own body limit
    is sized for small requests, not audio chunks)."""
    limit = server_state(request).config.limits.max_message_bytes
    body = bytearray()
    while data := await request.content.read(64 << 10):
        body += data
        if len(body) > limit:
            raise RequestError(413, "request_too_large", f"The request body is larger than {limit} bytes")
    if not body:
        return {}
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(422, "invalid_json", f"The body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError(422, "invalid_json", "The body must be a JSON object")
    return value


def _parse_chunk(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError(422, "invalid_chunk", "chunk must be an object", "chunk")
    seq = body.get("sequence_id")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise RequestError(422, "invalid_chunk", f"sequence_id must be a non-negative integer, got {seq!r}",
                           "sequence_id")
    modality = body.get("modality", "audio")
    if modality != "audio":
        raise RequestError(422, "unsupported_modality", f"This server takes audio chunks, not {modality!r}",
                           "modality")
    payload = body.get("payload", "")
    if not isinstance(payload, str):
        raise RequestError(422, "invalid_chunk", "payload must be a base64 string", "payload")
    end = body.get("end_of_input", False)
    if not isinstance(end, bool):
        raise RequestError(422, "invalid_chunk", "end_of_input must be true or false", "end_of_input")
    if not payload and not end:
        raise RequestError(422, "invalid_chunk", "payload is empty", "payload")
    return {"sequence_id": seq, "payload": payload, "end_of_input": end}


def _parse_create(body: dict, state) -> tuple[int | None, bool, dict | None]:
    if "model" in body:
        check_model(state, body["model"])
    if body.get("modality", "audio") != "audio":
        raise RequestError(422, "unsupported_modality", "This server takes audio sessions only", "modality")
    policy = body.get("start_policy", (body.get("streaming_input") or {}).get("start_policy", "on_first_chunk"))
    if policy not in START_POLICIES:
        raise RequestError(422, "unsupported_start_policy", f"start_policy {policy!r} is not supported; use "
                           f"{', '.join(START_POLICIES)}", "start_policy")
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise RequestError(422, "invalid_request", "params must be an object", "params")
    delay_ms = params.get("delay_ms", params.get("transcription_delay_ms"))
    if delay_ms is not None and delay_ms not in state.allowed_delays_ms:
        raise RequestError(422, "invalid_request", f"delay_ms must be one of {list(state.allowed_delays_ms)}",
                           "params.delay_ms")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(422, "invalid_request", "stream must be true or false", "stream")
    chunk = _parse_chunk(body["chunk"]) if body.get("chunk") is not None else None
    return delay_ms, stream, chunk


def _handler(call):
    """A route handler answering RequestError in OpenAI's error shape (and counting it)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await call(request, request.app[STREAMING_INPUT])
        except RequestError as exc:
            server_state(request).metrics.errors.labels(code=exc.code).inc()
            return error_response(exc.status, exc.code, str(exc), exc.param)

    return handle


async def _create(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    state = registry.server
    check_ready(state)
    delay_ms, stream, chunk = _parse_create(await _read_json(request), state)
    if len(registry.sessions) >= state.max_connections:
        raise RequestError(429, "too_many_sessions", f"The server holds {len(registry.sessions)} streaming "
                           "input sessions, its limit; finish one or retry later")
    session = InputSession(delay_ms, stream)
    registry.sessions[session.id] = session
    answer = {"session_id": session.id, "expires_in": int(registry.session_timeout_s)}
    if chunk is not None:
        try:
            answer.update(await registry.add_chunk(session, chunk))
        except RequestError:
            await registry.close(session, "its first chunk was refused")  # the client never got its id
            raise
    return web.json_response(answer, status=201)


async def _chunks(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    session = registry.get(request.match_info["session_id"])
    chunk = _parse_chunk(await _read_json(request))
    answer = await registry.add_chunk(session, chunk)
    return web.json_response(answer, status=200 if answer.get("duplicate") else 202)


async def _finish(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    return web.json_response(await registry.finish(registry.get(request.match_info["session_id"])))


async def _result(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    session = registry.get(request.match_info["session_id"])
    if not session.input_ended and not session.done.is_set():
        raise RequestError(409, "input_not_finished", "The input has not ended; finish the session first")
    await session.done.wait()  # bounded: the engine finishes a session whose input ended
    if session.error is not None:
        raise engine_request_error(session.error)
    if session.result is None:
        raise RequestError(410, "session_expired", f"Session {session.id} was closed before its result")
    done = session.result
    return web.json_response({"session_id": session.id, "text": done.text, "usage": text_usage(done),
                              "words": [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]})


async def _events(request: web.Request, registry: StreamingInputSessions) -> web.StreamResponse:
    session = registry.get(request.match_info["session_id"])
    if session.log is None:
        raise RequestError(409, "not_streaming", "The session was created without stream: true")
    try:
        after = sse.last_event_id(request)
    except ValueError as exc:
        raise RequestError(422, "invalid_last_event_id", str(exc)) from None
    session.listeners += 1
    complete = False
    try:
        # No first-event timeout: the client paces the input, so a quiet stream is not a stuck engine.
        response, complete = await sse.stream_log(request, session.log, after=after, first_event_timeout_s=None)
    finally:  # also when aiohttp cancels the handler because the client went away
        session.listeners -= 1
        session.detached_at = None if complete else time.monotonic()
    return response


def add_streaming_input_routes(app: web.Application) -> None:
    from jaxstream.serving.app import SERVER  # app.py imports this module to register its routes

    registry = StreamingInputSessions(app[SERVER])
    app[STREAMING_INPUT] = registry
    app.router.add_post(PREFIX, _handler(_create))
    app.router.add_post(PREFIX + "/{session_id}/chunks", _handler(_chunks))
    app.router.add_post(PREFIX + "/{session_id}/finish", _handler(_finish))
    app.router.add_get(PREFIX + "/{session_id}/result", _handler(_result))
    app.router.add_get(PREFIX + "/{session_id}/events", _handler(_events))

    async def reaper(app: web.Application):
        task = asyncio.create_task(registry.reap())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for session in list(registry.sessions.values()):
            await registry.close(session, "server shutting down")

    app.cleanup_ctx.append(reaper)
