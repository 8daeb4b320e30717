"""`jaxstream serve`: the realtime WebSocket server (vLLM's `/v1/realtime`, SageMaker's route, health,
models and Prometheus metrics) over one engine.

    jaxstream serve [MODEL] [--host H] [--port P] [--api-key K | --api-key-file F] [--max-sessions N]
                    [--delay-ms MS] [--max-session-seconds S] [--idle-timeout S] [--compat vllm]
                    [--config server.toml]

The model loads and every bucket compiles before the server reports ready (GET /health answers 503 until
then). SIGTERM or Ctrl-C drains: no new connection or utterance, running utterances get --drain-timeout
seconds to finish, then every socket closes with 1001 "server shutting down". A second signal exits at once.

Multi-host (`jaxstream/distributed.py`: flags, JAXSTREAM_* or a LeaderWorkerSet's environment): every process
runs the same command and one engine spans all their devices, tensor parallel. Process 0 serves; the others
follow its dispatches (`jaxstream/engine/multihost.py`), ignore SIGTERM and SIGINT (the leader's drain still
needs them) and exit when the leader stops.
"""
from jaxstream import distributed
from jaxstream.errors import ProcessGroupError, UserError

# The engine's own default lets one session queue 10 minutes of audio; a server with many sessions keeps
# far less per client in memory (the client is pushed back instead).
_SERVER_MAX_QUEUED_AUDIO_S = 30.0


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the realtime WebSocket API",
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
                        help="open WebSockets, streaming HTTP requests and sessions per API key (per client "
                             "address without keys; default unlimited)")
    parser.add_argument("--max-requests-per-minute", type=int, default=None, metavar="N",
                        help="HTTP requests and WebSocket handshakes per API key (or client address) in any "
                             "60 s (default unlimited)")
    parser.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                        help="on SIGTERM, time running utterances get before their sockets close (default 30)")
    parser.add_argument("--compat", choices=("strict", "vllm"), default=None,
                        help="'vllm': behave exactly like vLLM 0.33 where the protocol fixes would differ "
                             "(default strict)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model id clients name in session.update (default: MODEL as given)")
    parser.add_argument("--config", default=None, metavar="TOML",
                        help="server TOML (path or preset name, e.g. 'server'); flags override it")
    parser.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                        help="jaxstream's log level (default info: one line per connection; -vv: debug)")
    distributed.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    import asyncio
    import logging

    from jaxstream.commands.transcribe import checked_delay_ms, model_source
    from jaxstream.serving.auth import load_api_keys
    from jaxstream.serving.config import ServerConfig, load_server_file
    from jaxstream.serving.limits import Limits

    file = load_server_file(args.config) if args.config else None
    server = dict(file.server) if file else {}
    limits = dict(file.limits) if file else {}
    engine = dict(file.engine) if file else {}
    _override(server, host=args.host, port=args.port, compat=args.compat, drain_timeout_s=args.drain_timeout,
              served_model_name=args.served_model_name)
    _override(limits, max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
              max_session_seconds=args.max_session_seconds, max_audio_seconds=args.max_audio_seconds,
              max_payload_per_session=args.max_payload_per_session, max_streams_per_key=args.max_streams_per_key,
              max_requests_per_minute_per_key=args.max_requests_per_minute)
    _override(engine, max_sessions=args.max_sessions, default_delay_ms=args.delay_ms)
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
    # A server logs a line per connection by default; libraries' loggers (absl, orbax, jax) stay at warnings.
    level = args.log_level or ("debug" if getattr(args, "verbose", 0) >= 2 else "info")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxstream").setLevel(level.upper())
    group = distributed.initialize(args, recoverable=True)
    if group.count == 1:
        return asyncio.run(_serve(model, config, engine_config))
    engine_config = _spanning_every_process(engine_config)
    status = asyncio.run(_serve(model, config, engine_config)) if group.leader else _follow(group, model,
                                                                                          engine_config)
    distributed.leave()
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
    import signal

    from jaxstream.engine import multihost

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: _say("signal ignored: a follower stops when the leader does"))
    _say(f"process {group.index} of {group.count}: loading {model} and following process 0 (it serves)")
    try:
        dispatches = multihost.follow_pretrained(model, engine_config)
    except ProcessGroupError as exc:
        raise UserError(str(exc)) from None
    _say(f"stopped: the leader released its followers after {dispatches} dispatches")
    return 0


def _override(target: dict, **values) -> None:
    target.update({key: value for key, value in values.items() if value is not None})


async def _serve(model: str, config, engine_config) -> int:
    import asyncio
    import signal

    from aiohttp import web

    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.builders import freeze_startup_heap
    from jaxstream.serving.app import SERVER, create_app, drain

    def build_engine():
        engine = AsyncEngine.from_pretrained(model, config=engine_config)
        freeze_startup_heap()  # full garbage collections would stop the server for ~150 ms each
        return engine

    app = create_app(config, engine_factory=build_engine)
    state = app[SERVER]
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    deadline = asyncio.create_task(state.first_request.watch(runner.server))
    loop = asyncio.get_running_loop()
    signals = asyncio.Queue()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
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
            for line in _ready_lines(state.engine.kind, state.model_id, shown, port, keyed=bool(config.api_keys)):
                _say(line)
            await signal_wait
        _say(f"draining: running utterances get up to {config.drain_timeout_s:g} s (signal again to stop now)")
        draining = asyncio.ensure_future(drain(app))
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
        if second.done():
            draining.cancel()
            _say("stopping now")
        second.cancel()
    finally:
        deadline.cancel()
        await runner.cleanup()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    _say("stopped")
    return 0


def _ready_lines(kind: str, model_id: str, host: str, port: int, *, keyed: bool) -> list[str]:
    """Where the model is served, and a command to try it with: the realtime client for a speech model, a
    completion (`curl`) for a text LM, which the realtime routes do not serve."""
    import json
    import shlex

    if kind == "text":
        body = json.dumps({"model": model_id, "prompt": "Once upon a time", "max_tokens": 16})
        auth = ' -H "Authorization: Bearer $JAXSTREAM_API_KEY"' if keyed else ""
        return [f"ready: http://{host}:{port}/v1/completions serving {model_id!r} "
                f"(also /v1/streaming_input/sessions, /v1/models, /health, /metrics)",
                f"try: curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
                f"-d {shlex.quote(body)}"]
    # The client reads the key from $JAXSTREAM_API_KEY, as the server does.
    return [f"ready: ws://{host}:{port}/v1/realtime serving {model_id!r} "
            f"(also /ws, /invocations-bidirectional-stream, /v1/models, /health, /metrics)",
            f"try: python examples/realtime_client.py models/assets/samples/sample.wav "
            f"--url ws://{host}:{port}/v1/realtime"]


def _say(message: str) -> None:
    print(f"jaxstream serve: {message}", flush=True)

