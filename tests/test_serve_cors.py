"""CORS in `jaxstream serve` (serving/cors.py), driven by real HTTP requests over loopback: preflights and the
headers of actual answers (errors and event streams included) for allowed and refused origins, credentials, the
API key (a preflight needs none), and vLLM's flags and the [server] TOML keys that configure it. Each server here
wraps the shared engine, so no model is compiled for this module."""
import io
import json
import logging

import aiohttp
import pytest
import soundfile
import websockets

from jaxstream.cli import main
from jaxstream.commands import serve
from jaxstream.serving.config import ServerConfig, load_server_file
from jaxstream.serving.http_sessions import REPLICA_HEADER
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

APP = "http://app.example.com"  # the page's origin
OTHER = "http://evil.example.com"
KEY = "secret"
EVERY_METHOD = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"  # what "*" allows, as Starlette


@pytest.fixture(scope="module")
def keyed(engine):
    """Only APP, GET and POST, Authorization among the non-safelisted headers; an API key."""
    server = ServerThread(engine, ServerConfig(api_keys=(KEY,), allowed_origins=(APP,),
                                               allowed_methods=("GET", "POST"), allowed_headers=("Authorization",)))
    yield server
    server.close()


async def _request(server, method: str, path: str, data: bytes | None = None, **headers) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, server.url(path, "http"), data=data, headers=headers) as response:
            return response.status, response.headers, await response.read()


async def _preflight(server, path: str, origin: str = APP, method: str = "POST", headers: str | None = None):
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        asked["Access-Control-Request-Headers"] = headers
    return await _request(server, "OPTIONS", path, **asked)


def _cors(headers) -> dict:
    return {name: value for name, value in headers.items() if name.lower().startswith("access-control-")}


def _exposed(headers) -> set[str]:
    return {name.strip() for name in headers["Access-Control-Expose-Headers"].split(",")}


# -- vLLM's defaults: any origin, method and header; no credentials ------------------------------------------
@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/models", "/v1/streaming_input/sessions/x/chunks",
                                  "/no/such/path"])
async def test_a_preflight_is_answered_on_every_path(server, path):
    """It was a 405 (`curl -X OPTIONS`); a path the server lacks is answered too, as Starlette answers it."""
    status, headers, body = await _preflight(server, path, headers="Authorization, Content-Type, X-Streaming-Input")
    assert (status, body) == (200, b"OK")
    assert _cors(headers) == {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": EVERY_METHOD,
                              "Access-Control-Max-Age": "600",
                              "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Streaming-Input"}
    assert "Vary" not in headers  # "*" does not vary with the origin


async def test_answers_carry_allow_origin_and_expose_what_clients_read(server):
    status, headers, _ = await _request(server, "GET", "/v1/models", Origin=APP)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert _exposed(headers) == {"Retry-After", "WWW-Authenticate", "Allow", REPLICA_HEADER}
    assert "Access-Control-Allow-Credentials" not in headers and "Vary" not in headers
    for method, path, data, expected in (("GET", "/no/such/path", None, 404), ("DELETE", "/v1/models", None, 405),
                                         ("POST", "/v1/streaming_input/sessions", b"{", 422)):
        status, headers, body = await _request(server, method, path, data, Origin=APP)
        assert status == expected and json.loads(body)["error"]["code"], body
        assert headers["Access-Control-Allow-Origin"] == "*", (method, path)


async def test_without_an_origin_no_cors_header_is_sent(server):
    for method, path in (("GET", "/v1/models"), ("GET", "/no/such/path"), ("GET", "/health")):
        _, headers, _ = await _request(server, method, path)
        assert _cors(headers) == {} and "Vary" not in headers, (method, path)
    # An OPTIONS that is no preflight (no Origin) is routed as any request: the routes take no OPTIONS.
    status, headers, _ = await _request(server, "OPTIONS", "/v1/models", **{"Access-Control-Request-Method": "GET"})
    assert status == 405 and _cors(headers) == {}


