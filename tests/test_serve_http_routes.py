"""What `jaxstream serve` answers a request no route takes, driven over loopback by real clients (aiohttp, the
openai SDK, `websockets`, a raw socket): an unknown path is a 404 and a method a route does not take a 405 with its
Allow header, both in OpenAI's error shape as every other refusal (they were aiohttp's plain text "404: Not Found"),
on every path, /v1/... and the demo page's alike; a WebSocket route asked without an upgrade is a 426 saying what
the route is, and a handshake aiohttp refuses says which header it lacks. With an API key, the key is checked first
(as vLLM does, before routing): an unknown path is a 401 without one, a 404 with it. Routing refusals are counted
apart from the server's errors."""
import asyncio
import json
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

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


async def raw_get(server, path: str, headers) -> tuple[int, dict | None]:
    """(status, the JSON body's `error`; None for 101 Switching Protocols) of a GET sent over a plain socket with
    exactly `headers` (a dict, or (name, value) pairs where a name repeats; a client library adds its own,
    Connection among them); fails unless the body is OpenAI's error shape."""
    url = urlsplit(server.url(path, "http"))
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    pairs = headers.items() if isinstance(headers, dict) else headers
    try:
        lines = [f"GET {path} HTTP/1.1", f"Host: {url.netloc}", *(f"{k}: {v}" for k, v in pairs)]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode().split("\r\n")
        status = int(head[0].split()[1])
        if status == 101:
            return status, None
        fields = dict(line.split(": ", 1) for line in head[1:] if line)
        body = json.loads(await reader.readexactly(int(fields["Content-Length"])))
    finally:
        writer.close()
    assert fields["Content-Type"].startswith("application/json") and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type(error["code"]), error
    return status, error


KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455's sample key: 16 bytes in base64
UPGRADE = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": KEY}


def handshake(*dropped: str, **changed: str) -> dict[str, str]:
    """UPGRADE, a valid handshake's headers, less `dropped`, with `changed`."""
    return {k: v for k, v in {**UPGRADE, **changed}.items() if k not in dropped}


@pytest.mark.parametrize("headers, fault", [
    (handshake("Connection"), "lacks the header `Connection: Upgrade` (it has no Connection header)"),
    (handshake(Connection="keep-alive"), "lacks the header `Connection: Upgrade` (its Connection is 'keep-alive')"),
    (handshake("Sec-WebSocket-Version"), "needs the header `Sec-WebSocket-Version: 13` (it has no "
                                         "Sec-WebSocket-Version header)"),
    (handshake(**{"Sec-WebSocket-Version": "12"}), "needs the header `Sec-WebSocket-Version: 13` (its "
                                                   "Sec-WebSocket-Version is '12')"),
    (handshake("Sec-WebSocket-Key"), "needs the header `Sec-WebSocket-Key`: 16 random bytes in base64, new for each "
                                     "connection (it has no Sec-WebSocket-Key header)"),
    (handshake(**{"Sec-WebSocket-Key": "c2hvcnQ="}), "needs the header `Sec-WebSocket-Key`: 16 random bytes in "
                                                    "base64, new for each connection (its Sec-WebSocket-Key is "
                                                    "'c2hvcnQ=')"),
    (handshake(**{"Sec-WebSocket-Key": "clé"}), "needs the header `Sec-WebSocket-Key`: 16 random bytes in base64, "
                                               "new for each connection (its Sec-WebSocket-Key is 'clé')"),
])
async def test_a_handshake_aiohttp_refuses_says_which_header_it_lacks(server, headers, fault):
    """aiohttp refuses these handshakes with a 400 whose text was its own: "No CONNECTION upgrade hdr: None",
    "Unsupported version: 12", "Handshake error: None"; a key that is not ASCII was a plain-text 500 and a traceback
    logged as the server's failure. Each is a 400 whose message names the header (a person reads it, often behind
    a proxy that dropped the Connection header)."""
    status, error = await raw_get(server, "/v1/realtime", headers)
    assert (status, error["code"]) == (400, "invalid_request")
    assert error["message"].startswith(f"The WebSocket handshake for /v1/realtime {fault}"), error["message"]


@pytest.mark.parametrize("path", sorted(WEBSOCKET_ROUTES))
async def test_every_websocket_route_words_a_refused_handshake(server, path):
    status, error = await raw_get(server, path, handshake("Connection"))
    assert (status, error["code"]) == (400, "invalid_request")
    assert error["message"].startswith(f"The WebSocket handshake for {path} lacks the header `Connection: Upgrade`")
    assert (await raw_get(server, path, UPGRADE))[0] == 101  # with the header, the same handshake is taken


async def test_a_connection_header_split_over_lines_is_one_header(server):
    """`Connection: keep-alive` and `Connection: Upgrade` on two lines is one header (RFC 9110 5.3), which aiohttp
    takes: the handshake check read only the first line and refused it."""
    pairs = [*handshake("Connection").items(), ("Connection", "keep-alive"), ("Connection", "Upgrade")]
    assert (await raw_get(server, "/v1/realtime", pairs))[0] == 101


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


async def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, its labels): value} of the server's /metrics, read with prometheus_client's own parser."""
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url("/metrics", "http")) as response:
            assert response.status == 200
            text = await response.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def test_routing_errors_are_counted_apart_from_the_servers_errors(server):
    """A 404, 405 or 426 is counted in jaxstream_http_routing_errors_total by status and code, and not in
    jaxstream_errors_total, which operators alert on: a scanner probing URLs made it look like a failing server."""
    def routing(status: str, code: str) -> tuple[str, tuple]:
        return "jaxstream_http_routing_errors_total", (("code", code), ("status", status))

    refusals = [("404", "unknown_url"), ("405", "method_not_allowed"), ("426", "upgrade_required")]
    before = await scrape(server)
    await answer(server, "GET", "/v1/nothing")
    await answer(server, "GET", "/wp-login.php")
    await answer(server, "PUT", "/v1/models")
    await answer(server, "GET", "/ws")
    after = await scrape(server)
    counted = {refusal: after.get(routing(*refusal), 0) - before.get(routing(*refusal), 0) for refusal in refusals}
    assert counted == {("404", "unknown_url"): 2, ("405", "method_not_allowed"): 1, ("426", "upgrade_required"): 1}
    assert not [key for key in after if key[0] == "jaxstream_errors_total" and dict(key[1])["code"] in
                dict(refusals).values()], after


async def test_the_sdk_retrieves_the_served_model_and_is_told_of_another(server):
    """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`, which clients call to check a model): the
    served model's entry, as /v1/models lists it; another id is a 404 `model_not_found` naming the served one."""
    client = openai.AsyncOpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    model_id = server.state.model_id
    (listed,) = (await client.models.list()).data
    assert (await client.models.retrieve(model_id)).model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as refused:
        await client.models.retrieve("org/other-model")
    error = refused.value.body
    assert error["code"] == "model_not_found" and "`org/other-model`" in error["message"], error
    assert model_id in error["message"], error
