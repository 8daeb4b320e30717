"""Streaming input over HTTP, what Mode A and Mode B share (specs/realtime_protocols.md §7): the chunk
object, start policies, the gate that applies in-order chunks to an engine input, the NDJSON body of a
Mode A request, and the handle that lets the server's drain wait for an HTTP stream.

An engine input is one of `http_transcriptions.AudioInput` (a transcription session) or
`http_completions.TextInput` (a `generate` call over `StreamingInput` chunks), both `EngineInput`s. They offer:

    modality                 "audio" | "text"
    log                      the sse.EventLog its output goes to (None: result only)
    decode(payload) -> piece a chunk's base64 payload as PCM or text (RequestError 422 when it is not)
    measure(piece)           (bytes, audio seconds) of a piece, for the payload cap and on_min_length
    join(pieces) -> piece    the pieces buffered before the start, as one
    started, done            an engine session exists / it ended (its output is complete)
    succeeded, failure       it ended with a result / the EngineError it ended with
    drained                  the notice of a drain that ended the input (`mark_drained`), or None: the output's
                             end then says so (the notice right before the final event, which, like the result,
                             carries `truncated` and `truncation`)
    async start(), append(piece), finish(), abort(reason), close(), wait(timeout), result() -> dict
    fail(code, message)      ends it with an `error` event typed by its code (a bad chunk in the middle of a
                             Mode A body is the client's invalid_request_error, a shutdown the server's
                             server_error: http_errors.error_type)

Start policies (the RFC's `streaming_input.start_policy`): `on_first_chunk` starts the engine with the
first chunk; `on_min_length` buffers until `min_bytes` of payload (decoded: PCM16 or UTF-8 bytes) or
`min_audio_seconds` of audio arrived; `on_end_only` buffers the whole input. The chunks buffered before the
start become one first prompt (text) or one append (audio); each later chunk goes to the engine as it
comes, a text chunk as its own `StreamingInput` (the engine's cumulative-prompt rule then applies chunk by
chunk).
"""
import abc
import asyncio
import base64
import binascii
import dataclasses
import logging

from aiohttp import web

from jaxstream.errors import EngineError
from jaxstream.serving import sse, wire_json
from jaxstream.serving.http_errors import (
    RequestError, body_read, engine_request_error, parse_json_object, read_before_admission,
)
from jaxstream.serving.limits import Breach, drain_notice, duration_breach
from jaxstream.serving.request_queue import OverShare

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25  # how often a plain (non-streamed) response checks that its client is still there

START_POLICIES = ("on_first_chunk", "on_min_length", "on_end_only")
MODALITIES = ("audio", "text")
# How many one-shot requests may wait for a connection slot, per slot: each holds the body it sent.
WAITING_PER_CONNECTION = 4
_ADMIT_STATUS = {"capacity": 429}  # admission refusals other than these are 503 (loading, draining, dead)


def decode_base64(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(422, "invalid_chunk", f"payload is not base64: {exc}", "payload") from None


# -- chunks and start policies ----------------------------------------------------------------------------
def parse_chunk(body, modality: str, *, ordered: bool = True) -> dict:
    """A chunk object `{sequence_id, modality, payload, end_of_input}` of a session of `modality`;
    `sequence_id` is required when `ordered` (Mode B), optional in a Mode A body (lines arrive in order)."""
    if not isinstance(body, dict):
        raise RequestError(422, "invalid_chunk", "chunk must be an object", "chunk")
    seq = body.get("sequence_id")
    if (ordered or seq is not None) and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 0):
        raise RequestError(422, "invalid_chunk", f"sequence_id must be a non-negative integer, got {seq!r}",
                           "sequence_id")
    chunk_modality = body.get("modality", modality)
    if chunk_modality != modality:
        raise RequestError(422, "unsupported_modality", f"This session takes {modality} chunks, not "
                           f"{chunk_modality!r}", "modality")
    payload = body.get("payload", "")
    if not isinstance(payload, str):
        raise RequestError(422, "invalid_chunk", "payload must be a base64 string", "payload")
    end = body.get("end_of_input", False)
    if not isinstance(end, bool):
        raise RequestError(422, "invalid_chunk", "end_of_input must be true or false", "end_of_input")
    if not payload and not end:
        raise RequestError(422, "invalid_chunk", "payload is empty", "payload")
    return {"sequence_id": seq, "payload": payload, "end_of_input": end}


