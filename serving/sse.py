"""Server-sent events, shared by every streaming HTTP response (specs/realtime_protocols.md §8).

A producer (an engine session's pump) appends JSON events to an `EventLog`; `stream_log` writes them to one
client as `id: n` + `data: {...}` frames and ends with `data: [DONE]`. The log, not the response, owns the
events, so a Mode B client that drops its stream can come back with `Last-Event-ID` and get the rest from
the log's bounded replay buffer.

Headers stop every layer between us and the client from buffering (`X-Accel-Buffering: no` for nginx, no
compression). While nothing is produced a `: keepalive` comment goes out, so idle proxies keep the
connection open and a client that went away is noticed. A stream that produced nothing within
`first_event_timeout_s` ends with an `error` event (the source advises clients to give up after 10-15 s;
the server does it for them and frees the engine). An `error` event's OpenAI `type` follows from its code
(`http_errors.error_type`), so that every stream types a failure as an HTTP answer and a WebSocket do. A producer
that fails ends its log with `close_with_error`: the `error` event, then `[DONE]`.

A client that stops reading fills the socket's buffers and then blocks the write of the next event: each write
waits at most `send_timeout_s` (the WebSocket routes' limit), then the connection is dropped. Otherwise TCP keeps
such a connection open as long as the client's kernel acknowledges the zero-window probes (for ever), and with it
the handler, its socket and a Mode B session's listener count, which keeps the session from being reaped.
"""
import asyncio
import collections
import logging
import typing

from aiohttp import web

from jaxstream.serving import wire_json
from jaxstream.serving.http_errors import error_type

logger = logging.getLogger(__name__)

DONE = "[DONE]"
KEEPALIVE_S = 10.0
FIRST_EVENT_TIMEOUT_S = 15.0
# aiohttp cancels a handler whose connection is lost; the transport is also polled, so a stream that only
# waits ends on a closing transport too, and a failed write ends it at once.
_DISCONNECT_POLL_S = 0.25
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive",
               "X-Accel-Buffering": "no"}


class ReplayGone(Exception):
    """The events after the client's Last-Event-ID cannot be replayed: no longer buffered, or the id is
    past every event the stream has (`code` says which)."""

    def __init__(self, message: str, code: str = "replay_unavailable"):
        super().__init__(message)
        self.code = code


class EventLog:
    """Events of one output stream, numbered from 1, the newest `capacity` kept for replay. `close()`
    appends the `[DONE]` sentinel; nothing is appended after it (a producer that learns of the end late,
    after an error ended the stream, adds nothing behind `[DONE]`)."""

    def __init__(self, capacity: int = 1024):
        self._events: collections.deque = collections.deque(maxlen=capacity)  # (id, data)
        self.last_id = 0
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, data: dict | str) -> int | None:
        """The event's id; None once the log is closed (the event is dropped)."""
        if self.closed:
            return None
        self.last_id += 1
        self._events.append((self.last_id, data))
        self._changed.set()
        return self.last_id

    def close(self) -> None:
        if not self.closed:
            self.append(DONE)
            self.closed = True

    def after(self, last_id: int) -> list[tuple[int, dict | str]]:
        """Events with an id above `last_id`; ReplayGone when some of them already left the buffer, or when
        `last_id` is one the stream never had (waiting for it would skip the events before it)."""
        if last_id > self.last_id:
            raise ReplayGone(f"Last-Event-ID {last_id} is past this stream's last event ({self.last_id})",
                             "invalid_last_event_id")
        oldest = self._events[0][0] if self._events else self.last_id + 1
        if last_id + 1 < oldest:
            raise ReplayGone(f"events {last_id + 1}..{oldest - 1} are no longer buffered")
        return [(i, data) for i, data in self._events if i > last_id]

    async def wait(self, last_id: int, timeout: float) -> None:
        """Returns once an event above `last_id` exists, or after `timeout` seconds."""
        while self.last_id <= last_id:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                return


def frame(event_id: int | None, data: dict | str) -> bytes:
    text = data if isinstance(data, str) else wire_json.dumps(data)
    head = f"id: {event_id}\n" if event_id is not None else ""
    # A JSON dump has no newline; a text sentinel might, and every line of it needs its own `data:`.
    body = "".join(f"data: {line}\n" for line in text.split("\n"))
    return f"{head}{body}\n".encode()


async def _end_with_error(writer: "_Writer", after: int, error: dict) -> None:
    """An error event and `[DONE]` outside the log. They repeat the last delivered id, so a client that
    reconnects with it still gets every logged event once."""
    await writer.write(frame(after, error))
    await writer.write(frame(after, DONE))


def error_payload(message: str, code: str) -> dict:
    """An `error` event, typed by its code: every stream (audio and text, Mode A and B) types a code alike."""
    return {"type": "error", "error": {"message": message, "type": error_type(code), "code": code}}


