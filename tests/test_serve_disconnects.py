"""A client that goes away at any point of any WebSocket protocol frees the engine: the vLLM protocol, the
OpenAI dialect, the SageMaker route and Kyutai's STT protocol, each driven over loopback by a small
per-dialect driver to every protocol point, then cut with a closing handshake or by dropping the TCP
connection (vLLM #34532). After each cut the engine holds no session and no page, the server no
connection, and it still transcribes."""
import asyncio
import collections
import json

import msgpack
import numpy as np
import pytest
import soxr
import websockets

from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.kyutai import FRAME_SAMPLES, ROUTE as KYUTAI_ROUTE
from jaxstream.serving.testing import RealtimeClient, stream_utterance, wait_engine_baseline, wait_until
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

_TALK = 24000  # samples of the 16 kHz sample sent before the later points (1.5 s)


def engine_took_a_session(engine):
    """The engine holds the connection's session (parked waiting for audio, or running)."""
    return lambda: engine.metrics().sessions >= 1


class VllmDriver:
    """vLLM's /v1/realtime."""

    POINTS = ("connected", "session_started", "mid_audio", "audio_ended", "output_streaming")
    ROUTE, BINARY = "/v1/realtime", False

    def __init__(self, server, model, engine, audio):
        self.server, self.model, self.engine, self.audio = server, model, engine, audio

    async def send(self, event: dict) -> None:
        text = json.dumps(event)
        await self.client.send(text.encode() if self.BINARY else text)

    async def reach(self, point: str):
        self.client = await RealtimeClient.connect(self.server.url(self.ROUTE))
        if point == "connected":
            return self.client.ws
        await self.send({"type": "session.update", "model": self.model})
        await self.client.until("session.updated")
        await self.send({"type": "input_audio_buffer.commit"})
        await wait_until(engine_took_a_session(self.engine))
        if point == "session_started":
            return self.client.ws
        for begin in range(0, _TALK, 4000):
            await self.send({"type": "input_audio_buffer.append",
                             "audio": encode_pcm16_base64(self.audio[begin:begin + 4000])})
        if point == "mid_audio":  # a large frame still in flight when the connection goes
            await self.send({"type": "input_audio_buffer.append", "audio": "AAAA" * 200_000})
            return self.client.ws
        await self.send({"type": "input_audio_buffer.commit", "final": True})
        if point == "output_streaming":
            await self.client.until("transcription.delta")
        return self.client.ws


class SageMakerDriver(VllmDriver):
    """SageMaker's route: the vLLM protocol, its events sent as binary frames of UTF-8 JSON."""

    ROUTE, BINARY = "/invocations-bidirectional-stream", True


class OpenAiDriver:
    """OpenAI's realtime-transcription dialect: 24 kHz PCM; an item's session opens with its first audio."""

    POINTS = ("connected", "session_started", "mid_audio", "audio_ended", "output_streaming")

    def __init__(self, server, model, engine, audio):
        self.server, self.model, self.engine = server, model, engine
        self.audio = soxr.resample(audio, 16000, 24000).astype(np.float32)

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str) -> None:
        while json.loads(await asyncio.wait_for(self.ws.recv(), 60))["type"] != kind:
            pass

    async def reach(self, point: str):
        self.ws = await websockets.connect(self.server.url("/v1/realtime?intent=transcription"), max_size=None)
        await self.until("session.created")
        if point == "connected":
            return self.ws
        await self.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(self.audio[:2400])})
        await self.until("conversation.item.added")
        await wait_until(engine_took_a_session(self.engine))
        if point == "session_started":
            return self.ws
        for begin in range(2400, _TALK * 3 // 2, 6000):
            await self.send({"type": "input_audio_buffer.append",
                             "audio": encode_pcm16_base64(self.audio[begin:begin + 6000])})
        if point == "mid_audio":
            await self.send({"type": "input_audio_buffer.append", "audio": "AAAA" * 200_000})
            return self.ws
        await self.send({"type": "input_audio_buffer.commit"})
        if point == "output_streaming":
            await self.until("conversation.item.input_audio_transcription.delta")
        return self.ws


class KyutaiDriver:
    """Kyutai's STT protocol: the session is held from the handshake on (Ready); audio is msgpack f32 at
    24 kHz; a Marker is the nearest thing to an end of audio."""

    POINTS = ("connected", "mid_audio", "audio_ended", "output_streaming")

    def __init__(self, server, model, engine, audio):
        self.server, self.engine = server, engine
        self.audio = soxr.resample(audio, 16000, 24000).astype(np.float32)

    async def send(self, message: dict) -> None:
        await self.ws.send(msgpack.packb(message, use_bin_type=True, use_single_float=True))

    async def until(self, kind: str) -> None:
        while msgpack.unpackb(await asyncio.wait_for(self.ws.recv(), 60))["type"] != kind:
            pass

    async def reach(self, point: str):
        # Unbounded receive queue: this client reads none of the Steps, and a full queue would stop it
        # from reading the server's side of the closing handshake.
        self.ws = await websockets.connect(self.server.url(KYUTAI_ROUTE), max_size=None, max_queue=None)
        await self.until("Ready")
        await wait_until(engine_took_a_session(self.engine))
        if point == "connected":
            return self.ws
        # A word is out once the next one begins: the later points send the whole sample.
        talk = self.audio[:_TALK * 3 // 2] if point == "mid_audio" else self.audio
        for begin in range(0, talk.size, FRAME_SAMPLES):
            await self.send({"type": "Audio", "pcm": talk[begin:begin + FRAME_SAMPLES].tolist()})
        if point == "mid_audio":
            await self.send({"type": "Audio", "pcm": [0.0] * 60_000})
            return self.ws
        await self.send({"type": "Marker", "id": 1})
        if point == "output_streaming":
            await self.until("Word")
        return self.ws


_DRIVERS = {"vllm": VllmDriver, "sagemaker": SageMakerDriver, "openai": OpenAiDriver, "kyutai": KyutaiDriver}
_CASES = [(dialect, point) for dialect, driver in _DRIVERS.items() for point in driver.POINTS]


@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("dialect, point", _CASES, ids=[f"{d}-{p}" for d, p in _CASES])
async def test_disconnect_frees_the_engine(server, model, engine, audio, dialect, point, how):
    ws = await _DRIVERS[dialect](server, model, engine, audio).reach(point)
    before = _closed_outcomes(server)
    if how == "close":
        await ws.close()
    else:  # abnormal: the TCP connection vanishes without a closing handshake
        ws.transport.abort()
    await wait_engine_baseline(engine, timeout=5)
    await wait_until(lambda: not server.state.connections and _closed_outcomes(server) != before)
    assert engine.healthy
    # The metric and the log tell a client that said goodbye from one that vanished.
    assert _closed_outcomes(server) - before == {"client_closed" if how == "close" else "client_disconnected": 1}


def _closed_outcomes(server) -> collections.Counter:
    """Connections closed so far, by outcome (summed over the routes)."""
    outcomes = collections.Counter()
    for sample in server.state.metrics.connections_closed.collect()[0].samples:
        if sample.name.endswith("_total"):
            outcomes[sample.labels["outcome"]] += int(sample.value)
    return outcomes


async def test_the_engine_serves_after_the_disconnects(server, model, engine, audio):
    client = await RealtimeClient.connect(server.url())
    await client.update(model)
    await client.until("session.updated")
    result = await stream_utterance(client, audio)
    assert result["done"]["text"] == (await engine.transcribe(audio)).text
    await client.close()