def parse_modality(body: dict, default: str) -> str:
    modality = body.get("modality", default)
    if modality not in MODALITIES:
        raise RequestError(422, "unsupported_modality", f"modality must be one of {', '.join(MODALITIES)}, "
                           f"got {modality!r}", "modality")
    return modality


def check_streamed(params: dict) -> None:
    """Mode A answers with an SSE stream whatever its parameters line says: a `stream` other than true (which
    was ignored) is refused, as a request for another answer."""
    stream = params.get("stream")
    if stream is not None and stream is not True:
        raise RequestError(422, "invalid_request", f"stream must be true or absent, got "
                           f"{wire_json.shown(repr(stream), 40)}: with X-Streaming-Input the answer is an SSE stream",
                           "stream")


@dataclasses.dataclass(frozen=True)
class StartPolicy:
    name: str = "on_first_chunk"
    min_bytes: int | None = None
    min_audio_seconds: float | None = None

    def holds(self, received_bytes: int, audio_seconds: float) -> bool:
        """Whether inference starts with this much input buffered (the end of input always starts it)."""
        if self.name == "on_first_chunk":
            return True
        if self.name == "on_end_only":
            return False
        return ((self.min_bytes is not None and received_bytes >= self.min_bytes)
                or (self.min_audio_seconds is not None and audio_seconds >= self.min_audio_seconds))


def parse_start_policy(body: dict, modality: str) -> StartPolicy:
    """The start policy of a create body or a Mode A parameters line: `start_policy` (a name) with
    `min_bytes` / `min_audio_seconds`, at the top level or inside a `streaming_input` object."""
    nested = body.get("streaming_input") or {}
    if not isinstance(nested, dict):
        raise RequestError(422, "invalid_request", "streaming_input must be an object", "streaming_input")
    merged = {**nested, **{k: body[k] for k in ("start_policy", "min_bytes", "min_audio_seconds") if k in body}}
    name = merged.get("start_policy", "on_first_chunk")
    if name not in START_POLICIES:
        raise RequestError(422, "unsupported_start_policy", f"start_policy {name!r} is not supported; use "
                           f"{', '.join(START_POLICIES)}", "start_policy")
    min_bytes, seconds = merged.get("min_bytes"), merged.get("min_audio_seconds")
    if name != "on_min_length":
        if min_bytes is not None or seconds is not None:
            raise RequestError(422, "invalid_request", "min_bytes and min_audio_seconds go with start_policy "
                               "on_min_length", "start_policy")
        return StartPolicy(name)
    if min_bytes is None and seconds is None:
        raise RequestError(422, "invalid_request", "on_min_length needs min_bytes or min_audio_seconds",
                           "min_bytes")
    if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 1):
        raise RequestError(422, "invalid_request", f"min_bytes must be a positive integer, got {min_bytes!r}",
                           "min_bytes")
    if seconds is not None:
        if modality != "audio":
            raise RequestError(422, "invalid_request", "min_audio_seconds applies to audio input only",
                               "min_audio_seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise RequestError(422, "invalid_request", f"min_audio_seconds must be a positive number, got "
                               f"{seconds!r}", "min_audio_seconds")
    return StartPolicy(name, min_bytes, None if seconds is None else float(seconds))


