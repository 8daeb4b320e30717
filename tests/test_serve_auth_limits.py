"""The realtime routes' API keys (each form a client can send one in, and the browser subprotocols every
realtime route, `/ws` too, selects) and connection limits (caps, idle and maximum-duration closes, audio caps, a
server whose model is still loading), driven over loopback by real `websockets` and aiohttp clients."""
import asyncio
import json

import aiohttp
import msgpack
import pytest
import websockets

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, ServerThread, wait_engine_baseline
from serve_fixtures import connected, expect_error
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


# -- auth -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(engine):
    server = ServerThread(engine, ServerConfig(api_keys=("k-1", "k-2")))
    yield server
    server.close()


@pytest.mark.parametrize("how", ["none", "wrong-bearer", "wrong-header", "wrong-query"])
async def test_a_missing_or_wrong_key_is_refused_at_the_handshake(keyed_server, how):
    url, headers = keyed_server.url(), {}
    if how == "wrong-bearer":
        headers = {"Authorization": "Bearer nope"}
    elif how == "wrong-header":
        headers = {"X-API-Key": "nope"}
    elif how == "wrong-query":
        url += "?api_key=nope"
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(url, additional_headers=headers)
    assert refused.value.response.status_code == 401
    with pytest.raises(websockets.InvalidStatus):
        await websockets.connect(keyed_server.url("/invocations-bidirectional-stream"), additional_headers=headers)


@pytest.mark.parametrize("how", ["bearer", "header", "query"])
async def test_a_right_key_is_accepted_in_each_form(keyed_server, how):
    url, headers = keyed_server.url(), {}
    if how == "bearer":
        headers = {"Authorization": "Bearer k-2"}
    elif how == "header":
        headers = {"X-API-Key": "k-1"}
    else:
        url += "?api_key=k-1"
    client = await RealtimeClient.connect(url, additional_headers=headers)
    assert client.created["type"] == "session.created"
    await client.close()


@pytest.mark.parametrize("beta", [False, True])
async def test_browser_subprotocols_carry_the_key_and_select_realtime(keyed_server, beta):
    """OpenAI's browser clients (no headers possible): the key as the subprotocol
    `openai-insecure-api-key.<key>`; the server selects `realtime` (never echoing the key) and speaks the
    OpenAI dialect, beta's when `openai-beta.realtime-v1` is offered too."""
    offered = ["realtime", "openai-insecure-api-key.k-2"] + (["openai-beta.realtime-v1"] if beta else [])
    async with websockets.connect(keyed_server.url(), subprotocols=offered) as ws:
        assert ws.subprotocol == "realtime" and ws.response.headers["Sec-WebSocket-Protocol"] == "realtime"
        created = json.loads(await ws.recv())
    assert created["type"] == ("transcription_session.created" if beta else "session.created")
    assert created["session"]["object"] == "realtime.transcription_session"


async def test_browser_subprotocols_select_vllm_realtime_for_vllms_protocol(keyed_server):
    """vLLM's protocol names no subprotocol, and a browser fails a handshake that selects none of those it
    offered: the demo page offers `vllm-realtime` next to its key, the server selects it (never the key) and
    speaks vLLM's protocol."""
    offered = ["vllm-realtime", "openai-insecure-api-key.k-2"]
    async with websockets.connect(keyed_server.url(), subprotocols=offered) as ws:
        assert ws.subprotocol == "vllm-realtime"
        assert ws.response.headers["Sec-WebSocket-Protocol"] == "vllm-realtime"
        created = json.loads(await ws.recv())
    assert created["type"] == "session.created" and "session" not in created  # vLLM's shape, not OpenAI's


KEY_SUBPROTOCOL = "openai-insecure-api-key.k-2"


