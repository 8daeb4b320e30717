"""The aiohttp application of `jaxstream serve`: routes, engine start-up, health, drain.

Routes (specs/realtime_protocols.md §0):

    GET /v1/realtime                       WebSocket, vLLM realtime protocol (vllm_realtime.py), or OpenAI's
                                           transcription dialect when the client asks (realtime_dialects.py)
    GET /invocations-bidirectional-stream  WebSocket, vLLM's protocol for SageMaker (binary = UTF-8 JSON)
    GET /ws                                WebSocket, the JSON-envelope protocol (envelope.py; checks its own key)
    GET /api/asr-streaming                 WebSocket, Kyutai's STT protocol: msgpack binary frames (kyutai.py)
    GET /v1/models                         OpenAI's model list: the id session.update accepts
    GET /v1/models/{model}                 that model's entry (OpenAI's models.retrieve); 404 for another id
    POST /v1/audio/transcriptions          OpenAI's transcription upload, or Mode A streaming input
                                           (http_transcriptions.py)
    POST /v1/completions                   OpenAI's completions for a served text LM, or Mode A (http_completions.py)
    POST /v1/chat/completions              OpenAI's chat completions for a served text LM, through its chat template
                                           (http_chat.py)
    /v1/streaming_input/sessions/...       Mode B streaming-input sessions, audio or text (http_sessions.py)
    POST /tokenize, /detokenize            vLLM's: the served model's tokenizer (http_tokenize.py)
    GET /health, /healthz, /ping           {"status": ...}: 200 when ready, 503 while loading, draining or dead
                                           (no auth, so it names no model)
    GET /metrics                           Prometheus text (no auth, as vLLM)
    anything else                          404 `unknown_url` / 405 with Allow, in OpenAI's error shape; a WebSocket
                                           route asked without an upgrade: 426 (http_errors.routing_errors_middleware)
    OPTIONS (CORS preflight), any path     answered before auth, as vLLM does (cors.py)

The engine is either given (tests, embedding: the caller owns it) or built by `engine_factory` on a daemon
thread after the app starts, so /health answers 503 while every bucket compiles; the app then owns it:
draining drains it, cleanup shuts it down.

Another protocol joins by adding a route whose handler calls `run_websocket` with its own protocol class;
auth, limits, metrics and draining apply to it unchanged.

A browser's WebSocket can carry the API key only as the subprotocol `openai-insecure-api-key.<key>` (serving/auth.py),
and it fails a handshake that selects none of the subprotocols it offered; the key itself is never selected (that
would echo it). So `/v1/realtime`, SageMaker's route and `/ws` select the first offered subprotocol that names what
they speak: `realtime` or `openai-beta.realtime-v1` for OpenAI's dialect (`/v1/realtime` only), `vllm-realtime`
(VLLM_SUBPROTOCOLS) for the server's own protocols, vLLM's (`/v1/realtime`, SageMaker's route) and the envelope
(`/ws`). Kyutai's clients send their key as a header or in the query.
"""
import asyncio
import logging
import threading
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxstream.serving import demo, envelope, kyutai, openai_realtime, realtime_dialects, wire_json
from jaxstream.serving.auth import CLIENT_SECRET, OPEN_PATHS, auth_middleware, is_authorized
from jaxstream.serving.client_secrets import ClientSecrets, add_client_secret_routes
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.cors import Cors
from jaxstream.serving.http_chat import add_chat_routes
from jaxstream.serving.http_completions import add_completion_routes
from jaxstream.serving.http_errors import error_response, routing_errors_middleware
from jaxstream.serving.http_log import quiet_malformed_requests
from jaxstream.serving.http_sessions import add_streaming_input_routes
from jaxstream.serving.http_tokenize import add_tokenize_routes
from jaxstream.serving.http_transcriptions import add_transcription_routes
from jaxstream.serving.limits import (
    CLOSE_CAPACITY, CLOSE_GOING_AWAY, CLOSE_INTERNAL_ERROR, CLOSE_POLICY_VIOLATION, CLOSE_TRY_AGAIN_LATER, Breach,
    FirstRequestDeadline, KeyLimits, key_limits_middleware,
)
from jaxstream.serving.memory import TRIM_PERIOD_S, malloc_trimmer
from jaxstream.serving.metrics import ServerMetrics
from jaxstream.serving.request_queue import RequestQueue
from jaxstream.serving.vllm_realtime import BINARY_AS_TEXT, BINARY_CLOSE, BINARY_ERROR, VllmRealtime
from jaxstream.serving.websocket import Connection, run_websocket

