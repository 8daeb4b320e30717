"""What test_serve_openai.py and test_serve_openai_vad.py share: the bundled sample's speech and its 16 kHz
transcript (the oracle), the audio as a client of OpenAI's dialect sends it (24 kHz PCM16 appends), and a raw-JSON
client of the dialect over `websockets`. `reference` needs the module's `engine` fixture (serve_fixtures')."""
import asyncio
import json

import jiwer
import numpy as np
import pytest
import soxr
import websockets

from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.testing import sample_audio

CHUNK_S = 0.32  # seconds of audio per append


@pytest.fixture(scope="module")
def speech():
    """The bundled sample cut to its speech (with 50 ms either side), 16 kHz."""
    audio = sample_audio()
    loud = np.flatnonzero(np.convolve(np.abs(audio), np.ones(160) / 160, "same") > 0.02)
    return audio[max(0, loud[0] - 800):loud[-1] + 800]


@pytest.fixture(scope="module")
def reference(engine, speech):
    """engine.transcribe's text of the speech at 16 kHz (the vLLM dialect's input)."""
    return asyncio.run(engine.transcribe(speech)).text


def at_24k(pcm16k: np.ndarray) -> np.ndarray:
    return soxr.resample(pcm16k, 16000, 24000).astype(np.float32)


def pcm_base64(pcm: np.ndarray, rate: int) -> list[str]:
    step = int(CHUNK_S * rate)
    return [encode_pcm16_base64(pcm[i:i + step]) for i in range(0, pcm.size, step)]


def wer(reference: str, hypothesis: str) -> float:
    return jiwer.wer(reference.lower(), hypothesis.lower())


class Client:
    """A raw-JSON client of the OpenAI dialect over `websockets`."""

    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def connect(cls, server, query="?intent=transcription", **kwargs):
        return cls(await websockets.connect(server.url() + query, max_size=None, **kwargs))

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def event(self, timeout: float = 60.0) -> dict:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        assert event["event_id"].startswith("event_")
        return event

    async def until(self, kind: str) -> list[dict]:
        events = []
        while not events or events[-1]["type"] != kind:
            events.append(await self.event())
        return events


def ga_update(model, fmt=None, turn_detection=None, **transcription):
    return {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": fmt or {"type": "audio/pcm", "rate": 24000}, "turn_detection": turn_detection,
        "transcription": {"model": model, **transcription}}}}}


def transcripts(events: list[dict]) -> dict[str, str]:
    return {e["item_id"]: e["transcript"] for e in events
            if e["type"] == "conversation.item.input_audio_transcription.completed"}