@pytest.mark.parametrize("path, offered, selected, speaks", [
    ("/v1/realtime", ["realtime", KEY_SUBPROTOCOL], "realtime", "openai"),
    ("/v1/realtime", ["vllm-realtime", KEY_SUBPROTOCOL], "vllm-realtime", "vllm"),
    ("/v1/realtime", [KEY_SUBPROTOCOL], None, "vllm"),
    ("/invocations-bidirectional-stream", ["vllm-realtime", KEY_SUBPROTOCOL], "vllm-realtime", "vllm"),
    ("/invocations-bidirectional-stream", ["realtime", KEY_SUBPROTOCOL], None, "vllm"),
    ("/invocations-bidirectional-stream", [KEY_SUBPROTOCOL], None, "vllm"),
    ("/ws", ["vllm-realtime", KEY_SUBPROTOCOL], "vllm-realtime", "envelope"),
    ("/ws", ["realtime", KEY_SUBPROTOCOL], None, "envelope"),
    ("/ws", [KEY_SUBPROTOCOL], None, "envelope"),
])
async def test_each_route_selects_the_subprotocol_naming_what_it_speaks(keyed_server, path, offered, selected,
                                                                        speaks):
    """A browser sends its key as a subprotocol and fails a handshake that selects none of those it offered (the
    WHATWG WebSockets standard: offered protocols and no `Sec-WebSocket-Protocol` back fail the connection). Every
    route takes the key so, and selects `vllm-realtime` for the server's own protocols: `/v1/realtime` did,
    SageMaker's route and `/ws` selected nothing, so a browser could not use them with the key. `realtime` (OpenAI's
    dialect) is selected only where OpenAI's dialect is spoken, and the key is never selected (echoed)."""
    async with websockets.connect(keyed_server.url(path), subprotocols=offered) as ws:
        assert ws.subprotocol == selected
        assert ws.response.headers.get("Sec-WebSocket-Protocol") == selected
        created = json.loads(await asyncio.wait_for(ws.recv(), 30))
    assert created["type"] == "session.created", created  # the key was taken: the route admitted the client
    shape = "envelope" if "payload" in created else "openai" if "session" in created else "vllm"
    assert shape == speaks, created


@pytest.mark.parametrize("offered", [["realtime", "openai-insecure-api-key.nope"], ["realtime"],
                                     ["realtime", "openai-insecure-api-key."]])
async def test_a_wrong_subprotocol_key_is_refused_at_the_handshake(keyed_server, offered):
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(keyed_server.url(), subprotocols=offered)
    assert refused.value.response.status_code == 401


async def test_api_paths_need_the_key_and_health_does_not(keyed_server):
    async with aiohttp.ClientSession() as http:
        async with http.get(keyed_server.url("/v1/models", "http")) as response:
            # OpenAI's answer to a bad key (it typed it authentication_error, a type OpenAI's API does not send).
            assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
            error = (await response.json())["error"]
            assert (error["code"], error["type"]) == ("invalid_api_key", "invalid_request_error"), error
        async with http.get(keyed_server.url("/v1/models", "http"), headers={"Authorization": "Bearer k-1"}) as r:
            assert r.status == 200
        for path in ("/health", "/healthz", "/ping", "/metrics"):
            async with http.get(keyed_server.url(path, "http")) as response:
                assert response.status == 200


# -- limits -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited_server(engine):
    limits = Limits(max_connections=2, max_audio_seconds=3.0, max_pending_seconds=1.0, max_append_seconds=1.0,
                    max_message_bytes=1 << 20)
    server = ServerThread(engine, ServerConfig(limits=limits))
    yield server
    server.close()


@pytest.fixture(scope="module")
def deadline_server(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(idle_timeout_s=0.6, max_session_seconds=2.0)))
    yield server
    server.close()


async def no_connections(server):
    for _ in range(500):
        if not server.state.connections:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("connections stay open")


async def closed_with(client, code, error_code):
    event = await client.event(10)
    assert event["type"] == "error" and event["code"] == error_code, event
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await client.event(10)
    assert closed.value.rcvd.code == code
    return closed.value.rcvd.reason


async def test_connection_cap(limited_server):
    first = await RealtimeClient.connect(limited_server.url())
    second = await RealtimeClient.connect(limited_server.url())
    third = await RealtimeClient.connect(limited_server.url())
    assert first.created["type"] == second.created["type"] == "session.created"
    assert third.created["type"] == "error" and third.created["code"] == "capacity"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await third.event(10)
    assert closed.value.rcvd.code == 4002
    await first.close()
    await second.close()
    await no_connections(limited_server)


