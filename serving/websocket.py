"""One WebSocket connection's lifecycle, shared by every WebSocket protocol of the server.

`run_websocket` accepts the socket, asks the server whether it may stay (draining, loading, connection
cap), runs the protocol until the client leaves or a limit is hit, then releases the protocol's engine
sessions, sends the reason to the client and closes, and writes one structured log line. A protocol is an
object with:

    async run()               read frames (`Connection.frames`) and answer them until the client leaves
    busy() -> bool            an utterance is running or queued (draining waits for it)
    async finish_for_drain()  end the running utterance now, as if the client had sent its final commit
    async release()           abort every engine session it still holds (idempotent; always called)
    error_event(code, msg)    the protocol's `error` event, sent before a server-side close (a dict sent as
                              JSON text, or bytes sent as one binary frame)

Sends are awaited one at a time (no unbounded outgoing queue): a client that stops reading stalls its own
connection until `send_timeout_s`, then it is dropped (outcome `slow_reader`: the 1008 close frame would queue
behind what the client did not read, so the connection ends without one, and the log's close code is 1006).
Each frame read takes a loop turn of its own, so a client flooding frames shares the loop with the others
instead of holding it, and a connection that provokes more than `max_errors_per_minute` errors is closed with
1008.
"""
import asyncio
import logging
import uuid

from aiohttp import WSMsgType, web

from jaxstream.serving import wire_json
from jaxstream.serving.limits import (
    CLOSE_INTERNAL_ERROR, CLOSE_NORMAL, CLOSE_POLICY_VIOLATION, Breach, Clock, RollingWindowLimiter, errors_breach,
    watch_deadlines,
)

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 5.0  # a server-side close waits this long for the error event and the closing handshake


class ConnectionClosed(Exception):
    """The connection is closing: nothing more can be sent on it."""


class Connection:
    """The transport side of one accepted WebSocket: frames in, JSON events out, limits, accounting."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request, route: str, server):
        self.id = f"ws-{uuid.uuid4().hex[:16]}"
        self.ws = ws
        self.route = route
        self.peer = request.remote
        self.server = server
        self.limits = server.config.limits
        self.clock = Clock()
        self.audio_seconds = 0.0
        self.utterances = 0
        self.errors = 0
        cap = self.limits.max_errors_per_minute
        self._error_budget = RollingWindowLimiter(cap, 60.0) if cap is not None else None
        self.breach: Breach | None = None  # why the connection ends (first reason wins)
        self.protocol = None
        self._stopped = asyncio.Event()
        self._send_lock = asyncio.Lock()

    def stop(self, breach: Breach) -> None:
        """Ends the connection for `breach` (the first reason given wins); the runner closes it."""
        if self.breach is None:
            self.breach = breach
        self._stopped.set()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    async def send(self, event: dict | bytes) -> None:
        """Sends one JSON event, or one binary frame already encoded (msgpack protocols); raises
        ConnectionClosed once the connection is ending."""
        if self._stopped.is_set():
            raise ConnectionClosed
        try:
            async with self._send_lock:
                async with asyncio.timeout(self.limits.send_timeout_s):
                    await _send_event(self.ws, event)
        except TimeoutError:
            self.stop(Breach("slow_reader", CLOSE_POLICY_VIOLATION, None,
                             f"client did not read for {self.limits.send_timeout_s:g} s"))
            raise ConnectionClosed from None
        except ConnectionError:  # the peer is gone (aiohttp raises ClientConnectionResetError)
            self.stop(Breach("client_disconnected", CLOSE_NORMAL))
            raise ConnectionClosed from None

    def count_error(self, code: str, *, budget: bool = True) -> None:
        """Counts an error answered to the client; past the error budget (errors that count against it)
        the connection ends."""
        self.errors += 1
        self.server.metrics.errors.labels(code=code).inc()
        if budget and self._error_budget is not None and not self._error_budget.allow():
            self.stop(errors_breach(self.limits))

    async def frames(self):
        """Yields ("text", str) or ("binary", bytes) per data frame. Returns when the client closes or the
        socket fails; protocol pings are answered inside `receive` (aiohttp autoping)."""
        while not self._stopped.is_set():
            # A loop turn per frame: `receive` returns at once while frames are buffered, so a client sending
            # frames as fast as it can (valid ones too) kept the loop to itself and every other stream waited
            # (16 paced streams behind one such client: first-delta p99 3.3 s instead of 0.7).
            await asyncio.sleep(0)
            message = await self.ws.receive()
            if message.type is WSMsgType.TEXT:
                self.clock.touch()
                yield "text", message.data
            elif message.type is WSMsgType.BINARY:
                self.clock.touch()
                yield "binary", message.data
            else:
                code = self.ws.close_code
                if message.type is WSMsgType.ERROR:
                    # aiohttp's WebSocketError carries the code it closed with; close_code reads 1006 when the
                    # close handshake then failed on the rest of the frame (an oversized one: 1009).
                    code = getattr(message.data, "code", None) or code
                    outcome = "message_too_big" if code == 1009 else "client_disconnected"
                    logger.debug("%s: socket error %s", self.id, message.data)
                elif message.type is WSMsgType.CLOSE:  # the client's close frame
                    outcome = "client_closed"
                else:  # CLOSED: the TCP connection ended without a close frame
                    outcome = "client_disconnected"
                self.stop(Breach(outcome, code or CLOSE_NORMAL))
                return


async def run_websocket(request: web.Request, server, route: str, make_protocol, *,
                        subprotocols: tuple[str, ...] = ()) -> web.WebSocketResponse:
    """Serves one WebSocket of `server` (app.ServerState) with the protocol `make_protocol(connection)`;
    the handshake selects the first of the client's subprotocols that is in `subprotocols`."""
    limits = server.config.limits
    # No permessage-deflate: base64 PCM barely compresses, and zlib on every 80 ms frame of every stream
    # cost more CPU than the JSON around it.
    ws = web.WebSocketResponse(max_msg_size=limits.max_message_bytes, heartbeat=limits.heartbeat_s,
                               autoping=True, compress=False, protocols=subprotocols)
    await ws.prepare(request)
    conn = Connection(ws, request, route, server)
    conn.protocol = make_protocol(conn)
    metrics = server.metrics
    metrics.connections_opened.labels(route=route).inc()
    metrics.connections.labels(route=route).inc()
    refusal = server.admit(conn)
    try:
        if refusal is not None:
            conn.stop(refusal)
        else:
            await _serve(conn)
    except asyncio.CancelledError:
        # With handler cancellation on (aiohttp's test server; `jaxstream serve` leaves it off, and `frames` reads the
        # lost connection as CLOSED), aiohttp cancels the handler when the TCP connection is lost: the client vanished
        # without a close frame. A shutdown's cancel finds the drain's reason already given.
        if request.transport is None or request.transport.is_closing():
            conn.stop(Breach("client_disconnected", CLOSE_NORMAL))
        raise
    finally:
        try:
            # Shielded: a cancelled handler (server shutdown) must still free its engine sessions.
            await asyncio.shield(_finish(conn))
        finally:
            server.forget(conn)
            metrics.connections.labels(route=route).dec()
            duration = conn.clock.age()
            metrics.connection_duration.labels(route=route).observe(duration)
            outcome = conn.breach.outcome if conn.breach else "closed"
            metrics.connections_closed.labels(route=route, outcome=outcome).inc()
            _log_connection(conn, duration, outcome)
    return ws


