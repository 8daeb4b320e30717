"""Helpers for tests and benchmarks of the server: one engine per process, an app served on loopback by
aiohttp's TestServer on its own event-loop thread, and a small vLLM-protocol client over `websockets`.

The server runs on its own loop so that tests (async or plain, hypothesis included) drive it through real
sockets only, as a remote client would.
"""
import asyncio
import atexit
import functools
import json
import threading
import time

import numpy as np

from jaxstream.models.audio import SAMPLES_PER_SLOT, SAMPLING_RATE
from jaxstream.serving.audio_codecs import encode_pcm16_base64

# Small buckets: one decode width, two step counts and one prefill shape compile in seconds on CPU.
# A 5 s backlog makes a fast client meet the engine's backpressure after a few appends.
TEST_ENGINE_CONFIG = dict(max_sessions=32, batch_buckets=(32,), realtime_step_buckets=(1, 4),
                          realtime_prefill_buckets=((8, 40),), max_queued_audio_seconds=5.0)


@functools.cache
def shared_engine():
    """The embedded tiny model with TEST_ENGINE_CONFIG, built once per process and closed at exit."""
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig

    engine = AsyncEngine.from_pretrained("tiny", config=EngineConfig(**TEST_ENGINE_CONFIG))
    atexit.register(engine.close)
    return engine


def engine_at_baseline(engine) -> bool:
    m = engine.metrics()
    return m.sessions == 0 and not any(m.pages_used.values())


async def wait_until(condition, timeout: float = 5.0, failure=lambda: "condition not reached") -> float:
    """Seconds until `condition()` holds, checked every 20 ms; raises AssertionError(`failure()`) after
    `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(failure())
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def wait_engine_baseline(engine, timeout: float = 5.0) -> float:
    """Seconds until the engine holds no session and no page; raises AssertionError after `timeout`."""
    return await wait_until(lambda: engine_at_baseline(engine), timeout,
                            lambda: f"engine not back at baseline after {timeout:g} s: {engine.metrics()}")


async def wait_engine_sessions(engine, count: int, timeout: float = 5.0) -> float:
    """Seconds until the engine's metrics show `count` sessions (its snapshot follows its commands by up to a
    tick); raises AssertionError after `timeout`."""
    return await wait_until(lambda: engine.metrics().sessions == count, timeout,
                            lambda: f"engine not holding {count} sessions after {timeout:g} s: {engine.metrics()}")


class ServerThread:
    """`create_app(config, engine=engine)` served on 127.0.0.1 by aiohttp's TestServer, on its own loop."""

    def __init__(self, engine, config=None):
        from aiohttp.test_utils import TestServer

        from jaxstream.serving.app import SERVER, create_app
        from jaxstream.serving.config import ServerConfig

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self.app = create_app(config or ServerConfig(), engine=engine)
        self.state = self.app[SERVER]
        self.server = TestServer(self.app, host="127.0.0.1")
        self.call(self.server.start_server())

        async def sweep_first_requests():  # as `jaxstream serve` does: connections without a request are closed
            return asyncio.create_task(self.state.first_request.watch(self.server.runner.server))

        self._deadline = self.call(sweep_first_requests())

    def call(self, coro, timeout: float = 60.0):
        """Runs `coro` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_drain(self, timeout: float | None = None) -> asyncio.Future:
        """The app's drain (what SIGTERM runs), started on the server's loop; await it from the caller's loop for
        drain's answer (True when nothing was cut off)."""
        from jaxstream.serving.app import drain

        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(self.app, timeout), self.loop))

    def url(self, path: str = "/v1/realtime", scheme: str = "ws") -> str:
        return f"{scheme}://127.0.0.1:{self.server.port}{path}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._deadline.cancel)
        self.call(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class RealtimeClient:
    """A vLLM-protocol client over one `websockets` connection."""

    def __init__(self, ws, created: dict):
        self.ws = ws
        self.created = created

    @classmethod
    async def connect(cls, url: str, **kwargs) -> "RealtimeClient":
        import websockets

        ws = await websockets.connect(url, max_size=None, **kwargs)
        return cls(ws, json.loads(await asyncio.wait_for(ws.recv(), 30)))

    async def send(self, event) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    async def event(self, timeout: float = 30.0) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def update(self, model: str, **fields) -> None:
        await self.send({"type": "session.update", "model": model, **fields})

    async def commit(self, final: bool = False) -> None:
        await self.send({"type": "input_audio_buffer.commit", "final": final})

    async def append(self, pcm: np.ndarray) -> None:
        await self.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(pcm)})

    async def until(self, kind: str, timeout: float = 60.0) -> list[dict]:
        """Events up to and including the first of type `kind`; an `error` before it raises."""
        events = []
        deadline = time.monotonic() + timeout
        while True:
            event = await self.event(max(0.01, deadline - time.monotonic()))
            events.append(event)
            if event["type"] == kind:
                return events
            if event["type"] == "error":
                raise AssertionError(f"error while waiting for {kind}: {event}")

    async def close(self) -> None:
        await self.ws.close()


@functools.cache
def _sample_path(suffix: str = ".wav"):
    from importlib.resources import files

    return str(files("jaxstream.models").joinpath(f"assets/samples/sample{suffix}"))


def sample_audio() -> np.ndarray:
    """The bundled speech sample (16 kHz float32)."""
    from jaxstream.models.audio import load_audio

    return load_audio(_sample_path())


def sample_words() -> list[str]:
    """The words the bundled sample says (its reference transcript, lower case)."""
    with open(_sample_path(".txt"), encoding="utf-8") as file:
        return file.read().split()


async def stream_utterance(client: RealtimeClient, pcm: np.ndarray, *, chunk: int = 4 * SAMPLES_PER_SLOT,
                           realtime: bool = False) -> dict:
    """One utterance on an updated connection: commit, appends (paced at real time, each chunk sent once
    its last sample would have been spoken, or as fast as the server takes them), final; then reads to
    `transcription.done`. Returns {"deltas": [(text, seconds since the audio started)], "done": event,
    "final_to_done": seconds}."""
    loop = asyncio.get_running_loop()
    deltas = []
    await client.commit()
    start = loop.time()

    async def receive():
        while True:
            event = await client.event(120)
            if event["type"] == "transcription.delta":
                deltas.append((event["delta"], loop.time() - start))
            elif event["type"] == "transcription.done":
                return event, loop.time()
            elif event["type"] == "error":
                raise AssertionError(f"server error: {event}")

    receiver = asyncio.create_task(receive())
    try:
        for begin in range(0, pcm.size, chunk):
            end = min(begin + chunk, pcm.size)
            if realtime:
                await asyncio.sleep(max(0.0, start + end / SAMPLING_RATE - loop.time()))
            await client.append(pcm[begin:end])
        final_at = loop.time()
        await client.commit(final=True)
        done, done_at = await receiver
    finally:
        receiver.cancel()
    return {"deltas": deltas, "done": done, "final_to_done": done_at - final_at}