class EngineInput(abc.ABC):
    """What both engine inputs share: the server state, the output log, the task pumping the engine's output
    and the event set when that output is complete."""

    def __init__(self, state, log: sse.EventLog | None):
        self.state = state
        self.log = log
        self._pump: asyncio.Task | None = None
        self._done = asyncio.Event()
        self.drained: str | None = None
        self.drained_at = 0.0  # the input received when the drain ended it: seconds of audio, bytes of text

    def mark_drained(self, received: float) -> None:
        """Marks the output as cut short by the drain (DrainHandle.finish_for_drain), which ends the input after
        `received` seconds of audio or bytes of text."""
        self.drained, self.drained_at = drain_notice(received, self.modality), received

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def fail(self, code: str, message: str) -> None:
        """Ends the output with an `error` event and aborts the engine session. The event's type is its code's
        (http_errors.error_type), whatever the modality: a bad chunk or payload is the client's
        `invalid_request_error`, a shutdown or an internal failure the server's `server_error`."""
        if self.log is not None:
            # Counted as every error event sent (the pumps' own, a WebSocket's at its breach): a stream's end at
            # max_session_seconds, a drain's or a bad chunk's went out uncounted. The stream's last event: output
            # the engine session still holds queued does not follow it.
            sse.close_with_error(self.log, code, message, self.state.metrics)
        asyncio.ensure_future(self.abort(code))

    def progress(self) -> int:
        """A count of the engine's work on this input that yields no event (none by default)."""
        return 0

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Stops the engine session (if any) and ends the output; idempotent."""

    async def _wait_done(self, timeout: float | None) -> None:
        async with asyncio.timeout(timeout):
            await self._done.wait()

    async def serve_output(self, request: web.Request) -> web.StreamResponse | None:
        """The request's answer while the output is produced. With a log: the SSE response (the input is
        aborted if the client leaves before the end). Without: waits for the end watching the socket, since a
        plain response writes nothing until then; None once the output is complete, 499 if the client left.
        The first-event timeout runs from the input's last `progress`: an upload's first text comes where its
        speech starts, which may be minutes in, while the engine works through the silence before it."""
        if self.log is not None:
            response, complete = await sse.stream_log(
                request, self.log, send_timeout_s=self.state.config.limits.send_timeout_s,
                first_event_timeout_s=sse.FIRST_EVENT_TIMEOUT_S, progress=self.progress,
                on_slow_reader=self.state.metrics.slow_reader_counter(request))
            if not complete:
                await self.abort("client_disconnected")
            return response
        while not self.done:
            try:
                await self._wait_done(_DISCONNECT_POLL_S)
            except TimeoutError:
                pass
            if sse.client_gone(request):
                await self.abort("client_disconnected")
                return web.Response(status=499)  # nobody reads it; aiohttp logs the status
        return None


class InputFeed:
    """Applies in-order pieces to an engine input under a start policy (see the module docstring)."""

    def __init__(self, stream, policy: StartPolicy, max_payload_bytes: int):
        self.stream = stream
        self.policy = policy
        self.max_payload_bytes = max_payload_bytes
        self.payload_bytes = 0  # received, for the cap (Mode B counts chunks still held for a gap too)
        self.applied_bytes = 0  # in order, for the start policy
        self.audio_seconds = 0.0
        self.ended = False
        self._pending: list = []

    @property
    def drained(self) -> str | None:
        """The notice of a drain that ended the input (DrainHandle.finish_for_drain), or None."""
        return self.stream.drained

    @property
    def buffered(self) -> bool:
        """Whether the start policy holds input back from an engine session not started yet."""
        return not self.ended and not self.stream.started and bool(self._pending)

    def count(self, payload_bytes: int) -> bool:
        """Adds received payload bytes; False once they exceed the cap."""
        self.payload_bytes += payload_bytes
        return self.payload_bytes <= self.max_payload_bytes

    async def add(self, piece) -> None:
        """Applies the next piece. A start the engine refuses leaves the feed as it was, so that the same
        piece can be offered again (Mode B keeps a chunk refused for capacity for the client's retry). A piece after
        the end of the input is refused with `after_end` (the engine's own refusal, `session_closed`, named an engine
        session the client never saw); Mode A drops the chunks it reads then instead (`_read_chunks`)."""
        if self.ended:
            raise self.after_end()
        size, seconds = self.stream.measure(piece)
        # Counted before the engine takes it: an append waiting for the engine to catch up (backpressure) is ahead
        # of an end that comes meanwhile, so a drain ending the input then must count it among the input received.
        self.applied_bytes += size
        self.audio_seconds += seconds
        try:
            if self.stream.started:
                await self.stream.append(piece)
            elif self.policy.holds(self.applied_bytes, self.audio_seconds):
                await self._start([*self._pending, piece])
            else:
                self._pending.append(piece)
        except EngineError as exc:
            self.applied_bytes -= size
            self.audio_seconds -= seconds
            raise engine_request_error(exc) from None

    def after_end(self) -> RequestError:
        """The refusal of a piece that comes after the end of the input: one the drain ended says so, since the
        client did not end it (Mode B: a chunk in flight while the drain ended the input)."""
        why = f"{self.drained}; a chunk sent after that" if self.drained else "The input ended; a chunk after its end"
        return RequestError(409, "input_finished", f"{why} is not applied")

    def check_end(self) -> None:
        """RequestError 422 when ending the input now would end it empty; the input then stays open."""
        if not self.ended and not self.stream.started and not self._pending:
            raise RequestError(422, "no_input", "The input ended before any payload arrived")

    async def end(self) -> None:
        """Ends the input (idempotent); starts the engine first when the policy was still buffering. A start
        the engine refuses leaves the input open, its buffered pieces kept."""
        if self.ended:
            return
        self.check_end()
        try:
            if not self.stream.started:
                await self._start(self._pending)
            self.ended = True
            await self.stream.finish()
        except EngineError as exc:
            raise engine_request_error(exc) from None

    async def _start(self, pieces: list) -> None:
        await self.stream.start()  # the engine refuses a start whole: nothing to undo
        self._pending = []
        await self.stream.append(self.stream.join(pieces))


# -- draining -----------------------------------------------------------------------------------------------
class DrainHandle:
    """An HTTP stream (a request or a Mode B session) as the server's connection registry and drain see a
    WebSocket connection (app.ServerState.admit / drain): busy while its engine session runs; drain ends
    its input (`finish_for_drain`) or aborts it (`stop`)."""

    def __init__(self, stream, feed: InputFeed | None = None, on_stop=None):
        self.stream = stream
        self.feed = feed
        self.on_stop = on_stop  # also called with the Breach (Mode B closes its session)
        self.protocol = self  # drain asks `conn.protocol.busy()`: one object plays both parts

    def busy(self) -> bool:
        return self.stream.started and not self.stream.done

    async def finish_for_drain(self) -> None:
        """Ends the input of a running stream, marked drained with the drain's notice (naming the input the output
        covers): the engine input's pump sends it as an `error` `server_draining` after the output's last delta and
        right before its final event, as the WebSocket protocols send it before their done. A stream whose engine
        session does not run (not started, or over) was stopped, or has no output to cut short."""
        feed = self.feed
        if feed is None or feed.ended or not self.busy():
            return
        stream = self.stream
        received = feed.audio_seconds if stream.modality == "audio" else feed.applied_bytes
        # Marked before the end, which may wait for an append: a chunk that comes meanwhile is told why, and the pump,
        # which logs the output's end as soon as the engine is through, knows that the drain cut it short.
        stream.mark_drained(received)
        try:
            await feed.end()
        except RequestError as exc:
            logger.info("drain could not end an HTTP stream's input: %s", exc)

    def stop(self, breach: Breach) -> None:
        # The stream ends with the breach's own code before `on_stop` runs: the session closing that follows
        # adds no event, and a client sees the server shutting down, not a session closed as for its own fault.
        if not self.stream.done:
            self.stream.fail(breach.error_code or "server_shutdown", self._stop_message(breach))
        if self.on_stop is not None:
            self.on_stop(breach)

    def _stop_message(self, breach: Breach) -> str:
        """The breach's message; for the drain's stop of a stream whose start policy still held its input back, why
        nothing comes of that input. The drain cannot end such an input as it ends a running one: a draining
        `jaxstream serve` has its engine refuse new sessions (AsyncEngine.drain) from the drain's start on."""
        feed, stream = self.feed, self.stream
        if breach.error_code is not None or not stream.state.draining or feed is None or not feed.buffered:
            return breach.message or breach.outcome
        if stream.modality == "audio":
            amount, output = f"{feed.audio_seconds:.2f} s of audio", "transcription"
        else:
            amount, output = f"{feed.applied_bytes} bytes of text", "completion"
        return (f"The server is shutting down and starts no new {output}: the {amount} received were held back by "
                f"start_policy {feed.policy.name} and never reached the engine, so there is no {output}; send the "
                "input again to another replica")


