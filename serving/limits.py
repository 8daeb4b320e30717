"""Resource limits of WebSocket connections, shared by every protocol: what they are, and how a
connection that breaks one is closed (the `/ws` close codes of specs/realtime_protocols.md §5.5 on every
route).

Memory per connection is bounded whatever the client does: a frame is at most `max_message_bytes`; audio
outside an utterance at most `max_pending_seconds`; audio inside one is handed to the engine, whose
`append` waits while too much is queued (and while it waits the connection reads nothing more, so TCP
pushes back on the client); events to the client are sent one at a time and awaited, so a client that
stops reading stalls its own connection, never the server's memory, until `send_timeout_s` closes it.
"""
import asyncio
import dataclasses
import time

from jaxstream.models.audio import SAMPLING_RATE

# Close codes. RFC 6455 ones, then the /ws protocol's application codes.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server draining / shutting down
CLOSE_UNSUPPORTED_DATA = 1003  # binary frame on /v1/realtime with --compat vllm
CLOSE_POLICY_VIOLATION = 1008  # the client stopped reading
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013  # the engine is still compiling
CLOSE_IDLE = 4000
CLOSE_CAPACITY = 4002
CLOSE_MAX_DURATION = 4003


@dataclasses.dataclass(frozen=True)
class Limits:
    # Open WebSocket connections; None: twice the engine's max_sessions (a connection between utterances
    # holds no engine session, so the engine's own cap is the binding one while all are busy).
    max_connections: int | None = None
    idle_timeout_s: float = 150.0  # no message from the client for this long: close 4000
    max_session_seconds: float = 5400.0  # connection age: close 4003 (90 min, as the /ws guide)
    max_audio_seconds: float = 7200.0  # audio one connection may send in all
    max_pending_seconds: float = 30.0  # audio held while no utterance runs (before a commit)
    max_append_seconds: float = 60.0  # audio in one append event
    max_message_bytes: int = 4 << 20  # larger frames close the socket with 1009 (aiohttp)
    send_timeout_s: float = 30.0  # one event not taken by the client within this: close 1008
    heartbeat_s: float | None = 30.0  # protocol pings to notice dead peers; None: only answer pings

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"limit {field.name} must be positive, got {value!r}")
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


def idle_breach(limits: Limits) -> Breach:
    return Breach("idle_timeout", CLOSE_IDLE, "idle_timeout",
                  f"No message for {limits.idle_timeout_s:g} s: closing the idle connection")


def duration_breach(limits: Limits) -> Breach:
    return Breach("max_duration", CLOSE_MAX_DURATION, "max_duration_exceeded",
                  f"The connection reached the maximum duration of {limits.max_session_seconds:g} s")


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