async def test_an_event_stream_carries_allow_origin(server, model, audio):
    buffer = io.BytesIO()
    soundfile.write(buffer, audio[:8000], 16000, format="WAV", subtype="PCM_16")
    form = aiohttp.FormData()
    form.add_field("file", buffer.getvalue(), filename="short.wav")
    form.add_field("model", model)
    form.add_field("stream", "true")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form,
                             headers={"Origin": APP}) as response:
            raw = await response.text()
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            assert response.headers["Access-Control-Allow-Origin"] == "*"
    assert raw.rstrip().endswith("data: [DONE]")


async def test_a_websocket_handshake_gets_no_cors_headers(server):
    """Browsers apply no CORS to WebSockets; the 101 stays as it was."""
    async with websockets.connect(server.url(), origin=APP) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        assert not any(name.lower().startswith("access-control-") for name in ws.response.headers)


# -- listed origins, methods and headers, with an API key ----------------------------------------------------
async def test_a_preflight_needs_no_key_and_the_request_still_does(keyed):
    status, headers, _ = await _preflight(keyed, "/v1/models", method="GET", headers="authorization")
    assert status == 200
    assert _cors(headers) == {"Access-Control-Allow-Origin": APP, "Access-Control-Allow-Methods": "GET, POST",
                              "Access-Control-Max-Age": "600", "Access-Control-Allow-Headers":
                                  "Accept, Accept-Language, Authorization, Content-Language, Content-Type"}
    assert headers["Vary"] == "Origin"
    status, _, _ = await _preflight(keyed, "/no/such/path")  # before the key, before routing
    assert status == 200
    status, headers, body = await _request(keyed, "GET", "/v1/models", Origin=APP)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"  # the page can read it
    assert "WWW-Authenticate" in _exposed(headers)
    status, headers, _ = await _request(keyed, "GET", "/v1/models", Origin=APP, Authorization=f"Bearer {KEY}")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"


async def test_an_options_request_that_is_no_preflight_needs_the_key(keyed):
    """A preflight is an OPTIONS with both Origin and Access-Control-Request-Method (the Fetch standard; Starlette's
    test): only it comes without the key. Any other OPTIONS is a request like the rest (a page's own
    `fetch(url, {method: "OPTIONS"})` follows its preflight, with the key), and no route takes OPTIONS. vLLM lets
    every OPTIONS past its key check only because that check runs before its CORS middleware."""
    for asked in ({"Origin": APP}, {"Access-Control-Request-Method": "GET"}):
        status, headers, body = await _request(keyed, "OPTIONS", "/v1/models", **asked)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", asked
        assert ("Access-Control-Allow-Origin" in headers) == ("Origin" in asked)  # the page can read why
        status, headers, _ = await _request(keyed, "OPTIONS", "/v1/models", Authorization=f"Bearer {KEY}", **asked)
        assert status == 405 and headers["Allow"] == "GET,HEAD", asked


@pytest.mark.parametrize("origin, method, asked, refused", [
    (OTHER, "POST", None, "origin"),
    (APP, "DELETE", None, "method"),
    (APP, "POST", "Authorization, X-Other", "headers"),
    (OTHER, "PUT", "X-Other", "origin, method, headers"),
])
async def test_a_preflight_outside_the_lists_is_refused(keyed, origin, method, asked, refused):
    status, headers, body = await _preflight(keyed, "/v1/audio/transcriptions", origin, method, asked)
    assert status == 400 and json.loads(body)["error"]["message"] == f"Disallowed CORS {refused}"
    assert ("Access-Control-Allow-Origin" in headers) == (origin == APP) and headers["Vary"] == "Origin"


async def test_a_refused_origin_gets_no_allow_origin(keyed):
    status, headers, _ = await _request(keyed, "GET", "/v1/models", Origin=OTHER, Authorization=f"Bearer {KEY}")
    assert status == 200 and _cors(headers) == {}
    assert headers["Vary"] == "Origin"  # a cache must not hand this answer to an allowed page


