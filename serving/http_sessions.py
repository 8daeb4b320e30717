"""Mode B streaming input: one request's input, audio or text, arriving over several HTTP requests
(specs/realtime_protocols.md §7.2, from the vllm-omni streaming-input RFC).

    POST /v1/streaming_input/sessions                    {model?, modality?, params?, stream?, start_policy?,
                                                          chunk?} -> {session_id, expires_in}
    POST /v1/streaming_input/sessions/{id}/chunks        {sequence_id, modality?, payload, end_of_input?}
    POST /v1/streaming_input/sessions/{id}/finish        ends the input; idempotent
    GET  /v1/streaming_input/sessions/{id}/result        waits for and returns the final result
    GET  /v1/streaming_input/sessions/{id}/events        SSE (sessions created with stream: true)

`modality` is the served model's: audio (base64 PCM16 LE mono 16 kHz; a transcription, `params.delay_ms`, and
`params.language` checked as an upload's `language` is) or text (base64 UTF-8; a completion whose `params` are
/v1/completions' sampling fields, `max_tokens` per chunk). The engine takes streaming input natively (the
RFC's "Option 2"): once the start policy holds (streaming_input.py) the engine session starts, and every later
chunk is applied to it as it arrives, a text chunk as its own `StreamingInput` under the engine's
cumulative-prompt rule.

Chunks are applied in `sequence_id` order: one that arrives early is held until the gap fills; a repeated
`sequence_id` is acknowledged and ignored, or refused (409) when its content differs from what was received.
What a session remembers of the ids is bounded: the next id expected, the held chunks (less than
`max_held_chunks` ids ahead of it; an id further ahead is refused, 422) and the digests of the last
`_RECENT_DIGESTS` applied ones (an older duplicate is acknowledged without the content check). The payload
bytes a session received (held chunks included) are capped; crossing the cap answers 413, closes the session
and aborts its engine session. A chunk or finish the engine refuses for now (at capacity: 503, Retry-After)
changes nothing: the chunk stays held unapplied and its retry (or a finish) applies it. A refusal of the
client's input (a finish with no payload: 422 `no_input`, as an empty commit is an error on the realtime routes)
leaves the session open for its input; one the engine answers for good (draining, dead, invalid audio) closes it.
`.../result` before the input ended answers what stands in the way, the refusal a finish would give then: no
payload yet (422 `no_input`), chunks missing (409 `chunks_missing`), or else a finish still to come (409
`input_not_finished`), so that a client that called finish and result in turn is told the same thing twice and
what to do next.

A session with unfinished input and no chunk for `session_timeout_s` is closed (410 afterwards), as is one
whose event stream dropped and was not resumed within `resume_grace_s`, and one whose engine work has not ended
`max_session_seconds` after its creation (the server's limits, as a WebSocket connection's age: its event stream
ends with `max_duration_exceeded`); a finished session stays readable for `session_timeout_s`. Output events
are kept in the session's bounded `EventLog`, so a client resumes a dropped `…/events` stream with
`Last-Event-ID` and gets every event once. A session counts as one open stream of its key (limits.KeyLimits)
and of the server (drain waits for it) until its engine work ends.
"""
import asyncio
import collections
import hashlib
import logging
import os
import socket
import time
import uuid

from aiohttp import web

from jaxstream.serving import sse, streaming_input
from jaxstream.serving.completion_fields import check_tokenizer, parse_flag, sampling_params
from jaxstream.serving.http_completions import TextInput
from jaxstream.serving.http_errors import (
    RETRYABLE_ENGINE_CODES, RequestError, check_model, check_ready, engine_request_error, read_json,
)
from jaxstream.serving.http_transcriptions import AudioInput, check_json_params, parse_delay_ms, parse_include
from jaxstream.serving.limits import duration_breach

logger = logging.getLogger(__name__)

PREFIX = "/v1/streaming_input/sessions"
_TOMBSTONES = 4096  # ids of closed sessions remembered, so that late calls get 410 rather than 404
_RECENT_DIGESTS = 64  # applied chunks whose content a duplicate is checked against
_MISSING_SHOWN = 8  # ids a finish refused for a gap names
# A session lives on the replica that created it; behind a balancer, a gateway sends its later requests to the
# replica this header names (deploy/README.md: the pod's name, resolvable as <pod>.jaxstream-pods).
REPLICA_HEADER = "X-Jaxstream-Replica"
_REAP_EVERY_S = 0.5


