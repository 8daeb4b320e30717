"""`jaxstream serve`: one engine behind realtime WebSockets (vLLM's and OpenAI's `/v1/realtime`, the `/ws`
envelope, Kyutai's `/api/asr-streaming`, SageMaker's route), OpenAI's HTTP transcriptions and completions,
HTTP streaming-input sessions, a browser microphone demo at `/`, health, models and Prometheus metrics.

    jaxstream serve [MODEL] [--host H] [--port P] [--api-key K | --api-key-file F] [--max-sessions N]
                    [--delay-ms MS] [--max-session-seconds S] [--idle-timeout S] [--compat vllm]
                    [--generation-config {auto,vllm}] [--chat-template PATH] [--enable-auto-tool-choice]
                    [--tool-call-parser {hermes,llama3_json,mistral}] [--reasoning-parser {deepseek_r1,qwen3}]
                    [--allowed-origins JSON] [--allowed-methods JSON] [--allowed-headers JSON]
                    [--allow-credentials] [--enable-prefix-caching | --no-enable-prefix-caching]
                    [--quantization int8] [--kv-cache-dtype fp8] [--config server.toml]

The server listens first, then loads the model and compiles every bucket before it reports ready (GET /health
answers 503 until then); a host or port it cannot listen on fails at once, before any loading. SIGTERM or
Ctrl-C drains: no new connection or utterance, running utterances get --drain-timeout seconds to finish, then
every socket closes with 1001 "server shutting down". A second signal exits at once.

Multi-host (`jaxstream/distributed.py`: flags, JAXSTREAM_* or a LeaderWorkerSet's environment): every process
runs the same command and one engine spans all their devices, tensor parallel. Process 0 serves; the others
follow its dispatches (`jaxstream/engine/multihost.py`), ignore SIGTERM and SIGINT (the leader's drain still
needs them) and exit when the leader stops.
"""
import argparse
import json
import logging
import os
import signal
import sys
import threading

from jaxstream import distributed
from jaxstream.errors import ProcessGroupError, UserError

logger = logging.getLogger(__name__)

# The engine's own default lets one session queue 10 minutes of audio; a server with many sessions keeps
# far less per client in memory (the client is pushed back instead).
_SERVER_MAX_QUEUED_AUDIO_S = 30.0