def close_with_error(log: EventLog | None, code: str, message: str, metrics) -> None:
    """The end of a stream that failed: counts the error (`metrics`: the server's ServerMetrics) and, when the
    stream has a log, ends it with the `error` event and `[DONE]`. A log already closed has had its end (an
    error counted then, or its client gone): nothing more is sent or counted, so the engine's refusal of a
    session that `EngineInput.fail` aborted is not a second error."""
    if log is not None and log.closed:
        return
    metrics.errors.labels(code=code).inc()
    if log is not None:
        log.append(error_payload(message, code))
        log.close()


def log_error(log: EventLog, code: str, message: str, metrics) -> None:
    """An `error` event that does not end the stream (a drain's notice: the output's end follows it), counted as
    every error event sent."""
    if not log.closed:
        metrics.errors.labels(code=code).inc()
        log.append(error_payload(message, code))


def last_event_id(request: web.Request) -> int:
    """The client's `Last-Event-ID` (0 when absent); ValueError when it is not a number."""
    raw = request.headers.get("Last-Event-ID", "").strip() or request.query.get("last_event_id", "")
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"Last-Event-ID must be a non-negative integer, got {raw[:32]!r}")
    return int(raw)


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def stream_log(request: web.Request, log: EventLog, *, send_timeout_s: float, after: int = 0,
                     keepalive_s: float = KEEPALIVE_S, first_event_timeout_s: float | None = FIRST_EVENT_TIMEOUT_S,
                     progress: typing.Callable[[], int] | None = None,
                     on_slow_reader: typing.Callable[[], None] = lambda: None) -> tuple[web.StreamResponse, bool]:
    """Writes `log`'s events above `after` to the client until `[DONE]`. Returns the response (for the
    handler to return) and True when the client got the whole stream; False when it went away first, read nothing
    for `send_timeout_s` (its connection dropped), or the first-event timeout ended it (the caller then decides
    whether the producer is cancelled). A replay gap is answered with an `error` event. `progress`, when given,
    counts the producer's work (a transcription's computed audio): the first-event timeout then runs from its last
    change, so that a producer working through input that yields nothing (an upload's silent lead) is not taken
    for a stuck one. `on_slow_reader` is called when a client is dropped for reading nothing (the server's metric)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    writer = _Writer(response, send_timeout_s)
    try:
        return response, await _write_events(request, writer, log, after, keepalive_s, first_event_timeout_s,
                                             progress or (lambda: 0))
    except TimeoutError:
        logger.info("SSE %s: the client read nothing for %g s, dropping its connection (slow_reader)", request.path,
                    send_timeout_s)
        on_slow_reader()
        if request.transport is not None:
            request.transport.abort()  # `close` would wait to flush what the client does not read
        return response, False


class _Writer:
    """The response's writes, each bounded by `send_timeout_s` (TimeoutError past it)."""

    def __init__(self, response: web.StreamResponse, send_timeout_s: float):
        self.response = response
        self.send_timeout_s = send_timeout_s

    async def write(self, data: bytes) -> None:
        async with asyncio.timeout(self.send_timeout_s):
            await self.response.write(data)

    async def write_eof(self) -> None:
        async with asyncio.timeout(self.send_timeout_s):
            await self.response.write_eof()


async def _write_events(request, writer: "_Writer", log, after, keepalive_s, first_event_timeout_s, progress) -> bool:
    loop = asyncio.get_running_loop()
    started = last_write = loop.time()
    sent_any, worked = False, progress()
    try:
        while True:
            try:
                pending = log.after(after)
            except ReplayGone as exc:
                await _end_with_error(writer, min(after, log.last_id), error_payload(str(exc), exc.code))
                return False
            for event_id, data in pending:
                await writer.write(frame(event_id, data))
                after, sent_any, last_write = event_id, True, loop.time()
                if data == DONE:
                    await writer.write_eof()
                    return True
            if log.closed and after == log.last_id:  # resumed after the end: it ends as every stream does
                await writer.write(frame(after, DONE))
                await writer.write_eof()
                return True
            now = loop.time()
            if (done := progress()) != worked:
                started, worked = now, done
            if not sent_any and first_event_timeout_s is not None and now - started >= first_event_timeout_s:
                logger.info("SSE %s: nothing produced in %.0f s, ending the stream", request.path,
                            first_event_timeout_s)
                await _end_with_error(writer, after, error_payload(
                    f"No output within {first_event_timeout_s:g} s", "first_token_timeout"))
                return False
            if client_gone(request):
                return False
            if now - last_write >= keepalive_s:
                await writer.write(b": keepalive\n\n")
                last_write = now
            wait = min(_DISCONNECT_POLL_S, keepalive_s - (now - last_write))
            if not sent_any and first_event_timeout_s is not None:
                wait = min(wait, started + first_event_timeout_s - now)
            await log.wait(after, max(0.0, wait))
    except ConnectionError:
        logger.info("SSE %s: client went away", request.path)
        return False