class InputSession:
    """One Mode B session: the ordering state of its chunks, its engine input and its output."""

    def __init__(self, stream, feed: streaming_input.InputFeed, key: str):
        self.id = uuid.uuid4().hex
        self.stream = stream
        self.feed = feed
        self.key = key
        self.handle: streaming_input.DrainHandle | None = None
        self.lock = asyncio.Lock()  # chunks and finish are applied one at a time, in sequence order
        self.next_seq = 0
        self.held: dict[int, tuple] = {}  # sequence_id -> (piece or None, end_of_input, digest), for a gap
        self.recent: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # applied id -> digest
        self.end_seq: int | None = None
        self.closed = False
        self.created = self.last_activity = time.monotonic()
        self.done_at: float | None = None
        self.listeners = 0
        self.detached_at: float | None = None

    @property
    def log(self) -> sse.EventLog | None:
        return self.stream.log

    @property
    def input_ended(self) -> bool:
        return self.feed.ended

    @property
    def state(self) -> str:
        if self.closed:
            return "closed"
        if self.input_ended:
            return "finished"
        return "started" if self.stream.started else "open"

    def acknowledgement(self, **extra) -> dict:
        return {"session_id": self.id, "state": self.state, "started": self.stream.started,
                "next_sequence_id": self.next_seq, "held": sorted(self.held), **extra}