def register(subparsers) -> None:
    from jaxstream.commands.transcribe import add_precision_arguments
    from jaxstream.serving.reasoning_parsers import REASONING_PARSERS
    from jaxstream.serving.tool_parsers import TOOL_PARSERS

    parser = subparsers.add_parser("serve", help="serve the realtime WebSocket and HTTP APIs",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="model name, directory or Hugging Face id (default: the embedded tiny model)")
    parser.add_argument("--host", default=None, help="interface to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, metavar="K",
                      help="require this key (Bearer, X-API-Key or ?api_key=); default $JAXSTREAM_API_KEY")
    keys.add_argument("--api-key-file", default=None, metavar="F", help="require one of the keys in F, one a line")
    parser.add_argument("--max-sessions", type=int, default=None, metavar="N",
                        help="concurrent transcriptions the engine runs (default 64)")
    parser.add_argument("--max-connections", type=int, default=None, metavar="N",
                        help="open WebSocket connections and HTTP streams (default: twice --max-sessions)")
    parser.add_argument("--delay-ms", type=int, default=None, metavar="MS",
                        help="transcription delay of sessions that do not choose one, a multiple of 80 in "
                             "80..1200 or 2400 (default: the model's); clients may choose per session")
    parser.add_argument("--max-session-seconds", type=float, default=None, metavar="S",
                        help="close a connection this old (default 5400)")
    parser.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                        help="close a connection silent this long, and refuse (408) an HTTP body that stalls "
                             "this long (default 150)")
    parser.add_argument("--max-audio-seconds", type=float, default=None, metavar="S",
                        help="audio one connection may send in all (default 7200); with [engine] "
                        "realtime_admission = \"window\" the engine reserves memory for each session's largest size, "
                        "so a limit under the attention windows (~11 min for Voxtral) holds more streams per device; "
                        "demand admission holds only what streams use")
    parser.add_argument("--max-payload-per-session", type=int, default=None, metavar="BYTES",
                        help="payload one HTTP streaming-input request or session may send (default 268435456)")
    parser.add_argument("--max-streams-per-key", type=int, default=None, metavar="N",
                        help="open WebSockets, streaming-input sessions and HTTP requests that run the model "
                             "(uploads, completions, chats: waiting in the queue or running) per API key (per "
                             "client address without keys; default unlimited; a request past it: 429 with "
                             "Retry-After). Limit or not, a key's queued requests take turns with other keys' and "
                             "give their places up to them when the queue is full")
    parser.add_argument("--max-requests-per-minute", type=int, default=None, metavar="N",
                        help="HTTP requests and WebSocket handshakes per API key (or client address) in any "
                             "60 s (default unlimited)")
    parser.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                        help="on SIGTERM, time running utterances get before their sockets close (default 30)")
    parser.add_argument("--compat", choices=("strict", "vllm"), default=None,
                        help="'vllm': behave exactly like vLLM 0.33 where the protocol fixes would differ "
                             "(default strict)")
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default=None,
                        help="'auto': completions that omit temperature, top_p or top_k take the values the "
                             "checkpoint's generation_config.json declares, as vLLM does; 'vllm': ignore them "
                             "(default auto)")
    parser.add_argument("--chat-template", default=None, metavar="PATH",
                        help="jinja chat template for /v1/chat/completions, in place of the tokenizer's or for a "
                             "model without one (a file, or the template itself, as vLLM takes it)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                        help="chat: tool_choice \"auto\" (the default with tools) parses the model's tool calls "
                             "into tool_calls (needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", choices=tuple(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
                             "(Llama 3.x), mistral")
    parser.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                        help="chat: the <think> reasoning goes out as reasoning_content, apart from the content")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model id clients name in session.update (default: MODEL as given)")
    # CORS, with vLLM's flag names, JSON lists and defaults (serving/cors.py).
    parser.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                        help='origins browser pages may call the API from, a JSON list such as '
                             '\'["https://app.example.com"]\' (default \'["*"]\': any)')
    parser.add_argument("--allowed-methods", type=_json_list, default=None, metavar="JSON",
                        help="methods cross-origin requests may use, a JSON list (default '[\"*\"]': any)")
    parser.add_argument("--allowed-headers", type=_json_list, default=None, metavar="JSON",
                        help="request headers cross-origin requests may send, a JSON list (default '[\"*\"]': any)")
    parser.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=None,
                        help="let cross-origin requests carry credentials (cookies, HTTP auth; default off)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="text LMs: requests whose prompts start alike share the KV of the common part "
                             "(vLLM's automatic prefix caching; default on)")
    add_precision_arguments(parser)
    parser.add_argument("--config", default=None, metavar="TOML",
                        help="server TOML (path or preset name, e.g. 'server'); flags override it")
    parser.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                        help="jaxstream's log level (default info: one line per connection; -vv: debug)")
    distributed.add_arguments(parser)
    parser.set_defaults(func=run)