logger = logging.getLogger(__name__)

_TICK_SAMPLE_S = 1.0  # how often engine tick durations are copied into the histogram
_FLUSH_RESERVE_S = 5.0  # of the drain deadline, kept to flush utterances the server finishes itself
CLOSE_WAIT_S = 10.0  # after the drain deadline, for sockets to finish closing (deploy: grace period)
HEALTH_PATHS = ("/health", "/healthz", "/ping")  # open to all; 503 unless ready
# What the routes speaking the server's own (not OpenAI's) protocols select when a browser offers it with its key.
VLLM_SUBPROTOCOLS = (realtime_dialects.VLLM_SUBPROTOCOL,)
# Each WebSocket route and what it is, for a client that asks one without an upgrade (a browser, curl).
WEBSOCKET_ROUTES = {
    "/v1/realtime": "the realtime transcription WebSocket (vLLM's protocol, or OpenAI's realtime transcription)",
    "/invocations-bidirectional-stream": "SageMaker's bidirectional-streaming WebSocket (vLLM's realtime protocol)",
    envelope.ROUTE: "the JSON-envelope WebSocket",
    kyutai.ROUTE: "Kyutai's speech-to-text WebSocket (msgpack frames)",
}


class ServerState:
    """What the routes share: config, engine, metrics, open connections, drain state."""

    def __init__(self, config: ServerConfig, engine=None):
        self.config = config
        self.owns_engine = engine is None  # built by the app's engine_factory
        self.metrics = ServerMetrics()
        self.engine = None
        self.load_error: BaseException | None = None
        self.log_load_error = True  # off for a caller that reports a failed load itself (`jaxstream serve`)
        self.ready = asyncio.Event()
        self.draining = False
        self.connections: set = set()
        self._connections_changed = asyncio.Event()
        # One-shot HTTP requests waiting for a connection slot, and uploads waiting for an engine session
        # (request_queue.py); the gauge counts both.
        self.connection_queue, self.session_queue = RequestQueue(), RequestQueue()
        self.metrics.requests_waiting.set_function(lambda: len(self.connection_queue) + len(self.session_queue))
        self.created = int(time.time())
        self.client_secrets = ClientSecrets()
        self.key_limits = KeyLimits(config.limits, config.api_keys)
        # Its sweep needs aiohttp's server, which the app never sees: `jaxstream serve` runs it on its runner.
        self.first_request = FirstRequestDeadline(config.limits.first_request_timeout_s)
        if engine is not None:
            self._attach(engine)

    def _attach(self, engine) -> None:
        if engine.kind not in ("realtime", "text"):
            raise ValueError(f"jaxstream serve needs a realtime speech model or a text LM; "
                             f"{engine.model_name!r} is a {engine.kind} model")
        self.engine = engine
        if engine.kind == "text" and engine.tokenizer is not None:
            template = engine.tokenizer.chat_template_for(self.config.chat_template)
            if template is not None:
                try:  # before the first chat, which would wait for it on the event loop
                    template.prepare()
                except Exception as exc:  # noqa: BLE001 - the engine serves completions; chats will say why
                    logger.warning("the chat template could not be prepared (chats will fail with its error): %s",
                                   exc)
        self.metrics.attach_engine(engine)
        self.ready.set()

    # -- facts the protocols ask for ------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.config.served_model_name or str(self.engine.model_name)

    def serves_model(self, model: str, *, allow_empty: bool) -> bool:
        return model == self.model_id or (allow_empty and model == "")

    @property
    def allowed_delays_ms(self) -> tuple[int, ...]:
        from jaxstream.models.audio import ALLOWED_DELAYS_MS

        return ALLOWED_DELAYS_MS

    @property
    def max_connections(self) -> int:
        cap = self.config.limits.max_connections
        return cap if cap is not None else 2 * self.engine.config.max_sessions

    def drain_breach(self) -> Breach:
        return Breach("server_draining", CLOSE_GOING_AWAY, None, "server shutting down")

    # -- admission ------------------------------------------------------------------------------------
    def admit(self, conn) -> Breach | None:
        """None when `conn` may stay (it is then counted), else why it is refused."""
        if self.draining:
            return Breach("refused_draining", CLOSE_GOING_AWAY, "draining",
                          "The server is shutting down; connect to another replica")
        if self.engine is None:
            return Breach("refused_loading", CLOSE_TRY_AGAIN_LATER, "not_ready",
                          "The model is still loading; retry shortly")
        if not self.engine.healthy:
            return Breach("refused_engine_dead", CLOSE_INTERNAL_ERROR, "engine_dead", "The engine is not running")
        if isinstance(conn, Connection) and self.engine.kind != "realtime":
            # Every WebSocket route streams speech: a text model's server refuses at once, not at the first commit.
            # Not named: /ws answers its key after this refusal, and a model id may be a path on the server.
            return Breach("refused_model", CLOSE_POLICY_VIOLATION, "unsupported_model",
                          "This server serves a text language model: its realtime WebSocket routes need a "
                          "speech-to-text model (use /v1/completions or /v1/chat/completions)")
        if len(self.connections) >= self.max_connections:
            return Breach("refused_capacity", CLOSE_CAPACITY, "capacity",
                          f"The server is at its limit of {self.max_connections} connections; retry later")
        self.connections.add(conn)
        return None

    def forget(self, conn) -> None:
        self.connections.discard(conn)
        self._connections_changed.set()

    async def wait_connections_closed(self, deadline: float) -> bool:
        """Waits until no connection is open or the loop time reaches `deadline`."""
        loop = asyncio.get_running_loop()
        while self.connections and loop.time() < deadline:
            self._connections_changed.clear()
            try:
                async with asyncio.timeout(deadline - loop.time()):
                    await self._connections_changed.wait()
            except TimeoutError:
                break
        return not self.connections

    def health(self) -> tuple[int, dict]:
        """/health's status and body: only the state, which the demo page and operators read. Open to anyone, it
        names neither the model (its id may be a path on this machine: /v1/models, behind the key, has it) nor why
        a load failed (the log and `jaxstream serve` say it), where vLLM answers with no body at all."""
        if self.load_error is not None:
            return 503, {"status": "failed"}
        if self.engine is None:
            return 503, {"status": "loading"}
        if self.draining:
            return 503, {"status": "draining"}
        if not self.engine.healthy:
            return 503, {"status": "engine_dead"}
        return 200, {"status": "ok"}