class StreamingInputSessions:
    """The open sessions of one app and their settings (attributes, so an embedder or a test can tune
    them on `app[STREAMING_INPUT]` before use)."""

    session_timeout_s = 300.0  # the RFC's streaming_input.session_timeout_sec
    resume_grace_s = 30.0  # a dropped event stream is kept this long for a Last-Event-ID resume
    max_held_chunks = 256  # out-of-order chunks waiting for a gap

    def __init__(self, state):
        self.server = state
        self.limits = state.config.limits
        self.max_payload_bytes = self.limits.max_payload_per_session
        self.sessions: dict[str, InputSession] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # closed id -> why

    def get(self, session_id: str) -> InputSession:
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        if session_id in self.gone:
            raise RequestError(410, "session_expired", f"Session {session_id} is closed: {self.gone[session_id]}")
        raise RequestError(404, "session_not_found", f"No streaming input session {session_id}")

    async def open(self, session: InputSession) -> None:
        """Registers `session` as an open stream of its key and of the server; RequestError when refused."""
        limits = self.server.key_limits
        if not limits.open_stream(session.key):
            raise RequestError(429, "rate_limit_exceeded", f"This key already has {limits.max_streams} open "
                               "streams; finish a session or retry later", retry_after=1)
        session.handle = streaming_input.DrainHandle(
            session.stream, session.feed, on_stop=lambda breach: asyncio.ensure_future(self.close(
                session, breach.message or breach.outcome)))
        try:
            streaming_input.admit(self.server, session.handle)
        except RequestError:
            limits.close_stream(session.key)
            raise
        self.sessions[session.id] = session
        asyncio.create_task(self._release_when_done(session))

    async def _release_when_done(self, session: InputSession) -> None:
        await session.stream.wait()
        session.done_at = time.monotonic()
        self.server.forget(session.handle)
        self.server.key_limits.close_stream(session.key)

    async def close(self, session: InputSession, reason: str, code: str = "session_closed") -> None:
        """Closes `session` for good: its engine work is aborted and later calls answer 410. `code` is the
        error its event stream ends with: the cause's own where it has one, so that it is typed as it is."""
        if not session.closed:
            session.closed = True
            logger.info("streaming input session %s closed: %s", session.id, reason)
            if not session.stream.done:
                session.stream.fail(code, f"The session was closed: {reason}")
                await session.stream.abort(reason)
        self.sessions.pop(session.id, None)
        self.gone[session.id] = reason
        while len(self.gone) > _TOMBSTONES:
            self.gone.popitem(last=False)

    async def reap(self) -> None:
        """Closes idle, abandoned and long-finished sessions. It must outlive any one session's failure: once
        it stopped, no session was ever closed again (their results and engine streams piled up)."""
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            await self._reap_all(time.monotonic())

    async def _reap_all(self, now: float) -> None:
        # A frame of its own: a loop variable in `reap` would keep the last session (its result, event log
        # and engine stream) alive for as long as the server stays idle.
        for session in list(self.sessions.values()):
            try:
                await self._reap(session, now)
            except Exception:  # noqa: BLE001 - a bug in one session must not stop the reaping of all
                logger.exception("streaming input session %s: reaping it failed", session.id)

    async def _reap(self, session: InputSession, now: float) -> None:
        # `done_at` is set once `_release_when_done` has run, which may be a loop turn after the stream ended.
        if session.done_at is not None and now - session.done_at > self.session_timeout_s:
            await self.close(session, f"expired after its result was kept {self.session_timeout_s:g} s")
        elif not session.stream.done and now - session.created >= self.limits.max_session_seconds:
            # A client sending a chunk every few minutes, under session_timeout_s, held an engine session and a
            # connection slot for good; its event stream ends with the code a WebSocket gets at that age.
            breach = duration_breach(self.limits, "session")
            await self.close(session, breach.message, breach.error_code)
        elif not session.input_ended and now - session.last_activity > self.session_timeout_s:
            await self.close(session, f"no chunk for {self.session_timeout_s:g} s")
        elif (session.detached_at is not None and not session.listeners and not session.stream.done
              and now - session.detached_at > self.resume_grace_s):
            await self.close(session, f"its event stream was not resumed within {self.resume_grace_s:g} s")

    # -- applying chunks ----------------------------------------------------------------------------------
    async def add_chunk(self, session: InputSession, chunk: dict) -> dict:
        """Applies one validated chunk (`streaming_input.parse_chunk`); the acknowledgement, or RequestError."""
        seq, payload, end = chunk["sequence_id"], chunk["payload"], chunk["end_of_input"]
        async with session.lock:
            if session.closed:
                raise RequestError(410, "session_expired", f"Session {session.id} is closed")
            session.last_activity = time.monotonic()
            digest = hashlib.sha256(f"{int(end)}:{payload}".encode()).digest()
            known = session.held[seq][2] if seq in session.held else session.recent.get(seq)
            if known is not None or seq < session.next_seq:
                if known is not None and known != digest:
                    raise RequestError(409, "sequence_conflict", f"sequence_id {seq} was already received "
                                       "with different content", "sequence_id")
                if seq != session.next_seq:
                    return session.acknowledgement(sequence_id=seq, duplicate=True)
                await self._apply_ready(session)  # the retry of a chunk the engine refused for now
                return session.acknowledgement(sequence_id=seq)
            if end and not payload and session.end_seq is not None and seq > session.end_seq:
                # §7.2: a repeated end_of_input (or finish) has no further effect.
                return session.acknowledgement(sequence_id=seq, duplicate=True)
            if session.input_ended or (session.end_seq is not None and seq > session.end_seq):
                # A drain that ended the input says so: the client did not end it (InputFeed.after_end).
                why = session.feed.drained or "The input ended"
                raise RequestError(409, "input_finished", f"{why}; sequence_id {seq} comes after it", "sequence_id")
            if end and session.end_seq is not None:
                raise RequestError(409, "input_finished", f"sequence_id {session.end_seq} already ended the "
                                   "input", "sequence_id")
            if end and any(held > seq for held in session.held):
                raise RequestError(409, "input_finished", f"end_of_input at {seq} precedes chunks already "
                                   "received", "sequence_id")
            # The window bounds what an id can cost: the held chunks, and the gap a finish reports.
            if seq >= session.next_seq + self.max_held_chunks:
                raise RequestError(422, "sequence_id_out_of_window", f"sequence_id {seq} is too far ahead: "
                                   f"{session.next_seq} comes next, and chunks are held for a gap of at most "
                                   f"{self.max_held_chunks} ids", "sequence_id")
            piece = session.stream.decode(payload) if payload else None
            if end and piece is None and seq == session.next_seq:
                self._check_end(session)  # before anything changes: the session stays open for its input
            if piece is not None and not session.feed.count(session.stream.measure(piece)[0]):
                await self.close(session, f"payload over the {self.max_payload_bytes}-byte cap")
                raise RequestError(413, "payload_too_large", f"The session received more than "
                                   f"{self.max_payload_bytes} bytes of payload; it is closed")
            session.held[seq] = (piece, end, digest)
            if end:
                session.end_seq = seq
            if seq == session.next_seq:
                await self._apply_ready(session)
            return session.acknowledgement(sequence_id=seq)

    async def _apply_ready(self, session: InputSession) -> None:
        """Applies the held chunks that continue the input, in order. One the engine refused for now (at
        capacity: 503, Retry-After) stays held and unapplied, so that a retry of it, or of finish, applies it.
        Those still held when a drain ended the input are dropped, as a WebSocket client's audio after the drain
        ended its utterance is: the request that applied the chunks before them succeeded, and the transcript says
        what it covers (its `truncation`). Refusing the request named a chunk it did not send."""
        while session.next_seq in session.held:
            if session.feed.drained is not None:
                session.held.clear()
                return
            seq = session.next_seq
            piece, end, digest = session.held[seq]
            retry = False
            try:
                if piece is not None:
                    await self._apply(session, session.feed.add(piece))
                    session.held[seq] = (None, end, digest)  # in: the retry of a refused end must not add it again
                if end:
                    await self._apply(session, session.feed.end())
            except RequestError as exc:
                retry = exc.code in RETRYABLE_ENGINE_CODES
                raise
            finally:  # a refusal for good (or a cancelled request) consumed the chunk all the same
                if not retry:
                    del session.held[seq]
                    session.recent[seq] = digest
                    if len(session.recent) > _RECENT_DIGESTS:
                        session.recent.popitem(last=False)
                    session.next_seq += 1

    async def _apply(self, session: InputSession, step) -> None:
        """Awaits `step`, a call of the session's feed; a refusal for good closes the session."""
        try:
            await step
        except RequestError as exc:
            if exc.code not in RETRYABLE_ENGINE_CODES and (exc.status >= 500 or exc.code == "invalid_audio"):
                # the engine refused it for good: the session is lost
                await self.close(session, f"the engine refused the input: {exc}", exc.code)
            raise

    async def finish(self, session: InputSession) -> dict:
        async with session.lock:
            if session.closed:
                raise RequestError(410, "session_expired", f"Session {session.id} is closed")
            if not session.input_ended:
                await self._apply_ready(session)  # a chunk the engine refused for now goes first
            if not session.input_ended:
                if session.held:
                    raise _chunks_missing(session)
                self._check_end(session)
                await self._apply(session, session.feed.end())  # refused: nothing changed, the input stays open
                session.end_seq = session.next_seq - 1
            return session.acknowledgement()

    def _check_end(self, session: InputSession) -> None:
        """RequestError 422 no_input when ending the input now would end it empty (the feed's check), saying
        that the session stays open for its input and for how long."""
        try:
            session.feed.check_end()
        except RequestError as exc:
            raise RequestError(exc.status, exc.code, f"Session {session.id} has received no payload, so its input "
                               "cannot end yet: send chunks with a payload, then finish it (it stays open, and "
                               f"closes after {self.session_timeout_s:g} s without a chunk)") from None

    def unfinished(self, session: InputSession) -> RequestError:
        """Why `session`, whose input has not ended, has no result yet: what a finish would answer now, or, when
        a finish would succeed, that it is still to come."""
        if session.held:
            return _chunks_missing(session)
        try:
            self._check_end(session)
        except RequestError as exc:
            return exc
        return RequestError(409, "input_not_finished", f"The input has not ended: finish the session (POST {PREFIX}/"
                            f"{session.id}/finish) or send a chunk with end_of_input, then ask for its result")


