"""Every error code the server sends has one OpenAI `type`, whichever way it travels: a plain HTTP answer
(`RequestError.response`), a stream's `error` event (`sse.error_payload`) and the OpenAI realtime dialect's
`error` and `...transcription.failed` events. One map is the source (`http_errors.ERROR_STATUS`). The oracle is the
status each HTTP route answers a code with, typed as OpenAI types an HTTP error (a 4xx the client's
invalid_request_error, a 429 a rate_limit_error, a 5xx the server's server_error), with one exception the map
states: the connection cap's 429 `capacity`, the same refusal a WebSocket gets, typed as the engine's `capacity`.

The codes are found in the source, not listed here: the calls that raise or send one (`RequestError`, `Breach`,
the protocols' error classes and `_error`s, `error_payload`, `fail`, ...), the engine's error classes, and the
refusals of a server that is not ready or is full. A code added anywhere is checked as soon as it is written."""
import ast
import asyncio
import json
import types
from pathlib import Path

import aiohttp
import websockets

import jaxstream.serving
from jaxstream.errors import EngineError
from jaxstream.serving import envelope, http_errors, sse, streaming_input
from jaxstream.serving.app import ServerState
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import RequestError, check_ready, engine_request_error
from jaxstream.serving.limits import Limits
from jaxstream.serving.metrics import ServerMetrics
from jaxstream.serving.openai_realtime import OpenAiRealtime, _Item
from jaxstream.serving.openai_session_config import ClientError
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine  # noqa: F401 - pytest fixture

SOURCE = Path(jaxstream.serving.__file__).parent
CODE_PARAMS = ("code", "error_code")  # how the functions and error classes of serving/ name an error code


# -- the codes, from the source ------------------------------------------------------------------------------
def _params(node) -> list[str]:
    """The positional parameters a call of `node` (a def, or a class by its __init__ or dataclass fields) binds."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:  # a dataclass: its fields, in order
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        node = init
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _strings(node) -> set[str]:
    """The code(s) an argument names: a string, either branch of `a if c else b`, the literals of `x or "y"`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*map(_strings, node.values))
    return set()


def _argument(call: ast.Call, params: list[str], name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    if name not in params:
        return None
    position = params.index(name)
    # `f(*ids, code)`: positions after a starred argument are unknown.
    if any(isinstance(arg, ast.Starred) for arg in call.args[:position + 1]) or position >= len(call.args):
        return None
    return call.args[position]


def _parsed() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(SOURCE.glob("*.py"))}


def source_codes() -> tuple[set[str], set[tuple[str, int]]]:
    """(every code named in serving/'s source, the (code, status) pairs of the HTTP answers given there)."""
    modules = _parsed()
    local: dict[str, dict[str, list[str]]] = {}  # module -> name -> params, for the defs that take a code
    shared: dict[str, list[str]] = {}
    codes, answers = set(), set()
    for module, tree in modules.items():
        for node in ast.walk(tree):
            # A class is called by its name (its __init__ only through super(), with other arguments).
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name != "__init__":
                params = _params(node)
                if any(name in params for name in CODE_PARAMS):
                    local.setdefault(module, {}).setdefault(node.name, params)
                    shared.setdefault(node.name, params)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # `code="session_closed"` defaults
                args = node.args.posonlyargs + node.args.args
                for arg, default in zip(args[len(args) - len(node.args.defaults):], node.args.defaults):
                    if arg.arg in CODE_PARAMS:
                        codes |= _strings(default)
            if isinstance(node, ast.Dict):  # an error body written out: {"error": {..., "code": "..."}}
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "code":
                        codes |= _strings(value)
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            params = local.get(module, {}).get(name) or shared.get(name)
            if params is None:
                continue
            named = set().union(*(_strings(arg) for arg in (_argument(node, params, p) for p in CODE_PARAMS)
                                  if arg is not None))
            codes |= named
            status = _argument(node, params, "status")
            if isinstance(status, ast.Constant) and isinstance(status.value, int):
                answers |= {(code, status.value) for code in named}
    return codes, answers