def admit(state, handle: DrainHandle) -> None:
    """Counts `handle` among the server's open streams (drain waits for it); RequestError when the server
    refuses (draining, loading, at its connection limit). The caller ends with `end_request`."""
    refusal = state.admit(handle)
    if refusal is not None:
        raise _refused(refusal)


async def admit_in_turn(state, handle: DrainHandle, request: web.Request) -> None:
    """`admit` for a one-shot request (an upload, a completion, a chat): at the server's connection limit it waits
    its turn, in turns that go round the client keys, up to `request_queue_s` (request_queue.py), then the 429
    `capacity`; so does one that finds WAITING_PER_CONNECTION times the limit waiting (each holds its body) and no
    key holding more places than its own. One whose key holds its share of that full room, or whose place another
    key's newcomer took, is a 429 `rate_limit_exceeded` with Retry-After, as the other per-key limits answer. A
    client that leaves while it waits is a 400 client_disconnected (no one reads it)."""
    async def attempt():
        refusal = state.admit(handle)
        if refusal is not None and refusal.error_code != "capacity":
            raise _refused(refusal)  # draining, loading, dead: waiting would not help
        return refusal is None or None

    try:
        admitted = await state.connection_queue.take(
            attempt, state.config.limits.request_queue_s, lambda: sse.client_gone(request),
            max_waiting=WAITING_PER_CONNECTION * state.max_connections, key=state.key_limits.key_of(request))
    except OverShare as exc:
        raise RequestError(429, "rate_limit_exceeded", str(exc)) from None
    if not admitted:
        if sse.client_gone(request):
            raise RequestError(400, "client_disconnected", "The client went away while its request waited")
        raise RequestError(429, "capacity", f"The server is at its limit of {state.max_connections} connections "
                           f"(requests waited up to {state.config.limits.request_queue_s:g} s); retry later")