def _chunks_missing(session: InputSession) -> RequestError:
    """The 409 of a finish while chunks wait for a gap: how many ids are missing, and the first of them."""
    last = max(session.held)
    count = last - session.next_seq + 1 - len(session.held)
    first = [seq for seq in range(session.next_seq, last) if seq not in session.held][:_MISSING_SHOWN]
    more = ", ..." if count > len(first) else ""
    chunks, them = ("chunk has", "it") if count == 1 else ("chunks have", "them")
    return RequestError(409, "chunks_missing", f"{count} {chunks} not arrived (sequence_id "
                        f"{', '.join(map(str, first))}{more}); send {them} before finishing")


STREAMING_INPUT = web.AppKey("jaxstream_streaming_input", StreamingInputSessions)


# -- requests ---------------------------------------------------------------------------------------------
def _new_session(body: dict, registry: StreamingInputSessions, key: str) -> tuple[InputSession, dict | None]:
    state = registry.server
    default = "audio" if state.engine.kind == "realtime" else "text"
    modality = streaming_input.parse_modality(body, default)
    kind = "realtime" if modality == "audio" else "text"
    check_model(state, body.get("model"), kind)
    policy = streaming_input.parse_start_policy(body, modality)
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise RequestError(422, "invalid_request", "params must be an object", "params")
    try:  # null is false, as in OpenAI's APIs; a refused session's body is a 422 here
        stream = parse_flag(body, "stream")
    except RequestError as exc:
        raise RequestError(422, exc.code, str(exc), exc.param) from None
    log = sse.EventLog() if stream else None
    if modality == "audio":
        check_json_params(params, "params.")  # unused by the model; checked as the upload's
        engine_input = AudioInput(state, parse_delay_ms(params, state, "params.delay_ms"), log,
                                  logprobs=parse_include(params, "params.include"))
    else:
        check_tokenizer(state)
        if "prompt" in params:
            raise RequestError(422, "invalid_request", "With streaming input the prompt comes as chunks",
                               "params.prompt")
        try:
            sampling = sampling_params(params, state.engine.default_sampling_params(),
                                       vocab_size=state.engine.model_config.vocab_size,
                                       tokenizer=state.engine.tokenizer)
            engine_input = TextInput(state, sampling, log, return_token_ids=parse_flag(params, "return_token_ids"))
        except RequestError as exc:
            raise RequestError(422, exc.code, str(exc), f"params.{exc.param}" if exc.param else "params") from None
    chunk = streaming_input.parse_chunk(body["chunk"], modality) if body.get("chunk") is not None else None
    feed = streaming_input.InputFeed(engine_input, policy, registry.max_payload_bytes)
    return InputSession(engine_input, feed, key), chunk


