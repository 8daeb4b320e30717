"""What every HTTP route of the server shares: the refusal (`RequestError`) and its OpenAI-shaped answer
`{"error": {"message", "type", "param", "code"}}`, every error code's status and OpenAI type (`ERROR_STATUS`,
`error_type`: the one source of a code's type on every route, HTTP, SSE and WebSocket), the readiness and model
checks, and reading request bodies (JSON larger than the app's small default limit, uploads) to the
idle timeout, answering a body that breaks off. A body read before its request is admitted (an upload's form,
a Mode A request's first line, every JSON body) must also keep arriving at a minimum average rate
(`read_before_admission`). A 408 closes the connection, whichever route answers it."""
import asyncio
import base64
import json

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from jaxstream.errors import EngineError
from jaxstream.serving.limits import SlowBody, read_at_min_rate

# Every error code the server sends, on any route, and its HTTP status: the status of a plain answer where the route
# has no reason to pick another (the engine's codes: engine_request_error), and the one source of the code's OpenAI
# `type` (error_type), so that an HTTP answer, a stream's `error` event and a WebSocket's type a failure alike. A route
# may answer a code with another status of the same type (a malformed body: 400 or 422). The one exception is
# `capacity` at the server's connection cap: a 429 over HTTP (streaming_input.admit), typed as the engine's capacity
# is (OpenAI's "overloaded" 503 is a server_error) and as a WebSocket refused at the cap is. A code only a WebSocket
# sends has the status an HTTP answer would carry. A code not listed is the server's (500): the server cannot tell the
# client it erred when it does not know. tests/test_serve_error_types.py finds every code in the source and checks
# that it is listed here.
ERROR_STATUS = {
    # The client's request, body or input: bad, too large, too slow, broken off.
    "invalid_request": 400, "invalid_json": 400, "invalid_chunk": 422, "invalid_audio": 400, "invalid_text": 422,
    "unsupported_modality": 422, "unsupported_model": 400, "unsupported_parameter": 400,
    "unsupported_start_policy": 422, "model_not_found": 404, "context_length_exceeded": 400, "audio_too_long": 400,
    "no_input": 422, "file_too_large": 413, "field_too_large": 413, "payload_too_large": 413,
    "request_too_large": 413, "body_too_slow": 408, "idle_timeout": 408, "client_disconnected": 400,
    "invalid_api_key": 401, "unauthorized": 401,
    # Routing: a path the server does not serve (OpenAI's own code), a method its route does not take, a WebSocket
    # route asked without an upgrade.
    "unknown_url": 404, "method_not_allowed": 405, "upgrade_required": 426,
    # A Mode B session and its event stream. A session closed for the client (idle, over its cap, not resumed) is
    # the engine's session_closed, a 409.
    "session_not_found": 404, "session_expired": 410, "session_closed": 409, "sequence_conflict": 409,
    "sequence_id_out_of_window": 422, "input_finished": 409, "chunks_missing": 409, "input_not_finished": 409,
    "not_streaming": 409, "replay_unavailable": 410, "invalid_last_event_id": 422,
    # A WebSocket's events, and its end for the client's own conduct: idle, held past the maximum duration (OpenAI's
    # Realtime API types its session_expired so), too many errors.
    "invalid_event": 400, "invalid_type": 400, "invalid_value": 400, "unknown_event": 400, "unsupported_event": 400,
    "invalid_frame": 400, "invalid_msgpack": 400, "invalid_message": 400, "unknown_message": 400,
    "invalid_marker": 400, "unsupported_format": 400, "model_not_validated": 400, "generation_in_progress": 409,
    "no_active_generation": 409, "input_audio_buffer_commit_empty": 400, "audio_limit_exceeded": 400,
    "max_duration_exceeded": 408, "max_duration": 408, "too_many_errors": 400,
    # A key's request rate or stream count (429 with Retry-After); /ws's message and cancel rates.
    "rate_limit_exceeded": 429, "rate_limited": 429,
    # The server's: busy, so worth retrying elsewhere or later (capacity, backlog: RETRYABLE_ENGINE_CODES), not
    # serving now (loading, failed, draining, dead), shutting down, or failing.
    "capacity": 503, "backlog": 503, "draining": 503, "server_draining": 503, "engine_dead": 503, "not_ready": 503,
    "loading": 503, "failed": 503, "server_shutdown": 503, "first_token_timeout": 500, "engine_error": 500,
    "processing_error": 500, "server_error": 500, "aborted": 500,
}
# The engine is busy: it refused the call whole, and the same call may succeed on this server later. A draining
# or dead engine will not serve it again.
RETRYABLE_ENGINE_CODES = frozenset({"capacity", "backlog"})


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error code, message, offending parameter, and for
    429/503 the seconds after which a retry may succeed."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.param, self.retry_after = status, code, param, retry_after

    def response(self) -> web.Response:
        return error_response(self.status, self.code, str(self), self.param, self.retry_after)