def _state(**limits) -> ServerState:
    return ServerState(ServerConfig(limits=Limits(**limits)))


def _not_ready_states():
    """A server loading, failed to load, draining, with a dead engine, and full (one connection, its cap)."""
    loading = _state()
    failed = _state()
    failed.load_error = RuntimeError("no such checkpoint")
    states = [loading, failed]
    for draining, healthy in ((True, True), (False, False)):
        state = _state()
        state.engine = types.SimpleNamespace(healthy=healthy, model_name="m")
        state.draining = draining
        states.append(state)
    full = _state(max_connections=1)
    full.engine = types.SimpleNamespace(healthy=True, model_name="m")
    full.connections.add(object())
    return states + [full]


def refusal_answers() -> set[tuple[str, int]]:
    """(code, status) of what the engine's errors and a server that cannot serve are answered with over HTTP: the
    readiness check's 503s, the admission of a stream (streaming_input.admit: the connection cap's 429)."""
    answers = set()
    for cls in engine_error_classes():
        refusal = engine_request_error(cls("refused"))
        answers.add((refusal.code, refusal.status))
    for state in _not_ready_states():
        for check in (lambda: check_ready(state), lambda: streaming_input.admit(state, object())):
            try:
                check()
            except RequestError as exc:
                answers.add((exc.code, exc.status))
    return answers


def engine_error_classes() -> list[type]:
    classes, todo = [], [EngineError]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


# -- the types on each transport -------------------------------------------------------------------------------
# The one HTTP answer not typed by its status: the connection cap's 429 (see the module docstring).
TYPED_AS_THE_ENGINES = {("capacity", 429)}


def status_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"


def http_type(code: str, status: int) -> str:
    return json.loads(RequestError(status, code, "refused").response().body)["error"]["type"]


def sse_type(code: str) -> str:
    return sse.error_payload("refused", code)["error"]["type"]


class _Conn:
    """The transport an OpenAiRealtime protocol sends through (serving.websocket.Connection), recording."""

    id = "ws-test"
    audio_seconds = 0.0

    def __init__(self):
        self.sent = []

    def count_error(self, code, *, budget=True) -> None:
        pass

    async def send(self, event) -> None:
        self.sent.append(event)


def openai_dialect() -> OpenAiRealtime:
    server = types.SimpleNamespace(config=ServerConfig(), metrics=ServerMetrics(), draining=False)
    return OpenAiRealtime(_Conn(), server)


def websocket_type(code: str) -> str:
    """The type of the `error` event the OpenAI dialect sends before the server closes a connection (the shared
    runner's breach: refused, idle, too old, too many errors, shutting down)."""
    return openai_dialect().error_event(code, "refused")["error"]["type"]


# -- tests ------------------------------------------------------------------------------------------------------
def test_the_walk_finds_the_codes_of_every_kind_of_source():
    """The oracle's own check: codes of each kind of call are found, with their statuses."""
    codes, answers = source_codes()
    assert {"no_input", "session_closed", "replay_unavailable", "generation_in_progress", "unsupported_event",
            "rate_limited", "invalid_msgpack", "first_token_timeout", "server_shutdown", "too_many_errors",
            "file_too_large", "field_too_large", "processing_error", "rate_limit_exceeded"} <= codes
    assert {("body_too_slow", 408), ("session_expired", 410), ("not_ready", 503), ("aborted", 500)} <= answers
    assert {("capacity", 429), ("capacity", 503), ("loading", 503), ("engine_dead", 503)} <= refusal_answers()


def test_every_code_the_server_sends_is_in_the_one_map():
    """A code missing from ERROR_STATUS would be typed `server_error` on a stream or socket whatever its HTTP
    answer says; a listed code that nothing sends is a stale entry."""
    codes, answers = source_codes()
    codes |= {code for code, _ in refusal_answers()} | {cls.code for cls in engine_error_classes()}
    codes |= {code for code, _ in envelope._BREACH_CODES.values()}  # /ws's names of the runner's breach codes
    assert sorted(codes - set(http_errors.ERROR_STATUS)) == []
    assert sorted(set(http_errors.ERROR_STATUS) - codes) == []