def _handler(call):
    """A route handler answering RequestError in OpenAI's error shape (and counting it)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        registry = request.app[STREAMING_INPUT]
        try:
            return await call(request, registry)
        except RequestError as exc:
            registry.server.metrics.errors.labels(code=exc.code).inc()
            return exc.response()

    return handle


async def _create(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    check_ready(registry.server)
    body = await read_json(request, invalid_status=422)
    session, chunk = _new_session(body, registry, registry.server.key_limits.key_of(request))
    await registry.open(session)
    answer = {"session_id": session.id, "expires_in": int(registry.session_timeout_s)}
    if chunk is not None:
        try:
            answer.update(await registry.add_chunk(session, chunk))
        except RequestError:
            await registry.close(session, "its first chunk was refused")  # the client never got its id
            raise
    replica = os.environ.get("JAXSTREAM_REPLICA_ID") or socket.gethostname()
    return web.json_response(answer, status=201, headers={REPLICA_HEADER: replica})


async def _chunks(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    session = registry.get(request.match_info["session_id"])
    chunk = streaming_input.parse_chunk(await read_json(request, invalid_status=422), session.stream.modality)
    answer = await registry.add_chunk(session, chunk)
    return web.json_response(answer, status=200 if answer.get("duplicate") else 202)


async def _finish(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    return web.json_response(await registry.finish(registry.get(request.match_info["session_id"])))


async def _result(request: web.Request, registry: StreamingInputSessions) -> web.Response:
    session = registry.get(request.match_info["session_id"])
    if not session.input_ended and not session.stream.done:
        raise registry.unfinished(session)
    await session.stream.wait()  # bounded: the engine finishes a session whose input ended
    if session.stream.failure is not None:
        raise engine_request_error(session.stream.failure)
    if not session.stream.succeeded:
        raise RequestError(410, "session_expired", f"Session {session.id} was closed before its result")
    return web.json_response({"session_id": session.id, **session.stream.result()})


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
        response, complete = await sse.stream_log(request, session.log, send_timeout_s=registry.limits.send_timeout_s,
                                                  after=after, first_event_timeout_s=None,
                                                  on_slow_reader=registry.server.metrics.slow_reader_counter(request))
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