def _refused(refusal) -> RequestError:
    return RequestError(_ADMIT_STATUS.get(refusal.error_code, 503), refusal.error_code, refusal.message)


async def end_request(state, handle: DrainHandle, *tasks: asyncio.Task) -> None:
    """The end of a request's stream: cancels its `tasks`, aborts its engine session (a no-op once it
    ended) and forgets `handle`. Callers shield it: a handler cancelled while it runs (the client went
    away, the server shuts down) must still free the engine session and let drain go on."""
    try:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await handle.stream.close()
    finally:
        state.forget(handle)


# -- Mode A: one chunked request with an NDJSON body ---------------------------------------------------------
_TEXT_FLAGS = {"true": True, "1": True, "false": False, "0": False, "": False}


def text_flag(text: str) -> bool | None:
    """A boolean as a form field or a header writes it: true, false, 1 or 0 in any case, empty as false (a form
    field has no null); None for any other text."""
    return _TEXT_FLAGS.get(text.strip().lower())


def is_streaming_input(request: web.Request) -> bool:
    """Whether a request is Mode A: the header `X-Streaming-Input` true (the RFC's value; also 1, in any case, as
    the server's boolean form fields take), or the RFC's content type. RequestError 400 for a header value that is
    neither true nor false: `yes` was read as false, and its client was told to send a multipart form."""
    value = request.headers.get("X-Streaming-Input", "")
    flag = text_flag(value)
    if flag is None:
        raise RequestError(400, "invalid_request", f"X-Streaming-Input must be true or false, got {value[:40]!r}: "
                           "`X-Streaming-Input: true` streams the input as NDJSON chunks", "X-Streaming-Input")
    return flag or request.content_type == "application/x-multipart-streaming"


async def ndjson_objects(request: web.Request, limits):
    """The JSON objects of an NDJSON body, one per non-empty line, as the lines arrive; a line longer than
    `limits.max_message_bytes` is refused (413), a body silent for `limits.idle_timeout_s` too (408: an
    open input would otherwise hold its engine session forever, as an idle WebSocket would)."""
    limit = limits.max_message_bytes
    buffer = bytearray()
    number = 0
    while True:
        data = await body_read(request.content.readany(), limits)
        buffer += data
        while (newline := buffer.find(b"\n")) >= 0:
            line, buffer = bytes(buffer[:newline]).strip(), buffer[newline + 1:]
            number += 1
            if line:
                yield parse_json_object(line, f"Line {number} of the body", status=422)
        if len(buffer) > limit:
            raise RequestError(413, "request_too_large", f"Line {number + 1} of the body is longer than "
                               f"{limit} bytes")
        if not data:
            if buffer.strip():
                yield parse_json_object(bytes(buffer).strip(), f"Line {number + 1} of the body", status=422)
            return