def error_type(code: str, status: int = 500) -> str:
    """OpenAI's error `type` of `code`, from its status in ERROR_STATUS, whatever status a route answers it with
    (`status` only for a code not listed): 429 rate_limit_error, another 4xx invalid_request_error (the client's
    mistake), else server_error."""
    status = ERROR_STATUS.get(code, status)
    return "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"


def error_response(status: int, code: str, message: str, param: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after or 1)} if status in (429, 503) else None
    response = web.json_response({"error": {"message": message, "type": error_type(code, status), "param": param,
                                            "code": code}}, status=status, headers=headers)
    if status == 408:
        # RFC 9110 15.5.9: the server closes the connection rather than go on waiting for the body (aiohttp
        # discards what more of it comes for at most its 10 s lingering time, then closes).
        response.force_close()
    return response


_PATH_SHOWN = 200  # of a request's path, echoed in a routing error
_HEADER_SHOWN = 40  # of a request header's value, echoed in a handshake refusal


def routing_errors_middleware(websocket_routes: dict[str, str]):
    """Answers the refusals aiohttp raises itself in OpenAI's error shape, as every route answers its own: an
    unknown path (404 `unknown_url`, OpenAI's code for it) and a method its route does not take (405 with the
    Allow header), both raised by the router, and the rest (a handshake or body aiohttp refuses) with their
    status. `websocket_routes` maps each WebSocket route to what it is: a plain request to one is told so (426
    Upgrade Required, RFC 9110 15.5.22), where the handshake's refusal said only `No WebSocket UPGRADE hdr`, and
    a handshake that aiohttp would refuse is told which header it lacks (`_handshake_fault`).

    The 404, 405 and 426 are counted apart (`jaxstream_http_routing_errors`), not in `jaxstream_errors`, which
    operators alert on: a scanner probing URLs is not the server failing.

    The app runs it after the auth middleware, as vLLM checks its key before routing: without a key, an unknown
    path is a 401 like any other, so the server tells nobody which routes it has before they authenticate."""
    @web.middleware
    async def answer_in_openai_shape(request: web.Request, handler):
        path = request.path[:_PATH_SHOWN]
        if request.path in websocket_routes and request.method in ("GET", "HEAD"):
            if request.headers.get("Upgrade", "").strip().lower() != "websocket":
                response = error_response(426, "upgrade_required", f"{path} is {websocket_routes[request.path]}: "
                                          f"connect to it with a WebSocket client (ws:// or wss://)")
                response.headers["Upgrade"] = "websocket"
                return _routing_refusal(request, response, "upgrade_required")
            fault = _handshake_fault(request.headers)
            if fault is not None:
                server_state(request).metrics.errors.labels(code="invalid_request").inc()
                return error_response(400, "invalid_request", f"The WebSocket handshake for {path} {fault}")
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            response = error_response(405, "method_not_allowed", f"{request.method} is not allowed on {path}; "
                                      f"it takes {allowed}")
            response.headers["Allow"] = exc.headers["Allow"]
            return _routing_refusal(request, response, "method_not_allowed")
        except web.HTTPNotFound:
            return _routing_refusal(request, error_response(404, "unknown_url", f"Unknown request URL: "
                                                            f"{request.method} {path}. Please check the URL for "
                                                            "typos"), "unknown_url")
        except web.HTTPException as exc:
            if exc.status < 400:  # a redirect or 304 is an answer, not a refusal
                raise
            code = "request_too_large" if exc.status == 413 else "invalid_request" if exc.status < 500 else \
                "server_error"
            message = " ".join(exc.text.split()) if exc.text else exc.reason
            server_state(request).metrics.errors.labels(code=code).inc()
            return error_response(exc.status, code, message)

    return answer_in_openai_shape


