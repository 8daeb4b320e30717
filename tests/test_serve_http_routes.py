"""What `jaxstream serve` answers a request no route takes, driven over loopback by real clients (aiohttp, the
openai SDK, `websockets`): an unknown path is a 404 and a method a route does not take a 405 with its Allow header,
both in OpenAI's error shape as every other refusal (they were aiohttp's plain text "404: Not Found"), on every
path, /v1/... and the demo page's alike; a WebSocket route asked without an upgrade is a 426 saying what the route
is. With an API key, the key is checked first (as vLLM does, before routing): an unknown path is a 401 without
one, a 404 with it."""
import asyncio
import json

import aiohttp
import openai
import pytest
import websockets

from jaxstream.serving.app import WEBSOCKET_ROUTES
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import ERROR_STATUS, error_type
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine, engine_returns_to_baseline, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


async def answer(server, method: str, path: str, **kwargs) -> tuple[int, dict, dict]:
    """(status, headers, the JSON body's `error`) of one request; fails unless the body is OpenAI's error shape."""
    async with aiohttp.ClientSession() as http:
        async with http.request(method, server.url(path, "http"), **kwargs) as response:
            assert response.content_type == "application/json", await response.text()
            body = await response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == error_type(error["code"]) and error["message"], error
    return response.status, response.headers, error


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/nothing"), ("POST", "/v1/audio/translations"), ("GET", "/nothing"), ("GET", "/static/nope.js"),
    ("GET", "/v1/models/"), ("PUT", "/v1/streaming_input/sessions/abc/nothing"),
])
async def test_an_unknown_path_is_a_404_in_openai_shape(server, method, path):
    status, _, error = await answer(server, method, path)
    assert (status, error["code"], ERROR_STATUS["unknown_url"]) == (404, "unknown_url", 404)
    assert error["message"] == f"Unknown request URL: {method} {path}. Please check the URL for typos"


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/audio/transcriptions", "POST"), ("POST", "/v1/models", "GET,HEAD"), ("POST", "/health", "GET,HEAD"),
    ("DELETE", "/v1/streaming_input/sessions/abc/finish", "POST"), ("POST", "/", "GET,HEAD"),
    ("POST", "/v1/realtime", "GET,HEAD"),
])
async def test_a_method_a_route_does_not_take_is_a_405_with_allow(server, method, path, allowed):
    status, headers, error = await answer(server, method, path)
    assert (status, error["code"], headers["Allow"]) == (405, "method_not_allowed", allowed)
    assert method in error["message"] and path in error["message"]


@pytest.mark.parametrize("path", sorted(WEBSOCKET_ROUTES))
async def test_a_websocket_route_asked_without_an_upgrade_says_what_it_is(server, path):
    """A browser or curl GET of a WebSocket route got aiohttp's `No WebSocket UPGRADE hdr`, a plain-text 400."""
    status, headers, error = await answer(server, "GET", path)
    assert (status, error["code"], headers["Upgrade"]) == (426, "upgrade_required", "websocket")
    assert error["message"].startswith(f"{path} is {WEBSOCKET_ROUTES[path]}: connect to it with a WebSocket client")


async def test_a_handshake_aiohttp_refuses_is_answered_in_openai_shape(server):
    """An upgrade without `Connection: upgrade` is refused by aiohttp's handshake: its reason, in OpenAI's shape."""
    status, _, error = await answer(server, "GET", "/v1/realtime", headers={"Upgrade": "websocket",
                                                                            "Connection": "keep-alive"})
    assert (status, error["code"]) == (400, "invalid_request") and "upgrade" in error["message"].lower()


async def test_websocket_routes_still_upgrade(server):
    async with websockets.connect(server.url("/v1/realtime")) as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.created"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks translations so
def test_the_sdk_raises_not_found_with_openais_code(server):
    """OpenAI's SDK turns the 404 into NotFoundError with OpenAI's own body (`unknown_url`), as api.openai.com
    answers an unknown URL: a client of /v1/audio/translations, which this server does not serve, sees why."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.audio.translations.create(model="tiny", file=("a.wav", b"RIFF"))
    assert raised.value.body["code"] == "unknown_url" and "/v1/audio/translations" in raised.value.body["message"]


async def test_with_a_key_routing_errors_come_after_auth(engine):
    """vLLM checks its key before routing; so does this server: without a key an unknown path is a 401 like any
    route's, so that nobody learns the routes before authenticating. With the key it is the 404, and open paths
    (health) answer their 405 with no key."""
    server = ServerThread(engine, ServerConfig(api_keys=("secret",)))
    try:
        assert (await answer(server, "GET", "/v1/nothing"))[2]["code"] == "invalid_api_key"
        assert (await answer(server, "GET", "/v1/realtime"))[0] == 401
        keyed = {"headers": {"Authorization": "Bearer secret"}}
        assert (await answer(server, "GET", "/v1/nothing", **keyed))[0] == 404
        assert (await answer(server, "GET", "/v1/realtime", **keyed))[0] == 426
        assert (await answer(server, "POST", "/health"))[0] == 405
    finally:
        server.close()


async def test_routing_errors_are_counted_by_code(server):
    def count(code: str) -> float:
        return server.state.metrics.errors.labels(code=code)._value.get()

    before = count("unknown_url"), count("method_not_allowed")
    await answer(server, "GET", "/v1/nothing")
    await answer(server, "PUT", "/v1/models")
    assert (count("unknown_url"), count("method_not_allowed")) == (before[0] + 1, before[1] + 1)
