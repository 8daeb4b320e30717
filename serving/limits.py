"""Resource limits of WebSocket connections, shared by every protocol: what they are, and how a
connection that breaks one is closed (the `/ws` close codes of specs/realtime_protocols.md §5.5 on every
route).

Memory per connection is bounded whatever the client does: a frame is at most `max_message_bytes`; audio
outside an utterance at most `max_pending_seconds`; audio inside one is handed to the engine, whose
`append` waits while too much is queued (and while it waits the connection reads nothing more, so TCP
pushes back on the client); events to the client are sent one at a time and awaited, so a client that
stops reading stalls its own connection, never the server's memory, until `send_timeout_s` drops it (an
HTTP stream's SSE answer alike: sse.py).
Time on the event loop is bounded the same way for a client that sends nothing but bad events: past
`max_errors_per_minute` errors its connection closes. An HTTP body read before its request is admitted
must keep arriving at a minimum rate (`read_at_min_rate`); an admitted HTTP stream (a Mode A request, a Mode B
session) lasts at most `max_session_seconds`, as a WebSocket connection.
"""
import asyncio
import collections
import dataclasses
import hashlib
import math
import time

from jaxstream.models.audio import SAMPLING_RATE

# Close codes. RFC 6455 ones, then the /ws protocol's application codes.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server draining / shutting down
CLOSE_UNSUPPORTED_DATA = 1003  # binary frame on /v1/realtime with --compat vllm
CLOSE_POLICY_VIOLATION = 1008  # the client stopped reading, or provoked too many errors
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # the engine is still compiling
CLOSE_IDLE = 4000
CLOSE_UNAUTHORIZED = 4001  # /ws: bad or missing API key (sent after the upgrade)
CLOSE_CAPACITY = 4002
CLOSE_MAX_DURATION = 4003


@dataclasses.dataclass(frozen=True)
class Limits:
    # Open WebSocket connections and HTTP streams (requests that run an engine session, Mode B sessions);
    # None: twice the engine's max_sessions (a connection between utterances holds no engine session, so
    # the engine's own cap is the binding one while all are busy).
    max_connections: int | None = None
    idle_timeout_s: float = 150.0  # no message from the client for this long: close 4000 (an HTTP body: 408)
    # Connection age: close 4003 (90 min, as the /ws guide); an HTTP stream (Mode A request, Mode B session) ends
    # with an `error` event max_duration_exceeded at the same age.
    max_session_seconds: float = 5400.0
    max_audio_seconds: float = 7200.0  # audio one connection may send in all
    max_pending_seconds: float = 30.0  # audio held while no utterance runs (before a commit)
    max_append_seconds: float = 60.0  # audio in one append event
    max_message_bytes: int = 4 << 20  # larger frames close the socket with 1009 (aiohttp)
    send_timeout_s: float = 30.0  # one event not taken within this: dropped (`slow_reader`; WebSocket and SSE)
    # A new connection's first request must be in (its headers complete) within this, or the connection is
    # closed (FirstRequestDeadline). aiohttp itself waits for it forever.
    first_request_timeout_s: float = 60.0
    # Errors one WebSocket connection may provoke in any 60 s; one more closes it with 1008. A client stuck in
    # a loop of bad events otherwise has every one answered, for as long as it goes on (one flood: ~20,000
    # error events a second for 50 s). None: no limit.
    max_errors_per_minute: int | None = 600
    heartbeat_s: float | None = 30.0  # protocol pings to notice dead peers; None: only answer pings
    # HTTP streaming input (specs/realtime_protocols.md §7): payload one Mode A request or Mode B session
    # may send (the RFC's max_payload_per_session; 256 MiB of PCM16 is about 2 h 20 min at 16 kHz).
    max_payload_per_session: int = 256 << 20
    # Per key, over every route (KeyLimits); None: no limit.
    # Open WebSockets + Mode B sessions + HTTP requests that run the model (Mode A, and an upload, completion or chat
    # from its arrival: waiting in the queue counts), so a key never holds more than N of the server's places.
    max_streams_per_key: int | None = None
    max_requests_per_minute_per_key: int | None = None  # HTTP requests and WebSocket handshakes
    # A request body the server reads before it admits the request (an upload's form, a Mode A request's first
    # line, a JSON body: a completion, a Mode B session's creation or chunk) must keep arriving: after
    # body_grace_s, at body_min_rate bytes/s on average, else 408 and the connection closes (`read_at_min_rate`;
    # Apache's mod_reqtimeout `body=20,MinRate=500`). A Mode A first line is timed from its first byte: a
    # client may open its request long before it has audio to send. None or 0 (TOML has no null): no rule.
    body_grace_s: float = 20.0
    body_min_rate: int | None = 500
    # A one-shot HTTP request (an upload, a completion, a chat) that finds the server full (its max_connections,
    # or for an upload the engine at its max_sessions) waits its turn this long in all, first come first served, as vLLM
    # queues requests beyond max_num_seqs, then 429 / 503 `capacity`: a client sending a batch at once is slowed down,
    # not refused. 0: refused at once. A realtime stream or streaming-input request cannot wait: refused at once.
    request_queue_s: float = 60.0

    def __post_init__(self):
        if self.body_min_rate == 0 and not isinstance(self.body_min_rate, bool):
            object.__setattr__(self, "body_min_rate", None)  # one spelling of "no rule" (frozen dataclass)
        queue_s = self.request_queue_s  # the one limit where 0 means something (no wait) and None nothing
        if isinstance(queue_s, bool) or not isinstance(queue_s, (int, float)) or not 0 <= queue_s < math.inf:
            raise ValueError(f"limit request_queue_s must be a number of seconds, 0 or more, got {queue_s!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "request_queue_s":
                continue
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"limit {field.name} must be positive, got {value!r}")
            # A count from a TOML file may be a float; rate windows and caps count whole events.
            if value is not None and field.type in (int, int | None) and not isinstance(value, int):
                raise ValueError(f"limit {field.name} must be a whole number, got {value!r}")
        # PCM16 is 2 bytes a sample; base64 writes 4 characters for every 3 bytes.
        if self.max_append_seconds * SAMPLING_RATE * 2 * 4 / 3 > self.max_message_bytes:
            raise ValueError("max_message_bytes must hold the base64 of max_append_seconds of audio")