async def _serve(conn: Connection) -> None:
    main = asyncio.create_task(conn.protocol.run(), name=f"{conn.id}-protocol")
    watchdog = asyncio.create_task(watch_deadlines(conn.clock, conn.limits), name=f"{conn.id}-limits")
    stopped = asyncio.create_task(conn._stopped.wait())  # noqa: SLF001 - same module
    try:
        await asyncio.wait({main, watchdog, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if watchdog.done():
            conn.stop(watchdog.result())
        if main.done() and not main.cancelled():
            error = main.exception()
            if error is not None and not isinstance(error, ConnectionClosed):
                logger.error("%s: protocol handler failed", conn.id, exc_info=error)
                conn.stop(Breach("server_error", CLOSE_INTERNAL_ERROR, "processing_error",
                                 "Internal server error; the connection is closed"))
            conn.stop(Breach("closed", CLOSE_NORMAL))  # the protocol ended without a reason: normal close
    finally:
        for task in (main, watchdog, stopped):
            task.cancel()
        await asyncio.gather(main, watchdog, stopped, return_exceptions=True)


async def _finish(conn: Connection) -> None:
    """Frees the engine sessions, tells the client why (when the server closes), closes the socket."""
    try:
        await conn.protocol.release()
    except Exception:  # noqa: BLE001 - closing must go on; the failure is logged
        logger.exception("%s: releasing the engine sessions failed", conn.id)
    breach = conn.breach
    ws = conn.ws
    if ws.closed:
        return
    try:
        async with asyncio.timeout(_CLOSE_GRACE_S):
            if breach is not None and breach.error_code is not None:
                conn.count_error(breach.error_code)
                await _send_event(ws, conn.protocol.error_event(breach.error_code, breach.message))
            code = breach.close_code if breach is not None else CLOSE_NORMAL
            # A message may quote the client's text: a lone surrogate in it is escaped, not fatal.
            reason = (breach.message or breach.outcome).encode(errors="backslashreplace")[:123] if breach else b""
            await ws.close(code=code, message=reason)
    except (TimeoutError, ConnectionError):
        pass  # the peer does not read or is gone; aiohttp drops the transport


async def _send_event(ws, event: dict | bytes) -> None:
    if isinstance(event, bytes):
        await ws.send_bytes(event)
    else:
        await ws.send_str(wire_json.dumps(event))


def _log_connection(conn: Connection, duration: float, outcome: str) -> None:
    fields = {"id": conn.id, "route": conn.route, "peer": conn.peer, "duration_s": round(duration, 3),
              "audio_s": round(conn.audio_seconds, 3), "utterances": conn.utterances, "errors": conn.errors,
              "outcome": outcome, "close_code": conn.ws.close_code}
    logger.info("ws_connection %s", " ".join(f"{k}={v}" for k, v in fields.items()),
                extra={"connection": fields})

