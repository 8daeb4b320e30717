"""A draining server (SIGTERM: app.drain) that ends a stream's input itself says so: an `error` `server_draining`,
naming the seconds of audio the output covers, comes after the last delta and before the done (vLLM's protocol in
strict mode, /ws) or before the output's end (HTTP streaming input); `--compat vllm` sends what vLLM would, the done
only. Before, the done came as if the client had ended the audio: a transcript cut at 28.6 s of a 58.7 s file looked
complete. Audio a client appends after the drain ended its utterance is dropped, not held for an utterance that will
never start (held, it reached max_pending_seconds and was answered with audio_limit_exceeded). The OpenAI dialect's
and Kyutai's drain tests are in their own modules (test_serve_openai.py, test_serve_kyutai.py).

The oracle of each transcript is the engine's own for the audio the server says it received, as sent (PCM16)."""
import asyncio
import contextlib
import json

import aiohttp
import numpy as np
import pytest
import websockets

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.app import drain
from jaxstream.serving.audio_codecs import decode_pcm16_base64, encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, ServerThread
from serve_fixtures import audio, engine, engine_returns_to_baseline  # noqa: F401 - pytest fixtures
from test_serve_http import parse_sse

pytestmark = pytest.mark.slow

PIECE = SAMPLING_RATE // 2  # samples per append
# A client sending faster than real time, as a file client does: between the drain's end of its utterance and the
# done (the engine computes the audio it had queued) appends keep coming, and they must not be answered.
SPEEDUP = 8
# Under one append: a client whose appends the drain's server held for a later utterance was refused at once.
PENDING_LIMIT = Limits(max_pending_seconds=0.25)
DRAIN_S = 8.0  # the drain ends running inputs itself half-way (app.drain keeps the rest for their flush)


def as_sent(pcm: np.ndarray) -> np.ndarray:
    return decode_pcm16_base64(encode_pcm16_base64(pcm), max_samples=pcm.size)


def start_drain(server, timeout: float = DRAIN_S):
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(server.app, timeout), server.loop))


async def send_until_closed(send, audio: np.ndarray, sent: list) -> None:
    """Sends `audio` in PIECEs, over and over, at SPEEDUP times real time (the engine's backpressure may slow it
    more), until the socket closes; `sent` gets each piece whose send completed."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            for begin in range(0, audio.size, PIECE):
                await send(audio[begin:begin + PIECE])
                sent.append(audio[begin:begin + PIECE])
                await asyncio.sleep(PIECE / SAMPLING_RATE / SPEEDUP)


async def events_until_closed(receive) -> tuple[list, int]:
    """(every event until the server closes, the close code)."""
    events = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            events.append(await receive())
    return events, closed.value.rcvd.code


async def check_covered(engine, sent: list, seconds: float, text: str) -> None:
    """The transcript `text` is the engine's for the first `seconds` of what was sent, and later audio was sent."""
    stream = as_sent(np.concatenate(sent))
    received = round(seconds * SAMPLING_RATE)
    assert 0 < received <= stream.size, (received, stream.size)
    assert text == (await engine.transcribe(stream[:received])).text


# -- vLLM's protocol ------------------------------------------------------------------------------------------
async def test_vllm_drain_notice_comes_between_the_last_delta_and_the_done(engine, audio):
    """The client streams without end (never a final commit): the drain ends the utterance, and the event before
    its done is the notice; the audio the client goes on sending is dropped without an error."""
    server = ServerThread(engine, ServerConfig(limits=PENDING_LIMIT))
    try:
        client = await RealtimeClient.connect(server.url())
        await client.update(server.state.model_id)
        assert (await client.event())["type"] == "session.updated"
        await client.commit()
        sent = []
        sender = asyncio.create_task(send_until_closed(client.append, audio, sent))
        first = await client.event()
        assert first["type"] == "transcription.delta", first  # the utterance runs: the drain waits for it
        draining = start_drain(server)
        events, code = await events_until_closed(client.event)
        await sender
        events.insert(0, first)
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in events]
        assert kinds[-2:] == ["error", "transcription.done"] and set(kinds[:-2]) == {"transcription.delta"}, kinds
        notice, done = events[-2:]
        seconds = done["usage"]["audio_seconds"]
        assert notice["code"] == "server_draining" and f"the first {seconds:.2f} s of audio" in notice["error"]
        assert "".join(event["delta"] for event in events[:-2]) == done["text"]
        await check_covered(engine, sent, seconds, done["text"])
    finally:
        server.close()