@dataclasses.dataclass(frozen=True)
class Breach:
    """Why a connection is being closed by the server: log outcome, close code, and the `error` event sent
    first (code, message)."""

    outcome: str
    close_code: int
    error_code: str | None = None
    message: str = ""


def errors_breach(limits: Limits) -> Breach:
    return Breach("too_many_errors", CLOSE_POLICY_VIOLATION, "too_many_errors",
                  f"More than {limits.max_errors_per_minute} errors in 60 s: closing the connection")


def idle_breach(limits: Limits) -> Breach:
    return Breach("idle_timeout", CLOSE_IDLE, "idle_timeout",
                  f"No message for {limits.idle_timeout_s:g} s: closing the idle connection")


def drain_notice(received: float, modality: str = "audio") -> str:
    """The message of the `server_draining` error a draining server sends, on every protocol, when it ended a
    stream's input itself (app.drain: `finish_for_drain`): sent before the output's end (its done), so that a
    client reading to the done knows the output stops at the input received (`received`: seconds of audio, or
    bytes of text)."""
    if modality == "audio":
        amount, output = f"{received:.2f} s of audio", "transcript"
    else:
        amount, output = f"{received:g} bytes of text", "completion"
    return (f"The server is shutting down: it ended the input early, and the {output} covers only the first "
            f"{amount} received")


def drain_truncation(notice: str, received: float, modality: str = "audio") -> dict:
    """The fields a done carries when the drain ended its input (`notice`: the `server_draining` message sent
    before it; `received`: seconds of audio, or bytes of text), for a client that reads the done alone (jaxstream
    extensions; a done whose input the client ended has neither field)."""
    amount = {"audio_seconds": received} if modality == "audio" else {"text_bytes": received}
    return {"truncated": True, "truncation": {"code": "server_draining", "message": notice, **amount}}


def duration_breach(limits: Limits, what: str = "connection") -> Breach:
    """The end of a WebSocket connection, or of an HTTP stream (`what`), at `max_session_seconds` of age."""
    return Breach("max_duration", CLOSE_MAX_DURATION, "max_duration_exceeded",
                  f"The {what} reached the maximum duration of {limits.max_session_seconds:g} s")


class Clock:
    """A connection's start and latest client activity (any received data frame; protocol pings do not
    count, as in the /ws protocol)."""

    def __init__(self):
        self.started = self.last_activity = time.monotonic()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def age(self) -> float:
        return time.monotonic() - self.started


async def watch_deadlines(clock: Clock, limits: Limits) -> Breach:
    """Returns once the connection is idle too long or too old."""
    while True:
        now = time.monotonic()
        idle_at = clock.last_activity + limits.idle_timeout_s
        expires_at = clock.started + limits.max_session_seconds
        if now >= expires_at:
            return duration_breach(limits)
        if now >= idle_at:
            return idle_breach(limits)
        # Sleep to the earlier deadline; activity in the meantime moves idle_at, so check again then.
        await asyncio.sleep(min(idle_at, expires_at) - now + 0.01)