def _json_list(text: str) -> list:
    """A flag's JSON list of strings, as vLLM's CORS flags take them (json.loads), refused when not a list: vLLM
    would take the string '"https://a.com"' and match origins against its characters."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"https://app.example.com\"]', "
                                         f"got {text[:80]!r}")
    return value


def run(args) -> int:
    # SIGINT is held back until the event loop takes it (_serve, _follow): a Ctrl-C while the server's modules
    # imported raised KeyboardInterrupt inside the garbage-collection callback jaxlib installs, where Python drops
    # it, and the server went on to serve (3 of 18 runs interrupted 0.9-1.7 s after start, 2-core CPU).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return _run(args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _run(args) -> int:
    import asyncio

    from jaxstream.commands.transcribe import checked_delay_ms, model_source
    from jaxstream.serving.auth import load_api_keys
    from jaxstream.serving.config import ServerConfig, load_server_file
    from jaxstream.serving.limits import Limits

    file = load_server_file(args.config) if args.config else None
    server = dict(file.server) if file else {}
    limits = dict(file.limits) if file else {}
    engine = dict(file.engine) if file else {}
    _override(server, host=args.host, port=args.port, compat=args.compat, drain_timeout_s=args.drain_timeout,
              served_model_name=args.served_model_name, generation_config=args.generation_config,
              chat_template=args.chat_template, enable_auto_tool_choice=args.enable_auto_tool_choice,
              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
              allowed_origins=args.allowed_origins,
              allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
              allow_credentials=args.allow_credentials)
    _override(limits, max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
              max_session_seconds=args.max_session_seconds, max_audio_seconds=args.max_audio_seconds,
              max_payload_per_session=args.max_payload_per_session, max_streams_per_key=args.max_streams_per_key,
              max_requests_per_minute_per_key=args.max_requests_per_minute)
    _override(engine, max_sessions=args.max_sessions, default_delay_ms=args.delay_ms,
              enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    if isinstance(server.get("chat_template"), str):  # the config holds the template, read once here
        from jaxstream.models.chat_templates import load_chat_template

        server["chat_template"] = load_chat_template(server["chat_template"])
    engine.setdefault("max_queued_audio_seconds", _SERVER_MAX_QUEUED_AUDIO_S)
    delay_ms = engine.get("default_delay_ms")
    if delay_ms is not None and (isinstance(delay_ms, bool) or not isinstance(delay_ms, int)):
        raise UserError(f"bad server configuration: default_delay_ms must be a whole number of milliseconds, "
                        f"got {delay_ms!r}")
    checked_delay_ms(delay_ms)
    from jaxstream.engine.config import EngineConfig

    try:
        engine_config = EngineConfig(**engine)
        config = ServerConfig(api_keys=load_api_keys(args.api_key, args.api_key_file), limits=Limits(**limits),
                              **server)
    except (TypeError, ValueError) as exc:
        raise UserError(f"bad server configuration: {exc}") from None
    model = model_source(args.model or (file.model if file else None))
    key_source = None
    if config.api_keys:
        key_source = "--api-key" if args.api_key is not None else "--api-key-file" if args.api_key_file else "env"
    # A server logs a line per connection by default; libraries' loggers (absl, orbax, jax) stay at warnings.
    level = args.log_level or ("debug" if getattr(args, "verbose", 0) >= 2 else "info")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxstream").setLevel(level.upper())
    group = distributed.initialize(args, recoverable=True)
    loading = threading.Event()  # set while the engine loads and compiles on the app's thread
    if group.count == 1:
        return _exit_now_if_loading(loading, asyncio.run(_serve(model, config, engine_config, key_source, loading)))
    engine_config = _spanning_every_process(engine_config)
    status = asyncio.run(_serve(model, config, engine_config, key_source, loading)) if group.leader else _follow(
        group, model, engine_config)
    distributed.leave()
    return _exit_now_if_loading(loading, status)


def _exit_now_if_loading(loading: threading.Event, status: int) -> int:
    """`status`, or, for a server stopped (SIGINT, SIGTERM) while its engine was still loading, an exit at once
    with it: the interpreter's exit would stop the loading thread inside XLA, and the process then aborted
    ("terminate called after throwing an instance of ''", exit 134). Nothing but the standard streams is
    left to flush by then."""
    if loading.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _spanning_every_process(engine_config):
    """The engine config over one tensor-parallel mesh of every device of the job."""
    import dataclasses

    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), (engine_config.tp_axis,))
    return dataclasses.replace(engine_config, mesh=mesh)


def _follow(group, model: str, engine_config) -> int:
    from jaxstream.engine import multihost

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: _say("signal ignored: a follower stops when the leader does"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held since `run`
    _say(f"process {group.index} of {group.count}: loading {model} and following process 0 (it serves)")
    try:
        dispatches = multihost.follow_pretrained(model, engine_config)
    except ProcessGroupError as exc:
        raise UserError(str(exc)) from None
    _say(f"stopped: the leader released its followers after {dispatches} dispatches")
    return 0


def _override(target: dict, **values) -> None:
    target.update({key: value for key, value in values.items() if value is not None})


async def _serve(model: str, config, engine_config, key_source: str | None, loading: threading.Event) -> int:
    import asyncio
    import concurrent.futures

    from aiohttp import web

    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.builders import freeze_startup_heap
    from jaxstream.serving.app import SERVER, create_app, drain

    # The app starts building the engine on its own thread when the runner is set up, before the site can
    # bind; a process that then failed to listen exited while that thread was inside XLA, and about half
    # such runs aborted ("terminate called ...", exit 134) after the one-line error. The build waits here
    # until the site listens, and gives up without loading anything when it never will.
    listening: concurrent.futures.Future = concurrent.futures.Future()

    def build_engine():
        if not listening.result():
            raise RuntimeError("the server stopped before it listened")  # nobody waits for this any more
        loading.set()
        try:
            engine = AsyncEngine.from_pretrained(model, config=engine_config,
                                                 generation_config=config.generation_config)
            log_sampling_defaults(engine)
            log_chat_template(engine, config)
            freeze_startup_heap()  # full garbage collections would stop the server for ~150 ms each
        finally:
            loading.clear()
        return engine

    app = create_app(config, engine_factory=build_engine)
    state = app[SERVER]
    state.log_load_error = False  # the command's own error line says it (the log line repeated it)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    deadline = asyncio.create_task(state.first_request.watch(runner.server))
    loop = asyncio.get_running_loop()
    signals = asyncio.Queue()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held since `run`: one that came meanwhile is here
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise UserError(f"cannot listen on {config.host}:{config.port}: {_listen_error(exc)}") from None
        listening.set_result(True)
        host, port = runner.addresses[0][:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        _say(f"listening on http://{host}:{port}; loading {model} and compiling every bucket "
             "(GET /health answers 503 until ready)")
        signal_wait = asyncio.ensure_future(signals.get())
        await asyncio.wait({signal_wait, asyncio.ensure_future(state.ready.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if state.load_error is not None:
            error = state.load_error
            raise error if isinstance(error, UserError) else UserError(f"cannot load {model}: {error}")
        if not signal_wait.done():
            if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_keys:
                _say("warning: no API key and listening beyond loopback: anyone who can reach this port "
                     "may use it (--api-key or $JAXSTREAM_API_KEY)")
            for line in _ready_lines(state.engine.kind, state.model_id, shown, port, key_source=key_source):
                _say(line)
            await signal_wait
        if state.ready.is_set():
            _say(f"draining: running utterances get up to {config.drain_timeout_s:g} s (signal again to stop now)")
        else:  # nothing runs yet: the drain only closes the listener (and an early client's socket)
            _say("stopping: the model was still loading")
        draining = asyncio.ensure_future(drain(app))
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
        if second.done():
            draining.cancel()
            _say("stopping now")
        second.cancel()
    finally:
        deadline.cancel()
        try:
            await runner.cleanup()
        finally:
            if not listening.done():  # after the cleanup cancelled the load, so that nothing reports its end
                listening.set_result(False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    _say("stopped")
    return 0


def log_sampling_defaults(engine) -> None:
    """One INFO line naming the checkpoint's sampling defaults completions take, when there are any (vLLM's
    "Using default completion sampling params from model")."""
    from jaxstream.engine.requests import SamplingParams
    from jaxstream.serving.completion_fields import DEFAULTED

    defaults, unset = engine.default_sampling_params(), SamplingParams()
    applied = {name: getattr(defaults, name) for name in DEFAULTED if getattr(defaults, name) != getattr(unset, name)}
    if applied:
        logger.info("completions that omit them sample with the model's defaults %s (its generation config; "
                    "--generation-config vllm ignores it)", ", ".join(f"{k}={v}" for k, v in applied.items()))


def log_chat_template(engine, config) -> None:
    """A warning when --chat-template cannot apply: to a speech model, a model without a tokenizer, or a Mistral
    tekken tokenizer, whose chats mistral-common encodes (vLLM ignores the flag for it too, with a warning)."""
    if config.chat_template is None:
        return
    tokenizer = engine.tokenizer if engine.kind == "text" else None
    if tokenizer is None:
        logger.warning("--chat-template is ignored: %s serves no chat (a text LM with a tokenizer does)",
                       engine.model_name)
    elif tokenizer.chat_template_for(config.chat_template) is tokenizer.chat_template:
        logger.warning("--chat-template is ignored: this model's tekken tokenizer encodes chats with mistral-common")


# The routes each kind of model is served on besides the first (serving/app.py's table).
SPEECH_ROUTES = ("/ws", "/api/asr-streaming", "/invocations-bidirectional-stream", "/v1/audio/transcriptions",
                 "/v1/streaming_input/sessions", "/v1/realtime/client_secrets", "/v1/models", "/health", "/metrics")
TEXT_ROUTES = ("/v1/chat/completions", "/v1/streaming_input/sessions", "/tokenize", "/v1/models", "/health",
               "/metrics")
KEY_PLACEHOLDER = "YOUR_KEY"


def _ready_lines(kind: str, model_id: str, host: str, port: int, *, key_source: str | None = None) -> list[str]:
    """Where the model is served, and a command to try it with: the realtime client for a speech model, a
    completion (`curl`) for a text LM, which the realtime routes do not serve. `key_source` is where the
    server's keys came from ("--api-key", "--api-key-file", "env"; None: no keys): the command carries the
    key as the user must give it, never the key itself (a log is often shared)."""
    import json
    import shlex

    client_key = header = note = ""
    if key_source == "env":  # the realtime client reads $JAXSTREAM_API_KEY as the server does; curl does not
        header = ' -H "Authorization: Bearer $JAXSTREAM_API_KEY"'
        note = "  # the key from $JAXSTREAM_API_KEY"
    elif key_source is not None:
        client_key, header = f" --api-key {KEY_PLACEHOLDER}", f' -H "Authorization: Bearer {KEY_PLACEHOLDER}"'
        given = "the key given to --api-key" if key_source == "--api-key" else "a key from --api-key-file"
        note = f"  # {KEY_PLACEHOLDER}: {given}"
    if kind == "text":
        body = json.dumps({"model": model_id, "prompt": "Once upon a time", "max_tokens": 16})
        return [f"ready: http://{host}:{port}/v1/completions serving {model_id!r} (also {', '.join(TEXT_ROUTES)})",
                f"try: curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json'{header} "
                f"-d {shlex.quote(body)}{note}"]
    return [f"ready: ws://{host}:{port}/v1/realtime serving {model_id!r} (also {', '.join(SPEECH_ROUTES)}; "
            f"microphone demo: http://{host}:{port}/)",
            f"try: python examples/realtime_client.py models/assets/samples/sample.wav "
            f"--url ws://{host}:{port}/v1/realtime{client_key}{note}"]


def _listen_error(exc: OSError) -> str:
    """Why binding failed, once: asyncio words a bind error "error while attempting to bind on address
    ('0.0.0.0', 8000): address already in use", which repeats the address the message already gives."""
    import socket

    if exc.errno and not isinstance(exc, socket.gaierror):  # a resolver's codes are not errno values
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


def _say(message: str) -> None:
    print(f"jaxstream serve: {message}", flush=True)

