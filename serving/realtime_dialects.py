"""Which dialect a `/v1/realtime` connection speaks (specs/realtime_protocols.md §4.2): OpenAI's
transcription dialect (openai_realtime.py) or vLLM's protocol (vllm_realtime.py).

OpenAI's when the handshake has `?intent=transcription`, a `model=` query or the WebSocket subprotocol
`realtime` (GA shape), or an `OpenAI-Beta: realtime=v1` header or the subprotocol `openai-beta.realtime-v1`
(beta shape; browsers send the header's value as a subprotocol); else vLLM's, unless the first client event
has the OpenAI shape (`DialectSwitch`; its GA or beta shape picks the dialect's). The server selects the first
of SUBPROTOCOLS the client offers (VLLM_SUBPROTOCOL for vLLM's), as a browser's WebSocket requires when it
offered any; the API key a browser offers as `openai-insecure-api-key.<key>` is serving.auth's.
"""
import json

from jaxstream.serving.auth import offered_subprotocols
from jaxstream.serving.openai_realtime import OpenAiRealtime

REALTIME, BETA_SUBPROTOCOL = "realtime", "openai-beta.realtime-v1"
SUBPROTOCOLS = (REALTIME, BETA_SUBPROTOCOL)  # the ones the server may select in the handshake
# vLLM's protocol names no subprotocol; a browser that offers its API key as `openai-insecure-api-key.<key>` (the
# demo page) fails a handshake that selects none, so it offers this one too, and the server selects it.
VLLM_SUBPROTOCOL = "vllm-realtime"


def handshake_dialect(request) -> str | None:
    """"openai" or "beta" when the handshake asks for OpenAI's dialect (spec §4.2), else None."""
    offered = offered_subprotocols(request)
    if request.headers.get("OpenAI-Beta", "").strip().startswith("realtime") or BETA_SUBPROTOCOL in offered:
        return "beta"
    if request.query.get("intent") == "transcription" or "model" in request.query or REALTIME in offered:
        return "openai"
    return None


def frame_dialect(frame: str) -> str | None:
    """"beta" when a first client event is OpenAI's `transcription_session.update`, "openai" when it is a
    `session.update` carrying a `session` object (vLLM's has a flat `model`), else None (spec §4.2)."""
    try:
        event = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return None
    if event.get("type") == "transcription_session.update":
        return "beta"
    if event.get("type") == "session.update" and isinstance(event.get("session"), dict):
        return "openai"
    return None


class DialectSwitch:
    """`/v1/realtime` without an OpenAI handshake: vLLM's protocol, unless the first client event has the
    OpenAI shape; then the connection switches to OpenAiRealtime (its `session.created` follows vLLM's,
    which went out at connect) and that event is answered in the OpenAI dialect, in the event's shape (GA
    or beta) from `session.created` on. The websocket runner sees this object as the protocol; it forwards
    to whichever dialect is active."""

    def __init__(self, conn, server, make_vllm):
        self.conn = conn
        self.server = server
        self.active = make_vllm(_FirstFrameTap(conn))

    async def run(self) -> None:
        try:
            await self.active.run()
        except _Switch as switch:
            await self.active.release()  # nothing runs yet: this was the connection's first event
            self.active = OpenAiRealtime(self.conn, self.server, beta=switch.dialect == "beta")
            await self.active.run(first_frame=switch.frame)

    def busy(self) -> bool:
        return self.active.busy()

    async def finish_for_drain(self) -> None:
        await self.active.finish_for_drain()

    async def release(self) -> None:
        await self.active.release()

    def error_event(self, code: str, message: str) -> dict:
        return self.active.error_event(code, message)


class _Switch(Exception):
    def __init__(self, frame: str, dialect: str):
        super().__init__("the client speaks the OpenAI dialect")
        self.frame = frame
        self.dialect = dialect  # "openai" or "beta", as `frame_dialect`


class _FirstFrameTap:
    """The connection as the vLLM protocol sees it: everything is the connection's (attributes are read
    and written through), except that an OpenAI-shaped first frame raises _Switch out of its `run`."""

    def __init__(self, conn):
        object.__setattr__(self, "_conn", conn)

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def __setattr__(self, name, value):
        setattr(self._conn, name, value)

    async def frames(self):
        frames = self._conn.frames()
        try:
            first = True
            async for kind, data in frames:
                dialect = frame_dialect(data) if first and kind == "text" else None
                if dialect is not None:
                    raise _Switch(data, dialect)
                first = False
                yield kind, data
        finally:
            await frames.aclose()