class RollingWindowLimiter:
    """At most `limit` events in any `window_s` seconds: a true rolling window (the times of the last
    `limit` accepted events), so a burst at a fixed window's edge cannot pass twice the limit. Refused
    events are not counted: a client that keeps sending past the limit gets through again as soon as
    its older events leave the window."""

    def __init__(self, limit: int, window_s: float):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1 or not window_s > 0:
            raise ValueError(f"a rate limit needs a positive count and window, got {limit!r} per {window_s!r} s")
        self.limit = limit
        self.window_s = window_s
        self._accepted = collections.deque(maxlen=limit)  # monotonic times, oldest first

    def allow(self) -> bool:
        """Counts one event now and returns True, or returns False (not counted) when it would exceed the limit."""
        now = time.monotonic()
        if len(self._accepted) == self.limit and now - self._accepted[0] < self.window_s:
            return False
        self._accepted.append(now)  # a full deque drops its oldest time, which has left the window
        return True

    def retry_after(self) -> float:
        """Seconds until `allow` can succeed again (0 when it can now)."""
        if len(self._accepted) < self.limit:
            return 0.0
        return max(0.0, self._accepted[0] + self.window_s - time.monotonic())


_RECANCEL_S = 0.1  # read_at_min_rate cancels a read that goes on again after this long
_FIRST_BYTE_POLL_S = 1.0  # read_at_min_rate(from_first_byte=True) looks for the body's first byte this often


class SlowBody(Exception):
    """A request body that fell behind the minimum rate of `read_at_min_rate`."""


async def read_at_min_rate(read, limits: Limits, received, *, from_first_byte: bool = False):
    """Awaits `read`, a coroutine that reads a request body, under mod_reqtimeout's body rule: the body must be
    complete `limits.body_grace_s` after the call plus one second for every `body_min_rate` bytes received
    (`received()`, the body's bytes so far, is read again whenever the deadline comes). Raises SlowBody, the
    read cancelled, once the body falls behind.

    With `from_first_byte` the clock starts once `received()` is above 0 (seen within `_FIRST_BYTE_POLL_S`,
    slack in the client's favour), not at the call: a Mode A request whose parameters line is left out opens
    with its first audio, which a push-to-talk or VAD-gated client sends only once someone speaks. Its silence
    before that is the idle timeout's to bound (the read's own, `http_errors.body_read`), as before the rule.

    The idle timeout alone is per read: a client that sent a byte every 149 s held its connection forever, and
    before admission nothing counts such a request against the server's limits. The defaults cut no real link:
    500 B/s is 4 kbit/s, and an OpenAI-sized upload (25 MB) over 1 Mbit/s arrives at 125,000 B/s; a client
    sending at the minimum rate holds its connection for as long as its body takes (a 26 MB form: ~14 h)."""
    rate = limits.body_min_rate
    if rate is None:
        return await read
    started = time.monotonic()
    task = asyncio.ensure_future(read)
    try:
        if from_first_byte:
            # Polled: the body's reader is the caller's coroutine, with no hook for its first byte.
            poll = min(_FIRST_BYTE_POLL_S, limits.body_grace_s)
            while not task.done() and received() == 0:
                await asyncio.wait([task], timeout=poll)
            started = time.monotonic()
        while not task.done():
            due = started + limits.body_grace_s + received() / rate
            if time.monotonic() >= due:
                raise SlowBody(f"The request body arrived slower than {rate} bytes/s after its first "
                               f"{limits.body_grace_s:g} s")
            await asyncio.wait([task], timeout=due - time.monotonic())
        return task.result()
    finally:
        # The body fell behind, or the caller was cancelled: the read ends. A read may swallow a cancel (Python
        # 3.11's wait_for, which body_read once used, drops one that comes as its inner read completes) and go on:
        # cancel it again.
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=_RECANCEL_S)
        if not task.cancelled():
            task.exception()  # retrieved (asyncio logs an exception nobody retrieved); the caller has its answer


