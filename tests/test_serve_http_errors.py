"""The `error` event that ends a streaming HTTP answer (specs/realtime_protocols.md §7, §8), typed as OpenAI
types errors: the client's own mistake is `invalid_request_error` (OpenAI's 4xx, and what a plain HTTP answer
to the same mistake says), the server's is `server_error` (an internal error, a shutdown, an engine that
refuses for its own reasons: OpenAI's 5xx, "overloaded" included). Each class of code on an audio stream
(`/v1/audio/transcriptions`, the realtime engine) and on a text stream (`/v1/completions`, the tiny Llama),
Mode A and Mode B, read over loopback as a client reads them."""
import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest

from jaxstream.errors import CapacityError, DrainingError, EngineDeadError
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_completions import TextInput
from jaxstream.serving.http_sessions import STREAMING_INPUT
from jaxstream.serving.http_transcriptions import AudioInput
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from test_serve_http import SESSIONS, call, read_sse
from test_serve_http_completions import text_engine_with_tokenizer

pytestmark = pytest.mark.slow

ROUTES = {"audio": "/v1/audio/transcriptions", "text": "/v1/completions"}
PARAMS = {"audio": {}, "text": {"max_tokens": 2, "temperature": 0}}
CLIENT, SERVER = "invalid_request_error", "server_error"


@pytest.fixture(scope="module")
def text_engine(tmp_path_factory):
    engine = text_engine_with_tokenizer(tmp_path_factory)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def text_server(text_engine):
    server = ServerThread(text_engine)
    yield server
    server.close()


@pytest.fixture(autouse=True)
async def text_engine_returns_to_baseline(text_engine):
    yield
    await wait_engine_baseline(text_engine)


@pytest.fixture(params=["audio", "text"])
def modality(request):
    return request.param


@pytest.fixture
def served(modality, engine, server, text_engine, text_server):
    """(engine, server) of the modality."""
    return (engine, server) if modality == "audio" else (text_engine, text_server)