SERVER = web.AppKey("jaxstream_server", ServerState)


def create_app(config: ServerConfig | None = None, *, engine=None, engine_factory=None) -> web.Application:
    """The server app over `engine`, or over the engine `engine_factory()` builds (the app then owns it
    and shuts it down on cleanup). Exactly one of the two."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("give exactly one of engine or engine_factory")
    config = config or ServerConfig()
    # Bodies stay small: the routes that take audio or chunks read their bodies themselves, to their own limits.
    # The demo page and its assets hold no secret: a browser loads them first, then asks for the key.
    state = ServerState(config, engine)
    open_paths = OPEN_PATHS | demo.PUBLIC_PATHS
    # /ws checks its key itself: its protocol answers a bad one after the upgrade (error, close 4001).
    # Routing's refusals are answered last, inside auth and the key's limits: they apply to any path.
    # CORS preflights are answered before auth (a browser sends them without the key) and on any path, as
    # Starlette's middleware does in vLLM; every other answer gets its CORS headers as it is prepared.
    quiet_malformed_requests()  # aiohttp's ERROR and traceback for each request it cannot parse: one WARNING line
    cors = Cors.from_config(config)
    auth = auth_middleware(config.api_keys, open_paths | {envelope.ROUTE}, state.client_secrets)
    app = web.Application(middlewares=[state.first_request.middleware(), cors.middleware(), auth,
                                       key_limits_middleware(state.key_limits, open_paths),
                                       routing_errors_middleware(WEBSOCKET_ROUTES)],
                          client_max_size=64 << 10)
    app[SERVER] = state
    app.on_response_prepare.append(cors.on_response_prepare)
    app.router.add_get("/v1/realtime", _realtime)
    app.router.add_get("/invocations-bidirectional-stream", _sagemaker)
    app.router.add_get(envelope.ROUTE, _envelope)
    app.router.add_get(kyutai.ROUTE, _kyutai)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    for path in HEALTH_PATHS:
        app.router.add_get(path, _health)
    app.router.add_get("/metrics", _metrics)
    demo.add_demo_routes(app)
    add_transcription_routes(app)
    add_streaming_input_routes(app)
    add_completion_routes(app)
    add_chat_routes(app)
    add_tokenize_routes(app)
    add_client_secret_routes(app)
    app.cleanup_ctx.append(_lifecycle(engine_factory))
    # aiohttp waits for open handlers after on_shutdown and before cleanup: sockets still open then (no
    # SIGTERM drain ran) are closed here, at once.
    app.on_shutdown.append(lambda app: drain(app, timeout=0.0))
    return app


def _lifecycle(engine_factory):
    async def lifecycle(app: web.Application):
        state = app[SERVER]
        loading = None
        if engine_factory is not None:
            loading = asyncio.create_task(_load_engine(state, engine_factory))
        sampler = asyncio.create_task(_sample_ticks(state))
        trimmer = asyncio.create_task(_trim_memory())
        yield
        sampler.cancel()
        trimmer.cancel()
        if loading is not None:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            if state.engine is not None:
                await state.engine.shutdown()

    return lifecycle


async def _load_engine(state: ServerState, factory) -> None:
    """Builds the engine (loading + compiling every bucket) on a daemon thread: to_thread's executor
    threads are joined at exit, which would make Ctrl-C wait for the compiler."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def build():
        try:
            result, error = factory(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the server stopped while this ran: its event loop is closed
            if result is not None:
                result.close()

    threading.Thread(target=build, name="jaxstream-engine-build", daemon=True).start()
    try:
        engine = await future
        try:
            state._attach(engine)  # noqa: SLF001 - the app owns its state
        except ValueError:
            await engine.shutdown()  # not a model this server can serve
            raise
        logger.info("engine ready: %s", state.model_id)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported by /health and by `jaxstream serve`
        state.load_error = exc
        state.ready.set()
        if state.log_load_error:
            logger.error("loading the model failed: %s", exc)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        if result is not None:
            result.close()  # nobody waits for this engine any more
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _trim_memory() -> None:
    """Returns freed heap pages to the system now and then (serving/memory.py: without it RSS creeps)."""
    trim = malloc_trimmer()
    while trim is not None:
        await asyncio.sleep(TRIM_PERIOD_S)
        await asyncio.to_thread(trim)


async def _sample_ticks(state: ServerState) -> None:
    while True:
        await asyncio.sleep(_TICK_SAMPLE_S)
        if state.engine is not None:
            state.metrics.observe_ticks()


async def drain(app: web.Application, timeout: float | None = None) -> bool:
    """Graceful shutdown of the sessions (SIGTERM): admit nothing new; close idle connections now; give
    running utterances until the deadline (the last few seconds of it after the server finished them
    itself, so their `transcription.done` still goes out); then abort what remains and close every socket
    with 1001. HTTP streams (streaming-input requests and sessions, SSE answers) are registered among the
    connections (streaming_input.DrainHandle): they are waited for, their input ended, or aborted alike.
    Returns True when no utterance had to be cut off."""
    state = app[SERVER]
    timeout = state.config.drain_timeout_s if timeout is None else timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    state.draining = True
    engine_drain = None
    if state.owns_engine and state.engine is not None and timeout > 0:
        engine_drain = asyncio.create_task(state.engine.drain(timeout))
    if state.connections:
        logger.info("draining %d connection(s), deadline %.1f s", len(state.connections), timeout)
    for conn in list(state.connections):
        if not conn.protocol.busy():
            conn.stop(state.drain_breach())
    if timeout > 0:
        await state.wait_connections_closed(deadline - min(_FLUSH_RESERVE_S, timeout / 2))
        for conn in list(state.connections):
            await conn.protocol.finish_for_drain()
        await state.wait_connections_closed(deadline)
    cut_off = [conn for conn in state.connections if conn.protocol.busy()]
    for conn in list(state.connections):
        conn.stop(Breach("drain_deadline", CLOSE_GOING_AWAY, "server_shutdown",
                         "The server shut down before the stream finished")
                  if conn in cut_off else state.drain_breach())
    await state.wait_connections_closed(loop.time() + CLOSE_WAIT_S)
    engine_clean = await engine_drain if engine_drain is not None else True
    return not cut_off and engine_clean


# -- handlers -----------------------------------------------------------------------------------------
async def _realtime(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    secret = request.get(CLIENT_SECRET)  # the live secret the auth middleware let in
    if secret is not None:  # its sessions speak the dialect it was minted in, configured as it was
        return await run_websocket(request, state, "/v1/realtime", lambda conn: openai_realtime.OpenAiRealtime(
            conn, state, beta=secret.beta, preset=secret.changes), subprotocols=realtime_dialects.SUBPROTOCOLS)
    dialect = realtime_dialects.handshake_dialect(request)
    if dialect is not None:
        return await run_websocket(request, state, "/v1/realtime", lambda conn: openai_realtime.OpenAiRealtime(
            conn, state, beta=dialect == "beta"), subprotocols=realtime_dialects.SUBPROTOCOLS)
    if state.config.vllm_compat:  # exactly vLLM: no switch on an OpenAI-shaped first event
        return await run_websocket(request, state, "/v1/realtime",
                                   lambda conn: VllmRealtime(conn, state, binary_frames=BINARY_CLOSE),
                                   subprotocols=VLLM_SUBPROTOCOLS)
    return await run_websocket(request, state, "/v1/realtime", lambda conn: realtime_dialects.DialectSwitch(
        conn, state, lambda tap: VllmRealtime(tap, state, binary_frames=BINARY_ERROR)),
        subprotocols=VLLM_SUBPROTOCOLS)


async def _sagemaker(request: web.Request) -> web.StreamResponse:
    """vLLM's protocol, whatever the handshake offers (no dialects: `realtime` is not selected)."""
    state = request.app[SERVER]
    return await run_websocket(request, state, "/invocations-bidirectional-stream",
                               lambda conn: VllmRealtime(conn, state, binary_frames=BINARY_AS_TEXT),
                               subprotocols=VLLM_SUBPROTOCOLS)


async def _envelope(request: web.Request) -> web.StreamResponse:
    """The envelope protocol; its key may come as a subprotocol too (is_authorized), so it selects
    `vllm-realtime` as the other routes of the server's own protocols do."""
    state = request.app[SERVER]
    authorized = is_authorized(request, state.config.api_keys)
    return await run_websocket(request, state, envelope.ROUTE, lambda conn: envelope.EnvelopeProtocol(
        conn, state, authorized=authorized), subprotocols=VLLM_SUBPROTOCOLS)


async def _kyutai(request: web.Request) -> web.StreamResponse:
    state = request.app[SERVER]
    return await run_websocket(request, state, kyutai.ROUTE, lambda conn: kyutai.KyutaiAsr(conn, state))


async def _health(request: web.Request) -> web.Response:
    status, body = request.app[SERVER].health()
    return web.json_response(body, status=status)


async def _models(request: web.Request) -> web.Response:
    state = request.app[SERVER]
    if state.engine is None:
        return error_response(503, "not_ready", "The model is still loading")
    return web.json_response({"object": "list", "data": [_model_object(state)]})


async def _model(request: web.Request) -> web.Response:
    """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`); the id may hold slashes (a hub name)."""
    state = request.app[SERVER]
    if state.engine is None:
        return error_response(503, "not_ready", "The model is still loading")
    model = request.match_info["model"]
    if model != state.model_id:
        return error_response(404, "model_not_found", f"The model `{wire_json.shown(model)}` does not exist; this "
                              f"server serves `{state.model_id}`")
    return web.json_response(_model_object(state))


def _model_object(state: ServerState) -> dict:
    """OpenAI's model object with vLLM's `root`, `parent` and `max_model_len` (a text model's context; null for the
    transcription model, whose streams are bounded by the server's limits instead)."""
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "jaxstream",
            "root": str(state.engine.model_name), "parent": None, "max_model_len": state.engine.max_model_len}


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[SERVER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