def test_each_code_is_typed_alike_over_http_sse_and_websocket():
    """Every HTTP answer the server gives, (code, status): the answer, the same code's `error` event on a stream
    and on an OpenAI realtime WebSocket all carry the type of that status. Streams and sockets typed by a list of
    client codes of their own, which missed most of the HTTP routes' 4xx codes (session_expired, model_not_found,
    ...), and the connection cap's refusal was a 429 rate_limit_error over HTTP, the same `capacity` a server_error
    over a WebSocket (and the engine's `capacity` a server_error everywhere)."""
    _, answers = source_codes()
    mismatches = []
    for code, status in sorted(answers | refusal_answers()):
        expected = "server_error" if (code, status) in TYPED_AS_THE_ENGINES else status_type(status)
        types_ = {"http": http_type(code, status), "sse": sse_type(code), "websocket": websocket_type(code)}
        if set(types_.values()) != {expected}:
            mismatches.append((code, status, expected, types_))
    assert mismatches == []


def test_the_codes_only_streams_and_sockets_send_are_typed_alike():
    codes, answers = source_codes()
    for code in sorted(codes - {code for code, _ in answers | refusal_answers()}):
        assert sse_type(code) == websocket_type(code), code


async def test_the_openai_dialects_refusals_are_typed_as_http_answers_them():
    """The OpenAI dialect's own paths: a client mistake (every ClientError code the source raises) is the client's
    invalid_request_error; the engine's refusal of an event, and its failure of a transcription
    (`...transcription.failed`), are typed as the HTTP routes answer the same engine error."""
    codes, _ = source_codes()
    trees = [ast.parse((SOURCE / name).read_text()) for name in ("openai_realtime.py", "openai_session_config.py")]
    client_codes = {node.args[0].value for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "ClientError" and isinstance(node.args[0], ast.Constant)}
    assert {"input_audio_buffer_commit_empty", "model_not_found"} <= client_codes <= codes
    for code in sorted(client_codes):
        protocol = openai_dialect()
        await protocol._report(ClientError(code, "refused"), "event_1")
        (event,) = protocol.conn.sent
        assert (event["error"]["code"], event["error"]["type"]) == (code, "invalid_request_error")
    for cls in engine_error_classes():
        answer = engine_request_error(cls("refused"))
        expected = http_type(answer.code, answer.status)
        protocol = openai_dialect()
        await protocol._report(cls("refused"), "event_1")
        item = _Item("item_1", None, _FailingSession(cls("the transcription failed")))
        await protocol._pump(item)
        refused, failed = protocol.conn.sent
        assert refused["type"] == "error" and failed["type"].endswith("_transcription.failed")
        assert (refused["error"]["type"], failed["error"]["type"]) == (expected, expected), cls


class _FailingSession:
    """An engine session whose event stream fails at once."""

    def __init__(self, error: Exception):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error


async def test_the_connection_caps_refusal_is_typed_alike_over_http_and_websocket(engine):
    """A server at its connection cap refuses a Mode B session (429, so OpenAI's SDK raises RateLimitError) and an
    OpenAI realtime connection (an `error`, then close 4002): one refusal, code `capacity`, typed as the engine's
    own `capacity` (OpenAI's "overloaded" is a server_error). The HTTP answer said rate_limit_error."""
    server = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    try:
        async with websockets.connect(server.url()) as held:
            assert json.loads(await asyncio.wait_for(held.recv(), 30))["type"] == "session.created"  # admitted
            async with aiohttp.ClientSession() as http:
                async with http.post(server.url("/v1/streaming_input/sessions", "http"),
                                     json={"model": server.state.model_id}) as response:
                    status, answer = response.status, (await response.json())["error"]
            async with websockets.connect(server.url("/v1/realtime?intent=transcription")) as refused:
                event = json.loads(await asyncio.wait_for(refused.recv(), 30))
    finally:
        server.close()
    assert (status, answer["code"]) == (429, "capacity"), answer
    assert (event["type"], event["error"]["code"]) == ("error", "capacity"), event
    assert answer["type"] == event["error"]["type"] == "server_error"