def _routing_refusal(request: web.Request, response: web.Response, code: str) -> web.Response:
    server_state(request).metrics.routing_errors.labels(status=str(response.status), code=code).inc()
    return response


def _handshake_fault(headers) -> str | None:
    """What a WebSocket handshake lacks (its Upgrade header aside, which the 426 answers), None when nothing: the
    checks aiohttp's handshake makes (web_ws._handshake), in its order. aiohttp refuses each with a 400 whose text
    is its own ("No CONNECTION upgrade hdr: None", "Handshake error: None"), and a key that is not ASCII with an
    uncaught ValueError (a 500, logged as the server's failure); the 400 and a message naming the header, in
    OpenAI's shape, go out before it runs."""
    # HTTP lets a header come as several lines (`Connection: keep-alive` then `Connection: Upgrade`): all count.
    connection = ", ".join(headers.getall("Connection", [])) or None
    if "upgrade" not in (token.strip().lower() for token in (connection or "").split(",")):
        return (f"lacks the header `Connection: Upgrade` ({_header_shown('Connection', connection)}): connect with "
                "a WebSocket client, through proxies that pass WebSocket upgrades on")
    version = headers.get("Sec-WebSocket-Version")
    if version not in ("13", "8", "7"):  # RFC 6455's 13, and the drafts aiohttp still takes
        return (f"needs the header `Sec-WebSocket-Version: 13` ({_header_shown('Sec-WebSocket-Version', version)}): "
                "connect with a WebSocket client that speaks RFC 6455")
    key = headers.get("Sec-WebSocket-Key")
    try:
        valid = bool(key) and len(base64.b64decode(key)) == 16
    except ValueError:  # binascii.Error, or a key that is not ASCII
        valid = False
    if not valid:
        return (f"needs the header `Sec-WebSocket-Key`: 16 random bytes in base64, new for each connection "
                f"({_header_shown('Sec-WebSocket-Key', key)})")
    return None


def _header_shown(name: str, value: str | None) -> str:
    return f"it has no {name} header" if value is None else f"its {name} is {value[:_HEADER_SHOWN]!r}"


def engine_request_error(exc: EngineError) -> RequestError:
    return RequestError(ERROR_STATUS.get(exc.code, 500), exc.code, str(exc))


def server_state(request: web.Request):
    from jaxstream.serving.app import SERVER  # app.py imports the route modules to register them

    return request.app[SERVER]


def check_ready(state) -> None:
    """RequestError 503 while the model loads, the server drains or the engine is dead (as /health)."""
    status, body = state.health()
    if status != 200:
        raise RequestError(503, body["status"], f"The server cannot serve requests now: {body['status']}")


def check_model(state, model, kind: str) -> None:
    """The request names the served model, or none, and that model is of `kind` ("realtime" or "text")."""
    check_model_name(state, model)
    check_kind(state, kind)


def check_model_name(state, model) -> None:
    """`model` names the served model, or none: omitted, null or "" is the served one, as vLLM's HTTP routes take
    them (its `_is_model_supported`)."""
    if model is not None:
        if not isinstance(model, str):
            raise RequestError(400, "invalid_request", "model must be the name of the served model", "model")
        if not state.serves_model(model, allow_empty=True):
            raise RequestError(404, "model_not_found", f"The model `{model}` does not exist.", "model")


def check_kind(state, kind: str) -> None:
    if state.engine.kind != kind:
        what = "a speech-to-text (realtime) model" if kind == "realtime" else "a text language model"
        raise RequestError(400, "unsupported_model", f"This endpoint needs {what}; the server serves "
                           f"{state.model_id!r}, a {state.engine.kind} model", "model")


