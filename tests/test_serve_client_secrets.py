"""Ephemeral client secrets (serving/client_secrets.py): minted with the openai SDK's own calls (GA
`client.realtime.client_secrets.create`, beta `client.beta.realtime.transcription_sessions.create`), used as a
browser uses them (the `openai-insecure-api-key.` subprotocol) and as the SDK does (Bearer), refused wherever they
are not a key, and counted against the minting key's limits."""
import asyncio
import time

import aiohttp
import openai
import pytest
import websockets

from jaxstream.serving.client_secrets import ClientSecrets
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.limits import Limits
from jaxstream.serving.openai_session_config import LOGPROBS
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from serve_openai_fixtures import Client, at_24k, pcm_base64, transcripts
from serve_openai_fixtures import reference, speech  # noqa: F401 - pytest fixtures

KEY = "sk-server-key"
SESSION = {"type": "transcription", "include": [LOGPROBS], "audio": {"input": {
    "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"delay": "medium", "language": "en"}}}}


@pytest.fixture(scope="module")
def keyed(engine):
    """A server with an API key and one stream per key."""
    server = ServerThread(engine, ServerConfig(api_keys=(KEY,), limits=Limits(max_streams_per_key=1)))
    yield server
    server.close()


def sdk(server, key=KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=key, base_url=server.url("/v1", "http"), websocket_base_url=server.url("/v1"),
                              max_retries=0, timeout=30)


async def mint(server, **body):
    client = sdk(server)
    try:
        return await client.realtime.client_secrets.create(**body)
    finally:
        await client.close()


async def post(server, path: str, body, key=KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url(path, "http"), data=body if isinstance(body, str) else None,
                                json=None if isinstance(body, str) else body, headers=headers) as response:
            return response.status, await response.json()


async def handshake_status(server, key: str, path: str = "/v1/realtime") -> int:
    """The HTTP status a WebSocket handshake with `key` (as a browser offers it) is refused with."""
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(server.url(path), subprotocols=["realtime", f"openai-insecure-api-key.{key}"])
    return refused.value.response.status_code


async def test_a_browser_connects_with_a_minted_secret_and_starts_in_its_session(keyed, model, speech, reference):
    before = time.time()
    secret = await mint(keyed, expires_after={"anchor": "created_at", "seconds": 120}, session=SESSION)
    assert secret.value.startswith("ek_") and before + 119 <= secret.expires_at <= time.time() + 121
    minted = secret.session
    assert minted.type == "transcription" and minted.include == [LOGPROBS]
    assert (minted.audio.input.transcription.delay, minted.audio.input.transcription.model) == ("medium", model)

    # No intent, model or OpenAI subprotocol in the handshake: the secret alone says which dialect.
    ws = await websockets.connect(keyed.url(), subprotocols=[f"openai-insecure-api-key.{secret.value}"],
                                  max_size=None)
    client = Client(ws)
    try:
        created = await client.event()
        assert created["type"] == "session.created"
        session = created["session"]
        assert session["include"] == [LOGPROBS] and session["audio"] == minted.audio.model_dump(exclude_unset=True)
        for chunk in pcm_base64(at_24k(speech), 24000):
            await client.send({"type": "input_audio_buffer.append", "audio": chunk})
        await client.send({"type": "input_audio_buffer.commit"})
        events = await client.until("conversation.item.input_audio_transcription.completed")
    finally:
        await ws.close()
    [text] = transcripts(events).values()
    assert text == reference and events[-1]["logprobs"]  # the secret's session includes logprobs


async def test_the_sdk_connects_with_a_secret_as_its_key_and_may_change_the_session(keyed, model):
    secret = await mint(keyed, session=SESSION)
    assert secret.expires_at - time.time() == pytest.approx(600, abs=2)  # OpenAI's default lifetime
    client = sdk(keyed, key=secret.value)
    try:
        async with client.realtime.connect(model=model) as conn:
            created = await conn.recv()
            assert created.session.audio.input.transcription.delay == "medium"
            await conn.recv()  # rate_limits.updated
            await conn.session.update(session={"type": "transcription", "include": []})
            updated = await conn.recv()
            assert updated.type == "session.updated" and updated.session.include == []
            assert updated.session.audio.input.transcription.delay == "medium"
    finally:
        await client.close()


async def test_a_secret_opens_nothing_else_and_dies_at_its_expiry(keyed):
    secret = (await mint(keyed, expires_after={"seconds": 10})).value
    assert (await post(keyed, "/v1/realtime/client_secrets", {}, key=secret))[0] == 401  # it mints nothing
    status, body = await post(keyed, "/v1/audio/transcriptions", {}, key=secret)
    assert status == 401 and "/v1/realtime" in body["error"]["message"]
    assert await handshake_status(keyed, secret, "/invocations-bidirectional-stream") == 401
    async with websockets.connect(keyed.url("/ws") + f"?api_key={secret}") as ws:  # /ws answers after the upgrade
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 30)
    assert closed.value.rcvd.code == 4001
    assert await handshake_status(keyed, "ek_" + "x" * 32) == 401
    store = keyed.state.client_secrets
    clock = store._clock
    store._clock = lambda: clock() + 10
    try:
        assert await handshake_status(keyed, secret) == 401
    finally:
        store._clock = clock
    assert store.lookup(secret) is None  # forgotten once expired, the clock put back or not


async def test_a_secret_that_expires_just_after_the_handshake_check_still_opens_its_session(keyed):
    secret = (await mint(keyed, expires_after={"seconds": 10}, session=SESSION)).value
    store = keyed.state.client_secrets
    clock, looked_up = store._clock, []

    def expiring() -> float:  # live at the first look, expired at any later one
        looked_up.append(True)
        return clock() + (0 if len(looked_up) == 1 else 10)

    store._clock = expiring
    try:
        async with websockets.connect(keyed.url(), subprotocols=[f"openai-insecure-api-key.{secret}"]) as ws:
            created = await Client(ws).event()
    finally:
        store._clock = clock
    assert created["type"] == "session.created" and created["session"]["include"] == [LOGPROBS]


async def test_sessions_a_secret_opens_count_against_the_key_that_minted_it(keyed):
    secret = (await mint(keyed)).value
    ws = await websockets.connect(keyed.url(), subprotocols=[f"openai-insecure-api-key.{secret}"])
    try:
        assert (await Client(ws).event())["type"] == "session.created"
        assert await handshake_status(keyed, secret) == 429  # the key's one stream is taken
        assert await handshake_status(keyed, KEY) == 429  # by the key's own secret
    finally:
        await ws.close()


@pytest.mark.parametrize("body,status,param", [
    ({"expires_after": {"seconds": 5}}, 400, "expires_after.seconds"),
    ({"expires_after": {"seconds": 7201}}, 400, "expires_after.seconds"),
    ({"expires_after": {"seconds": 60.5}}, 400, "expires_after.seconds"),
    ({"expires_after": {"anchor": "now"}}, 400, "expires_after.anchor"),
    ({"expires_after": 60}, 400, "expires_after"),
    ({"session": {"type": "realtime"}}, 400, "session.type"),
    ({"session": {"type": "transcription", "audio": {"input": {"format": {"type": "audio/mp3"}}}}}, 400,
     "session.audio.input.format"),
    ({"session": {"type": "transcription", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}, 404,
     "session.audio.input.transcription.model"),
    ({"session": "transcription"}, 400, "session"),
    ("{not json", 400, None),
])
async def test_bad_mint_requests_are_4xx_naming_the_field(keyed, body, status, param):
    live = len(keyed.state.client_secrets)
    got, answer = await post(keyed, "/v1/realtime/client_secrets", body)
    assert (got, answer["error"]["param"]) == (status, param), answer
    assert len(keyed.state.client_secrets) == live


async def test_minting_needs_the_servers_key(keyed):
    assert (await post(keyed, "/v1/realtime/client_secrets", {}, key="sk-wrong"))[0] == 401
    assert (await post(keyed, "/v1/realtime/client_secrets", {}, key=None))[0] == 401


async def test_beta_transcription_sessions_mint_a_one_minute_secret_for_the_beta_dialect(keyed, model):
    client = sdk(keyed)
    try:
        minted = await client.beta.realtime.transcription_sessions.create(
            input_audio_format="g711_ulaw", input_audio_transcription={"model": model, "language": "en"},
            turn_detection={"type": "server_vad", "silence_duration_ms": 400})
    finally:
        await client.close()
    assert minted.client_secret.value.startswith("ek_") and minted.input_audio_format == "g711_ulaw"
    assert minted.client_secret.expires_at - time.time() == pytest.approx(60, abs=2)
    assert minted.turn_detection.silence_duration_ms == 400
    ws = await websockets.connect(keyed.url(), subprotocols=[f"openai-insecure-api-key.{minted.client_secret.value}"])
    try:
        created = await Client(ws).event()
    finally:
        await ws.close()
    assert created["type"] == "transcription_session.created"
    assert created["session"]["input_audio_format"] == "g711_ulaw"
    assert created["session"]["turn_detection"]["silence_duration_ms"] == 400


async def test_a_server_without_keys_mints_and_refuses_secrets_it_does_not_know(server):
    status, secret = await post(server, "/v1/realtime/client_secrets", {"session": SESSION}, key=None)
    assert status == 200 and secret["session"]["include"] == [LOGPROBS]
    ws = await websockets.connect(server.url(), subprotocols=[f"openai-insecure-api-key.{secret['value']}"])
    try:
        assert (await Client(ws).event())["session"]["include"] == [LOGPROBS]
    finally:
        await ws.close()
    assert await handshake_status(server, "ek_unknown") == 401


def test_live_secrets_are_bounded_and_expired_ones_make_room():
    now = [1000.0]
    store = ClientSecrets(clock=lambda: now[0], capacity=2)
    first = store.mint(10, {}, beta=False, owner="key:a")[0]
    store.mint(30, {}, beta=True, owner="key:a")
    with pytest.raises(RequestError) as full:
        store.mint(10, {}, beta=False, owner="key:b")
    assert (full.value.status, full.value.retry_after) == (429, 10)
    assert store.lookup(first).owner == "key:a"
    now[0] += 10
    assert store.lookup(first) is None  # expired at its second
    value, expires_at = store.mint(10, {}, beta=False, owner="key:b")
    assert expires_at == 1020 and store.lookup(value).owner == "key:b" and len(store) == 2