async def test_idle_connection_is_closed_and_its_utterance_freed(deadline_server, model, audio, engine):
    client = await connected(deadline_server, model)
    await client.commit()
    await client.append(audio[:8000])
    reason = await closed_with(client, 4000, "idle_timeout")
    assert "idle" in reason.lower() or "No message" in reason
    await wait_engine_baseline(engine)


async def test_maximum_duration(deadline_server, model):
    client = await connected(deadline_server, model)
    for _ in range(40):  # active all along: only the duration can end it
        try:
            await client.send({"type": "probe"})
            event = await client.event(10)
        except websockets.ConnectionClosed as closed:
            assert closed.rcvd.code == 4003
            return
        if event["code"] == "max_duration_exceeded":
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await client.event(10)
            assert closed.value.rcvd.code == 4003
            return
        await asyncio.sleep(0.1)
    pytest.fail("the connection outlived max_session_seconds")


async def test_audio_caps(limited_server, model, audio):
    client = await connected(limited_server, model)
    await client.append(audio[:12000])
    await client.append(audio[:6000])  # 0.75 s + 0.375 s outside an utterance: over max_pending_seconds
    await expect_error(client, "audio_limit_exceeded", "commit")
    await client.commit()
    for _ in range(3):  # 0.75 s pending + 3 x 0.75 s: the fourth second goes over max_audio_seconds
        await client.append(audio[:12000])
    await client.append(audio[:12000])
    await expect_error(client, "audio_limit_exceeded", "limit")
    await client.commit(final=True)  # what was accepted is still transcribed
    await client.until("transcription.done")
    await client.close()
    await no_connections(limited_server)


async def test_every_websocket_route_refuses_while_the_model_loads():
    """Until the engine is built, each WebSocket route answers its own protocol's error (code not_ready) and
    closes with 1013 (try again later); the OpenAI dialect's connection used to fail before it (no engine
    to name the model by) and was dropped without a close frame."""
    import threading

    from aiohttp.test_utils import TestServer

    from jaxstream.serving import envelope, kyutai
    from jaxstream.serving.app import create_app

    built = threading.Event()

    def slow_engine():
        built.wait(60)
        raise RuntimeError("not built in this test")

    server = TestServer(create_app(engine_factory=slow_engine))
    await server.start_server()
    try:
        routes = ["/v1/realtime", "/v1/realtime?intent=transcription", "/invocations-bidirectional-stream",
                  envelope.ROUTE, kyutai.ROUTE]
        for route in routes:
            async with websockets.connect(str(server.make_url(route)).replace("http", "ws", 1)) as ws:
                frame = await asyncio.wait_for(ws.recv(), 10)  # Kyutai's protocol is msgpack, the others JSON
                error = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
                assert "The model is still loading" in json.dumps(error), (route, error)
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013, route
        async with aiohttp.ClientSession() as http:  # and the HTTP routes with OpenAI's error shape
            async with http.get(server.make_url("/v1/models")) as response:
                assert response.status == 503 and int(response.headers["Retry-After"]) >= 1
                error = (await response.json())["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == "not_ready"
    finally:
        built.set()
        await server.close()


def test_an_engine_built_after_the_server_stopped_is_closed(monkeypatch):
    """Ctrl-C while the model loads: the event loop is gone by the time the build thread finishes. The
    engine it built is closed (nobody will serve with it), and the thread ends without an error."""
    import threading

    from aiohttp.test_utils import TestServer

    from jaxstream.serving.app import create_app

    release, closed, thread_errors = threading.Event(), threading.Event(), []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    class Built:
        def close(self):
            closed.set()

    def slow_engine():
        release.wait(60)
        return Built()

    async def start_and_stop():
        server = TestServer(create_app(engine_factory=slow_engine))
        await server.start_server()
        await server.close()

    earlier = set(threading.enumerate())  # an earlier test's build thread may still be finishing
    asyncio.run(start_and_stop())  # returns with its event loop closed, the build still running
    [builder] = [t for t in threading.enumerate() if t.name == "jaxstream-engine-build" and t not in earlier]
    release.set()
    builder.join(10)
    assert closed.is_set() and not thread_errors