# -- per-key limits, shared by the WebSocket and HTTP routes ---------------------------------------------------
class KeyLimits:
    """At most `max_streams_per_key` open streams (WebSocket connections, Mode B sessions, and HTTP requests that
    run the model: a Mode A request, and an upload, completion or chat from its arrival to its answer, its wait in
    the server's queue included, so that a key never holds more than N of the server's places, waiting or running)
    and `max_requests_per_minute_per_key` requests (HTTP calls and WebSocket handshakes) per client key: the API
    key presented when it is one of the server's keys, else the client's address (a key the server does not accept
    would let a client pick a fresh identity per request: routes that check the key after the upgrade, /ws and
    Kyutai's, see wrong ones too). Limit or not, a key cannot hold the others up in the server's queue: its turns
    alternate with theirs, and at a full queue it gives its newest place up to another key's newcomer
    (request_queue.py)."""

    _SWEEP_AT = 4096  # rate windows kept before the idle ones are dropped

    def __init__(self, limits: Limits, api_keys: tuple[str, ...]):
        self.max_streams = limits.max_streams_per_key
        self.max_requests = limits.max_requests_per_minute_per_key
        self.api_keys = api_keys
        self._streams: collections.Counter = collections.Counter()
        self._rates: dict[str, tuple[RollingWindowLimiter, float]] = {}  # key -> (window, last request time)

    def key_of(self, request) -> str:
        from jaxstream.serving.auth import CLIENT_SECRET, is_authorized, presented_key

        if self.api_keys and is_authorized(request, self.api_keys):
            # A digest, so the accounting never holds the secret itself.
            return "key:" + hashlib.sha256(presented_key(request).encode()).hexdigest()[:24]
        secret = request.get(CLIENT_SECRET)  # set by the auth middleware: it counts as its minting key
        if secret is not None:
            return secret.owner
        return f"addr:{request.remote}"

    def request_wait(self, key: str) -> float | None:
        """Counts one request of `key`: None when it is allowed, else the seconds before one would be."""
        if self.max_requests is None:
            return None
        now = time.monotonic()
        if len(self._rates) >= self._SWEEP_AT:
            self._rates = {k: v for k, v in self._rates.items() if now - v[1] < 60.0}
        window = self._rates[key][0] if key in self._rates else RollingWindowLimiter(self.max_requests, 60.0)
        self._rates[key] = (window, now)
        return None if window.allow() else max(1.0, window.retry_after())

    def open_stream(self, key: str) -> bool:
        """Counts one more open stream of `key`; False (not counted) at its limit."""
        if self.max_streams is not None and self._streams[key] >= self.max_streams:
            return False
        self._streams[key] += 1
        return True

    def close_stream(self, key: str) -> None:
        self._streams[key] -= 1
        if self._streams[key] <= 0:
            del self._streams[key]


def holds_stream(handler):
    """Marks an HTTP route handler whose request counts as an open stream of its key while it runs (from before it
    reads its body, so a request waiting in the server's queue counts too)."""
    handler.holds_key_stream = True
    return handler


def too_many_requests(message: str, retry_after: float):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "rate_limit_error", "param": None,
                                        "code": "rate_limit_exceeded"}},
                             status=429, headers={"Retry-After": str(math.ceil(retry_after))})


def key_limits_middleware(key_limits: KeyLimits, open_paths):
    """Applies `key_limits` to every request but those to `open_paths`: 429 with Retry-After over the
    request rate; WebSocket handshakes and `holds_stream` handlers also hold one of the key's streams
    while they run (429 before any upgrade when the key has none left)."""
    from aiohttp import web

    @web.middleware
    async def limit_per_key(request, handler):
        if request.path in open_paths:
            return await handler(request)
        key = key_limits.key_of(request)
        wait = key_limits.request_wait(key)
        if wait is not None:
            return too_many_requests(f"More than {key_limits.max_requests} requests in a minute; retry "
                                     f"in {math.ceil(wait)} s", wait)
        stream = (request.headers.get("Upgrade", "").lower() == "websocket"
                  or getattr(request.match_info.handler, "holds_key_stream", False))
        if not stream:
            return await handler(request)
        if not key_limits.open_stream(key):
            return too_many_requests(f"This key already has {key_limits.max_streams} open streams; close one "
                                     "or retry later", 1.0)
        try:
            return await handler(request)
        finally:
            key_limits.close_stream(key)

    return limit_per_key


class FirstRequestDeadline:
    """Closes a connection whose first request has not arrived `timeout_s` after it opened. aiohttp waits for a
    new connection's first request forever, so connections that trickle header bytes or send nothing each held
    a socket for good (300 sending a byte every 5 s were all open after 95 s): enough of them and the server
    runs out of file descriptors and accepts no one. After a first request aiohttp's keep-alive timeout takes
    over. `middleware` marks the connections that made a request; `watch(server)` closes the others when due."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._requested: set = set()  # aiohttp protocols (one per connection) that made a request
        self._seen: dict = {}  # the others -> when a sweep first saw them

    def middleware(self):
        from aiohttp import web

        @web.middleware
        async def mark(request, handler):
            self._requested.add(request.protocol)
            return await handler(request)

        return mark

    async def watch(self, server) -> None:
        """Sweeps the connections of `server` (aiohttp's `web.Server`) until cancelled."""
        while True:
            await asyncio.sleep(min(5.0, self.timeout_s / 4))
            self.sweep(server.connections, time.monotonic())

    def sweep(self, connections, now: float) -> None:
        """Closes those of `connections` without a request that a sweep `timeout_s` ago already saw (so a
        connection lasts `timeout_s` to `timeout_s` + one period); forgets the closed ones."""
        alive = set(connections)
        self._requested &= alive
        self._seen = {protocol: seen for protocol, seen in self._seen.items() if protocol in alive}
        for protocol in alive - self._requested:
            if now - self._seen.setdefault(protocol, now) >= self.timeout_s:
                protocol.force_close()