async def read_json(request: web.Request, *, invalid_status: int = 400) -> dict:
    """The JSON object of a request body, read up to the protocol's frame limit (the app's own body limit
    is sized for small requests, not audio chunks) and at the body's minimum rate (`read_before_admission`).
    An empty body is an empty object. A body that is not a JSON object is `invalid_json`, 400 as OpenAI and vLLM
    answer it; a streaming-input chunk's route passes 422 (a malformed chunk, the streaming-input spec's status)."""
    return await read_before_admission(request, _read_json(request, invalid_status))


async def _read_json(request: web.Request, invalid_status: int) -> dict:
    limits = server_state(request).config.limits
    limit = limits.max_message_bytes
    body = bytearray()
    while data := await body_read(request.content.read(64 << 10), limits):
        body += data
        if len(body) > limit:
            raise RequestError(413, "request_too_large", f"The request body is larger than {limit} bytes")
    if not body:
        return {}
    return parse_json_object(bytes(body), status=invalid_status)


async def read_before_admission(request: web.Request, read, *, from_first_byte: bool = False):
    """Awaits `read`, a coroutine reading the body of a request that no limit counts yet, at the body's minimum
    rate (limits.read_at_min_rate): RequestError 408 when the body falls behind. Such a request is one not yet
    admitted as a stream (an upload's form, a Mode A request's first line, a Mode B session's creation) or one
    that never is (a Mode B chunk or a completion's JSON body: up to `max_message_bytes`, 4 MB). With
    `from_first_byte`, the rate's clock starts at the body's first byte (a Mode A first line)."""
    limits = server_state(request).config.limits
    try:
        # The body's bytes as they arrive (aiohttp's count of what it fed the request's stream), so that the
        # parts' headers and a line still incomplete count too.
        return await read_at_min_rate(read, limits, lambda: request.content.total_bytes,
                                      from_first_byte=from_first_byte)
    except SlowBody as exc:
        raise RequestError(408, "body_too_slow", str(exc)) from None


async def body_read(read, limits):
    """Awaits one read of a request body (`read`, a coroutine). A body silent for `limits.idle_timeout_s` is
    refused with 408, as an idle WebSocket is closed: a client that announced more than it sends would
    otherwise hold its connection forever. A body that breaks off (the connection lost, or a multipart body
    that ends inside a part) or that aiohttp cannot parse is a 400: an answer the client may never read, but
    one that aiohttp sends or drops quietly, where an exception escaping the handler is logged as the
    server's own failure.

    The read is awaited in the caller's task under `asyncio.timeout`, not `asyncio.wait_for`: Python 3.11's
    wait_for runs it in a task of its own and, when a cancel comes as that read completes, returns the data and
    drops the cancel, so that a caller cancelled then (Mode A's reader, cancelled by `end_request`) went on to
    its next read and held the request until the idle timeout."""
    try:
        async with asyncio.timeout(limits.idle_timeout_s):
            return await read
    except TimeoutError:
        raise RequestError(408, "idle_timeout", f"No input for {limits.idle_timeout_s:g} s") from None
    except ConnectionError as exc:
        raise RequestError(400, "client_disconnected", f"The request body broke off: {exc}") from None
    # aiohttp's multipart reader raises ValueError for a missing or too long boundary and a body that ends
    # before its closing boundary, and its HTTP parser's errors for a part header without a colon or longer
    # than its line limit; a body it cannot decode (broken gzip or chunked framing) is a RequestPayloadError.
    except (ValueError, HttpProcessingError, web.RequestPayloadError) as exc:
        raise RequestError(400, "invalid_request", f"The request body is malformed: {exc}") from None


def parse_json_object(data: bytes, what: str = "The body", *, status: int = 400) -> dict:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(status, "invalid_json", f"{what} is not JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses per nesting level: `[` * 100000 is a small body
        raise RequestError(status, "invalid_json", f"{what} is not JSON: it is nested too deeply") from None
    if not isinstance(value, dict):
        raise RequestError(status, "invalid_json", f"{what} must be a JSON object")
    return value