def payload(modality: str, size: int | None = None) -> str:
    """A valid base64 chunk payload (of about `size` bytes): PCM16 silence (0.1 s), or words of the text model
    (two: a long prompt would end at once at the model's length)."""
    if modality == "audio":
        return encode_pcm16_base64(np.zeros((size or 3200) // 2, np.float32))
    return base64.b64encode(("w5 " * ((size or 6) // 3)).encode()).decode()


def mode_a_body(modality: str, model: str, *chunks: dict, **params) -> bytes:
    lines = [{"model": model, **PARAMS[modality], **params}, *chunks]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def _open_body(first: bytes):
    yield first
    await asyncio.sleep(60)  # the input stays open: the server ends the stream first


async def stream_error(response) -> dict:
    """The error event that ends an SSE answer (the event before [DONE])."""
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events, _ = await read_sse(response)
    assert events[-1][1] == "[DONE]" and events[-2][1].get("type") == "error", events[-3:]
    return events[-2][1]["error"]


async def mode_a_error(server, modality: str, body) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url(ROUTES[modality], "http"), data=body,
                             headers={"X-Streaming-Input": "true"}) as response:
            return await stream_error(response)


def session_body(modality: str, model: str) -> dict:
    return {"model": model, "modality": modality, "stream": True, "params": PARAMS[modality]}


# -- the client's mistakes --------------------------------------------------------------------------------------
async def test_a_bad_chunk_is_the_clients_error(modality, served):
    """A chunk that is not base64 (invalid_chunk; invalid_audio for audio, whose decoder reads it) ends a Mode A
    stream typed as the plain answer to the same chunk sent to a Mode B session, a 422. Audio typed it
    `server_error`."""
    _, server = served
    model = server.state.model_id
    error = await mode_a_error(server, modality, mode_a_body(modality, model, {"payload": payload(modality)},
                                                             {"payload": "%%"}))
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={**session_body(modality, model),
                                                                      "start_policy": "on_end_only"})
        status, plain = await call(http, server, "POST", f"{SESSIONS}/{created['session_id']}/chunks",
                                   json={"sequence_id": 0, "payload": "%%"})
    assert status == 422 and plain["error"]["code"] == error["code"] == {"audio": "invalid_audio",
                                                                         "text": "invalid_chunk"}[modality]
    assert error["type"] == plain["error"]["type"] == CLIENT


async def test_a_payload_over_the_cap_is_the_clients_error(modality, served):
    engine_, _ = served
    capped = ServerThread(engine_, ServerConfig(limits=Limits(max_payload_per_session=1000)))
    try:
        error = await mode_a_error(capped, modality, mode_a_body(modality, capped.state.model_id,
                                                                 {"payload": payload(modality, 3000)}))
    finally:
        capped.close()
    assert (error["code"], error["type"]) == ("payload_too_large", CLIENT)


async def test_a_mode_b_session_closed_for_want_of_chunks_is_the_clients_error(modality, served, monkeypatch):
    """The session is closed because its client sent nothing within the session timeout (the server's own
    limit, as an idle WebSocket): its event stream ends with `session_closed`, a 409 when the engine says
    it. It was typed `server_error` on both."""
    _, server = served
    monkeypatch.setattr(server.app[STREAMING_INPUT], "session_timeout_s", 0.5)
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json=session_body(modality, server.state.model_id))
        async with http.get(server.url(f"{SESSIONS}/{created['session_id']}/events", "http")) as response:
            error = await stream_error(response)
    assert (error["code"], error["type"]) == ("session_closed", CLIENT)


async def test_a_request_the_engine_refuses_is_the_clients_error(text_engine, text_server):
    """A request the engine refuses once it runs (min_tokens bans more EOS and stop ids than it supports):
    streamed, the error is typed as the plain answer to the same request, a 400 (it was `server_error`)."""
    request = {"model": text_server.state.model_id, "prompt": "w5 w17", "max_tokens": 4, "min_tokens": 1,
               "stop_token_ids": list(range(3, 40))}
    async with aiohttp.ClientSession() as http:
        status, plain = await call(http, text_server, "POST", "/v1/completions", json=request)
        async with http.post(text_server.url("/v1/completions", "http"), json={**request, "stream": True}) as response:
            error = await stream_error(response)
    assert status == 400 and error["code"] == plain["error"]["code"] == "invalid_request"
    assert error["type"] == plain["error"]["type"] == CLIENT


# -- the server's failures ---------------------------------------------------------------------------------------
async def test_an_internal_error_is_the_servers(modality, served, monkeypatch, caplog):
    _, server = served

    def broken(self, payload):
        raise RuntimeError("a bug")

    monkeypatch.setattr(AudioInput if modality == "audio" else TextInput, "decode", broken)
    with caplog.at_level("ERROR"):
        error = await mode_a_error(server, modality, mode_a_body(modality, server.state.model_id,
                                                                 {"payload": payload(modality)}))
    assert (error["code"], error["type"]) == ("server_error", SERVER)
    assert "reading a streaming-input body failed" in caplog.text


async def test_an_engine_refusing_for_its_own_reasons_is_the_servers(modality, served, monkeypatch):
    """An audio engine at its session limit, a text engine draining: the stream ends with the engine's code,
    a server_error (the plain answers are 503s)."""
    engine_, server = served
    if modality == "audio":
        async def refuse(*args, **kwargs):
            raise CapacityError("the engine holds all the sessions it can; try again later")

        monkeypatch.setattr(engine_, "start_transcription", refuse)
        code = "capacity"
    else:
        async def refuse(*args, **kwargs):
            raise DrainingError("the engine is draining: it takes no new sessions")
            yield

        monkeypatch.setattr(engine_, "generate", refuse)
        code = "draining"
    error = await mode_a_error(server, modality, mode_a_body(modality, server.state.model_id,
                                                             {"payload": payload(modality)}))
    assert (error["code"], error["type"]) == (code, SERVER)


async def test_a_mode_b_session_the_engine_refuses_for_good_ends_with_the_engines_code(modality, served,
                                                                                          monkeypatch):
    """An engine that died refuses a Mode B session's input for good: the session closes, and its event stream
    ends with `engine_dead`, the server's error (audio said `session_closed`, now the client's)."""
    engine_, server = served
    if modality == "audio":
        async def refuse(*args, **kwargs):
            raise EngineDeadError("the engine has stopped")

        monkeypatch.setattr(engine_, "start_transcription", refuse)
    else:
        async def refuse(*args, **kwargs):
            raise EngineDeadError("the engine has stopped")
            yield

        monkeypatch.setattr(engine_, "generate", refuse)
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json=session_body(modality, server.state.model_id))
        base = f"{SESSIONS}/{created['session_id']}"
        async with http.get(server.url(base + "/events", "http")) as events:
            status, answer = await call(http, server, "POST", base + "/chunks", json={
                "sequence_id": 0, "payload": payload(modality), "end_of_input": True})
            error = await stream_error(events)
    if modality == "audio":  # text generation runs behind the chunk's answer: only the stream hears of it
        assert status >= 500 and answer["error"]["code"] == "engine_dead", answer
    assert (error["code"], error["type"]) == ("engine_dead", SERVER)


async def test_a_shutdown_is_the_servers(modality, served):
    """A drain that runs out of time ends the open streams, Mode A and Mode B, with `server_shutdown`. The text
    stream typed it `invalid_request_error`; a Mode B session reported it as `session_closed`."""
    engine_, _ = served
    server = ServerThread(engine_)
    model = server.state.model_id
    try:
        async with aiohttp.ClientSession() as http:
            _, created = await call(http, server, "POST", SESSIONS, json=session_body(modality, model))
            body = _open_body(mode_a_body(modality, model, {"payload": payload(modality)}))
            async with http.post(server.url(ROUTES[modality], "http"), data=body,
                                 headers={"X-Streaming-Input": "true"}) as mode_a, \
                    http.get(server.url(f"{SESSIONS}/{created['session_id']}/events", "http")) as mode_b:
                # Both answers have begun: both streams are among the server's connections.
                await server.start_drain(0)
                errors = [await stream_error(mode_a), await stream_error(mode_b)]
    finally:
        server.close()
    assert [(e["code"], e["type"]) for e in errors] == [("server_shutdown", SERVER)] * 2