# -- credentials -----------------------------------------------------------------------------------------------
async def test_with_credentials_the_origin_is_named_never_star(engine):
    """A browser refuses "*" on a credentialed request, with or without a cookie."""
    credentialed = ServerThread(engine, ServerConfig(allow_credentials=True))
    try:
        status, headers, _ = await _preflight(credentialed, "/v1/models", method="GET")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
        assert headers["Access-Control-Allow-Credentials"] == "true" and headers["Vary"] == "Origin"
        status, headers, _ = await _request(credentialed, "GET", "/v1/models", Origin=OTHER)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == OTHER
        assert headers["Access-Control-Allow-Credentials"] == "true" and headers["Vary"] == "Origin"
    finally:
        credentialed.close()


async def test_preflights_do_not_count_against_a_keys_request_rate(engine):
    """Answered before the key's limits too; a 429's Retry-After is readable by the page."""
    limited = ServerThread(engine, ServerConfig(limits=Limits(max_requests_per_minute_per_key=1)))
    try:
        for _ in range(3):
            assert (await _preflight(limited, "/v1/models", method="GET"))[0] == 200
        assert (await _request(limited, "GET", "/v1/models", Origin=APP))[0] == 200
        status, headers, _ = await _request(limited, "GET", "/v1/models", Origin=APP)
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert headers["Access-Control-Allow-Origin"] == "*" and "Retry-After" in _exposed(headers)
    finally:
        limited.close()


# -- flags and TOML ----------------------------------------------------------------------------------------------
@pytest.fixture
def served_config(monkeypatch):
    """The ServerConfig `jaxstream serve` would serve with, captured instead of serving. `serve` sets the
    process's `jaxstream` logger to INFO, as a server logs: put back, since later tests in this worker read
    what the commands they run print."""
    seen = []

    async def capture(model, config, *_):
        seen.append(config)
        return 0

    monkeypatch.setattr(serve, "_serve", capture)
    logger = logging.getLogger("jaxstream")
    level = logger.level
    yield seen
    logger.setLevel(level)


def test_the_defaults_are_vllms(served_config):
    assert main(["serve"]) == 0
    config = served_config[0]
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials) == (
        ("*",), ("*",), ("*",), False)
    assert ServerConfig(**load_server_file("server").server) == ServerConfig()  # the preset lists every setting


def test_flags_take_json_lists_as_vllm_and_override_the_toml(served_config, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[server]\nallowed_origins = ["http://toml.example"]\nallowed_methods = ["GET"]\n'
                    'allow_credentials = true\n')
    assert main(["serve", "--config", str(path)]) == 0
    config = served_config[-1]
    assert (config.allowed_origins, config.allowed_methods, config.allow_credentials) == (
        ("http://toml.example",), ("GET",), True)
    assert main(["serve", "--config", str(path), "--allowed-origins", f'["{APP}", "http://localhost:3000"]',
                 "--allowed-headers", '["Authorization"]', "--no-allow-credentials"]) == 0
    config = served_config[-1]
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials) == (
        (APP, "http://localhost:3000"), ("GET",), ("Authorization",), False)


@pytest.mark.parametrize("flag, value", [
    ("--allowed-origins", "http://a.com"),
    # vLLM's json.loads takes a JSON string, and Starlette then matches methods against its characters.
    ("--allowed-methods", '"GET"'),
    ("--allowed-headers", '["Authorization", 1]'),
])
def test_a_flag_that_is_no_json_list_of_strings_is_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: expected a JSON list of strings" in capsys.readouterr().err


def test_an_origin_no_browser_sends_is_a_one_line_mistake(capsys):
    assert main(["serve", "--allowed-origins", '["http://a.com/"]']) == 2  # the trailing slash never matches
    err = capsys.readouterr().err
    assert "allowed origin 'http://a.com/' can never match" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("toml, message", [
    ('allowed_origins = "*"', "allowed_origins must be a list of non-empty strings, got '*'"),
    ("allowed_headers = [1]", "allowed_headers must be a list of non-empty strings, got [1]"),
    ('allowed_origins = ["app.example.com"]', "allowed origin 'app.example.com' can never match"),
    ('allow_credentials = "yes"', "allow_credentials must be true or false, got 'yes'"),
])
def test_toml_mistakes_are_one_line(tmp_path, capsys, toml, message):
    path = tmp_path / "s.toml"
    path.write_text(f"[server]\n{toml}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