async def first_object(request: web.Request, objects) -> tuple[dict, dict | None]:
    """(parameters, first chunk or None) of a Mode A body: the first line is the parameters object unless
    it carries a payload, in which case the parameters are empty and it is the first chunk.

    The first line is read before the request is admitted, so at the body's minimum rate
    (`read_before_admission`), timed from the body's first byte: without a parameters line (spec §7.1) that byte
    is the first audio, which a push-to-talk or VAD-gated client sends only once someone speaks, and a clock
    started with the request cut such a client after `body_grace_s` of silence. The silence before the first
    byte is bounded by the idle timeout (`ndjson_objects`), a trickled first line still by the rate. The lines
    after it are not read at a rate: the client paces them by design (live input), so an average rate would
    cut real streams; an admitted stream counts against the server's connection limit and its key's streams,
    the idle timeout bounds its silences and `max_session_seconds` its age."""
    return await read_before_admission(request, _first_object(objects), from_first_byte=True)


async def _first_object(objects) -> tuple[dict, dict | None]:
    try:
        first = await anext(objects)
    except StopAsyncIteration:
        raise RequestError(422, "no_input", "The body holds no line") from None
    if "payload" in first or "end_of_input" in first:
        return {}, first
    return first, None


async def serve_mode_a(request: web.Request, state, stream, policy: StartPolicy, objects, first_chunk):
    """Streams a Mode A request: the rest of the NDJSON body feeds `stream` while its output goes back as
    SSE. The client going away aborts the engine session; so does the stream's age reaching
    `max_session_seconds` (`_expire`)."""
    limits = state.config.limits
    feed = InputFeed(stream, policy, limits.max_payload_per_session)
    handle = DrainHandle(stream, feed)
    admit(state, handle)
    reader = asyncio.create_task(_read_chunks(stream, feed, objects, first_chunk))
    expiry = asyncio.create_task(_expire(handle, limits))
    try:
        # No first-event timeout: the client paces the input, so a quiet stream is not a stuck engine.
        response, complete = await sse.stream_log(request, stream.log, send_timeout_s=limits.send_timeout_s,
                                                  first_event_timeout_s=None,
                                                  on_slow_reader=state.metrics.slow_reader_counter(request))
        if not complete:
            await stream.abort("client_disconnected")
        return response
    finally:
        await asyncio.shield(end_request(state, handle, reader, expiry))


async def _expire(handle: DrainHandle, limits) -> None:
    """Stops `handle`'s stream (an `error` event `max_duration_exceeded`, the engine session aborted) once it is
    `limits.max_session_seconds` old, as a WebSocket connection is closed at that age: a Mode A client that sent
    a little audio every few minutes, under the idle timeout, held an engine session and a connection slot for
    good. The caller cancels it when the stream ends first."""
    await asyncio.sleep(limits.max_session_seconds)
    handle.stop(duration_breach(limits, "stream"))


async def _read_chunks(stream, feed: InputFeed, objects, first_chunk) -> None:
    try:
        pending = [first_chunk] if first_chunk is not None else []
        async for body in _chain(pending, objects):
            chunk = parse_chunk(body, stream.modality, ordered=False)
            # Once the drain ended the input, a client still sending is not refused (that ended the stream with an
            # error in place of the transcript the drain's notice promised): its chunks are dropped, as the
            # WebSocket protocols drop audio appended then, and the stream goes on to its done.
            if chunk["payload"] and not feed.ended:
                piece = stream.decode(chunk["payload"])
                if not feed.count(stream.measure(piece)[0]):
                    raise RequestError(413, "payload_too_large", f"The input is larger than "
                                       f"{feed.max_payload_bytes} bytes")
                await feed.add(piece)
            if chunk["end_of_input"]:
                break
        await feed.end()  # at end_of_input or at the end of the body
    except RequestError as exc:  # the client going away mid-body among them; the SSE side notices it too
        stream.fail(exc.code, str(exc))
    except Exception as exc:  # noqa: BLE001 - the stream must end, with the failure logged
        logger.exception("reading a streaming-input body failed")
        stream.fail("server_error", f"Internal error while reading the input: {type(exc).__name__}")


async def _chain(first: list, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item