async def test_vllm_compat_drain_sends_only_what_vllm_sends(engine, audio):
    """vLLM has no such notice: `--compat vllm` ends the utterance with its done alone, in vLLM's shape."""
    server = ServerThread(engine, ServerConfig(compat="vllm"))
    try:
        client = await RealtimeClient.connect(server.url())
        await client.update(server.state.model_id)  # vLLM answers nothing
        await client.commit()
        await client.append(audio[:2 * SAMPLING_RATE])
        first = await client.event()
        assert first["type"] == "transcription.delta", first
        draining = start_drain(server)
        events, code = await events_until_closed(client.event)
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in [first, *events]]
        assert kinds[-1] == "transcription.done" and set(kinds[:-1]) == {"transcription.delta"}, kinds
        assert set(events[-1]) == {"type", "text", "usage"}
    finally:
        server.close()


# -- /ws ------------------------------------------------------------------------------------------------------
async def test_envelope_drain_notice_carries_the_utterances_ids_and_seconds(engine, audio):
    server = ServerThread(engine, ServerConfig(limits=PENDING_LIMIT))
    try:
        ws = await websockets.connect(server.url("/ws"), max_size=None)

        async def send(kind: str, payload: dict) -> None:
            await ws.send(json.dumps({"type": kind, "session_id": "s1", "request_id": "u", "payload": payload}))

        async def receive() -> dict:
            return json.loads(await asyncio.wait_for(ws.recv(), 60))

        assert (await receive())["type"] == "session.created"
        await send("input_audio_buffer.commit", {"final": False})
        sent = []
        sender = asyncio.create_task(send_until_closed(
            lambda pcm: send("input_audio_buffer.append", {"audio": encode_pcm16_base64(pcm)}), audio, sent))
        first = await receive()
        assert first["type"] == "transcription.delta", first
        draining = start_drain(server)
        events, code = await events_until_closed(receive)
        await sender
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in [first, *events]]
        assert kinds[-2:] == ["error", "transcription.done"] and set(kinds[:-2]) == {"transcription.delta"}, kinds
        notice, done = events[-2:]
        seconds = done["payload"]["usage"]["audio_seconds"]
        assert (notice["session_id"], notice["request_id"]) == ("s1", "u")
        assert notice["payload"]["code"] == notice["payload"]["reason_code"] == "server_draining"
        assert notice["payload"]["details"] == {"audio_seconds": seconds}
        assert f"the first {seconds:.2f} s of audio" in notice["payload"]["message"]
        await check_covered(engine, sent, seconds, done["payload"]["text"])
    finally:
        server.close()


# -- HTTP streaming input -------------------------------------------------------------------------------------
async def test_mode_a_drain_notice_precedes_the_transcripts_end(engine, audio):
    """A Mode A request whose input never ends by itself: the drain ends it, and its stream says so before the
    transcript's done, which covers the audio received."""
    server = ServerThread(engine)
    chunks = [{"modality": "audio", "payload": encode_pcm16_base64(audio[i:i + PIECE])}
              for i in range(0, audio.size, PIECE)]

    async def body():
        yield "".join(json.dumps(line) + "\n" for line in [{"model": server.state.model_id}, *chunks]).encode()
        await asyncio.sleep(60)  # the input stays open

    try:
        draining, raw = None, ""
        async with aiohttp.ClientSession() as http, http.post(
                server.url("/v1/audio/transcriptions", "http"), data=body(),
                headers={"X-Streaming-Input": "true"}) as response:
            async for line in response.content:
                raw += line.decode()
                if draining is None and "transcript.text.delta" in raw:
                    draining = start_drain(server)
        assert await draining is True
    finally:
        server.close()
    events = [data for _, data in parse_sse(raw)]
    assert events[-1] == "[DONE]" and events[-2]["type"] == "transcript.text.done", events[-3:]
    done = events[-2]
    (notice,) = [event for event in events[:-2] if event["type"] == "error"]
    assert (notice["error"]["code"], notice["error"]["type"]) == ("server_draining", "server_error")
    assert f"the first {done['usage']['seconds']:.2f} s of audio" in notice["error"]["message"]
    assert "".join(event["delta"] for event in events[:-2] if event["type"] != "error") == done["text"]
    await check_covered(engine, [audio], done["usage"]["seconds"], done["text"])
