"""The server under load and abuse, over loopback with real `websockets` clients: 32 concurrent streams get
exactly their own transcripts (disconnects at every protocol point: test_serve_disconnects.py), a real-time client's
first delta arrives within delay + 300 ms, silence gaps, engine capacity, backpressure, slow readers, clients
that flood frames or errors, and the graceful drain."""
import asyncio
import functools
import socket
import time

import aiohttp
import msgpack
import numpy as np
import pytest
import websockets
from aiohttp import web
from aiohttp.test_utils import TestServer

from jaxstream.engine.transcription_session import TranscriptionDelta
from jaxstream.models.audio import SAMPLES_PER_SLOT, SAMPLING_RATE
from jaxstream.serving import sse
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.metrics import ServerMetrics
from jaxstream.serving.testing import RealtimeClient, ServerThread, stream_utterance, wait_until
from jaxstream.serving.websocket import Connection, ConnectionClosed
from serve_fixtures import audio, engine, engine_returns_to_baseline, model  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(max_connections=64)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def full_text(engine, audio):
    """engine.transcribe's text for the whole sample."""
    async def run():
        return (await engine.transcribe(audio)).text

    return asyncio.run(run())


async def connected(server, model):
    client = await RealtimeClient.connect(server.url())
    await client.update(model)
    assert (await client.event())["type"] == "session.updated"
    return client


def stream_audios(audio, count):
    """`count` different recordings cut and joined from the sample (1.5 to 5 s each)."""
    rng = np.random.default_rng(0)
    audios = []
    for i in range(count):
        start = int(rng.integers(0, 16000))
        piece = audio[start:start + int(rng.integers(24000, audio.size - start + 1))]
        audios.append(np.concatenate([piece, audio[: 8000 * (i % 3)]]) if i % 2 else piece)
    return audios


async def test_32_concurrent_streams_each_get_exactly_their_own_transcript(server, model, engine, audio):
    audios = stream_audios(audio, 32)
    expected = [done.text for done in await asyncio.gather(*(engine.transcribe(pcm) for pcm in audios))]
    assert len(set(expected)) > 8  # the streams really differ

    async def one(pcm):
        client = await connected(server, model)
        try:
            return await stream_utterance(client, pcm, chunk=2 * SAMPLES_PER_SLOT, realtime=True)
        finally:
            await client.close()

    results = await asyncio.gather(*(one(pcm) for pcm in audios))
    for result, text in zip(results, expected):
        assert result["done"]["text"] == text
        assert "".join(delta for delta, _ in result["deltas"]) == text


# -- latency and timing ---------------------------------------------------------------------------------------
async def test_realtime_client_gets_its_first_delta_within_delay_plus_300_ms(server, model, engine, audio):
    """80 ms chunks, each sent when its last sample would have been spoken. Latency of the first delta =
    its arrival - the moment the audio it describes had been sent (the delta's `audio_seconds`, from an
    offline run of the same audio); the model itself adds `delay` to that."""
    session = await engine.start_transcription()
    await session.append(audio)
    await session.finish()
    events = [event async for event in session]
    first = next(e for e in events if isinstance(e, TranscriptionDelta))
    client = await connected(server, model)
    result = await stream_utterance(client, audio, chunk=SAMPLES_PER_SLOT, realtime=True)
    await client.close()
    text, arrival = result["deltas"][0]
    assert text == first.text
    delay = engine.default_delay_ms / 1000
    latency = arrival - first.audio_seconds
    assert latency <= delay + 0.3, f"first delta {latency * 1000:.0f} ms after its audio (delay {delay * 1000:.0f})"
    assert result["final_to_done"] <= delay + 1.0  # conformance 44 (vLLM #33962)


async def test_silence_gap_mid_utterance_then_transcription_resumes(server, model, audio, full_text):
    """vLLM #35863: a session idle longer than the engine's wait loop went silent for good."""
    client = await connected(server, model)
    await client.commit()
    await client.append(audio[:20000])
    await asyncio.sleep(1.0)  # 20 times the engine thread's idle wait
    await client.append(audio[20000:])
    await client.commit(final=True)
    events = await client.until("transcription.done", timeout=30)
    assert events[-1]["text"] == full_text
    assert len(events) > 2
    await client.close()


async def test_engine_capacity_is_an_error_and_a_retry_works(server, model, engine, audio):
    clients = [await connected(server, model) for _ in range(engine.config.max_sessions + 1)]
    try:
        # The server reads each socket on its own task, so commits sent in a row may start their sessions in
        # any order: each one is held before the next is sent, and the last client is the one refused.
        for held, client in enumerate(clients[:-1], start=1):
            await client.commit()
            await wait_for(lambda held=held: engine.metrics().sessions >= held)
        extra = clients[-1]
        await extra.commit()
        event = await extra.event()
        assert event["type"] == "error" and event["code"] == "capacity"
        await clients[0].close()
        await wait_for(lambda: engine.metrics().sessions < engine.config.max_sessions)
        result = await stream_utterance(extra, audio[:20000])
        assert result["done"]["text"]
    finally:  # a failure here must not leave sessions behind for the module's next tests
        for client in clients:
            await client.close()


# This module's conditions wait on sessions started under load.
wait_for = functools.partial(wait_until, timeout=30.0)


# -- bounded memory -------------------------------------------------------------------------------------------
async def test_a_fast_writer_meets_backpressure_and_loses_nothing(server, model, engine, audio):
    """7 s of audio in 1 s appends, as fast as the socket takes them: the engine queues at most 5 s
    (TEST_ENGINE_CONFIG), the server stops reading meanwhile, and the transcript is the offline one."""
    long = np.concatenate([audio] * 2)
    client = await connected(server, model)
    result = await stream_utterance(client, long, chunk=SAMPLING_RATE)
    assert result["done"]["text"] == (await engine.transcribe(long)).text
    await client.close()


class _StuckSocket:
    """A WebSocket whose peer never reads: every send waits forever."""

    close_code = None

    async def send_str(self, _):
        await asyncio.Event().wait()


class _Server:
    def __init__(self, limits):
        self.config = ServerConfig(limits=limits)
        self.metrics = ServerMetrics()


class _Request:
    remote = "127.0.0.1"


async def test_a_client_that_stops_reading_is_closed_not_buffered():
    conn = Connection(_StuckSocket(), _Request(), "/v1/realtime", _Server(Limits(send_timeout_s=0.2)))
    started = time.monotonic()
    with pytest.raises(ConnectionClosed):
        await conn.send({"type": "transcription.delta", "delta": "x"})
    assert time.monotonic() - started < 2 and conn.breach.outcome == "slow_reader" and conn.breach.close_code == 1008
    with pytest.raises(ConnectionClosed):  # nothing more is queued for it
        await conn.send({"type": "transcription.delta", "delta": "y"})


async def test_a_client_that_stops_reading_an_sse_stream_is_dropped():
    """Over real TCP: a client that reads nothing fills the socket's buffers, and the stream's next write waits.
    After `send_timeout_s` the stream gives up and drops the connection; TCP alone would hold it (and the handler)
    for as long as the client's kernel answers its zero-window probes."""
    log = sse.EventLog(capacity=400)
    for n in range(300):  # 9.8 MB of events: far more than the socket buffers hold
        log.append({"n": n, "pad": "x" * 32768})
    log.close()
    complete = asyncio.get_running_loop().create_future()
    metrics = ServerMetrics()

    async def handler(request):
        # A small send buffer stands for a slow network: the writes block on a few buffered events, not megabytes.
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        response, whole = await sse.stream_log(request, log, send_timeout_s=0.5, first_event_timeout_s=None,
                                               on_slow_reader=metrics.slow_reader_counter(request))
        complete.set_result(whole)
        return response

    app = web.Application()
    app.router.add_get("/stream/{n}", handler)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    loop = asyncio.get_running_loop()
    client = socket.socket()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", test_server.port))
        await loop.sock_sendall(client, b"GET /stream/1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert await asyncio.wait_for(complete, 60) is False
        received = b""
        try:  # what the server had sent, then the end of the connection (EOF, or a reset for the rest it dropped)
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 10):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
        # Operators see it: counted under the route's pattern.
        assert metrics.registry.get_sample_value("jaxstream_sse_slow_readers_total", {"route": "/stream/{n}"}) == 1
    finally:
        client.close()
        await test_server.close()


class _FloodingSocket:
    """A WebSocket whose peer has sent more frames than the server reads: `receive` never has to wait."""

    close_code = None

    async def receive(self):
        return aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, '{"type": "session.update"}', None)


async def test_a_flooding_client_leaves_the_loop_to_the_others_between_frames():
    # Deterministic: counts loop turns the other task got while 100 frames were read, no clock involved.
    conn = Connection(_FloodingSocket(), _Request(), "/v1/realtime", _Server(Limits()))
    turns = 0

    async def another_connection():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(another_connection())
    await asyncio.sleep(0)
    read = 0
    async for _ in conn.frames():
        read += 1
        if read == 100:
            break
    other.cancel()
    assert turns >= 99, f"the other connection ran {turns} times while one client's 100 frames were read"


async def test_a_client_in_a_loop_of_bad_events_is_closed_and_the_others_keep_going(engine, model, audio,
                                                                                     full_text):
    server = ServerThread(engine, ServerConfig(limits=Limits(max_errors_per_minute=50)))
    try:
        transcribing = asyncio.create_task(stream_utterance(await connected(server, model), audio))
        looping = await RealtimeClient.connect(server.url())
        for _ in range(50):
            await looping.send({"type": "no.such.event"})
        assert [(await looping.event())["type"] for _ in range(50)] == ["error"] * 50
        await looping.update(model)  # within the budget the connection serves as before
        assert (await looping.event())["type"] == "session.updated"
        await looping.send("not json")  # the 51st error in 60 s
        last = await looping.event()
        assert (last["type"], last["code"]) == ("error", "too_many_errors")
        assert await closed_code(looping) == (1008, last["error"])
        # Kyutai's msgpack protocol: the same budget, its own Error message.
        kyutai = await websockets.connect(server.url("/api/asr-streaming"))
        assert msgpack.unpackb(await kyutai.recv())["type"] == "Ready"
        for _ in range(51):
            await kyutai.send(b"\xc1")  # never valid msgpack
        answers = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                answers.append(msgpack.unpackb(await asyncio.wait_for(kyutai.recv(), 10)))
        # Errors still queued when the budget ran out are dropped; the reason is the last message.
        assert closed.value.rcvd.code == 1008 and answers[-1]["message"] == last["error"]
        assert {answer["type"] for answer in answers} == {"Error"}
        assert (await transcribing)["done"]["text"] == full_text
    finally:
        server.close()


async def test_a_connection_without_a_request_is_closed_when_due_and_the_others_stay(engine, model):
    server = ServerThread(engine, ServerConfig(limits=Limits(first_request_timeout_s=1.0)))
    try:
        async def connect():
            return await asyncio.open_connection("127.0.0.1", server.server.port)

        silent = await connect()
        trickling = await connect()
        trickling[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        served = await connect()  # made a request and then says nothing: keep-alive's business, not ours

        async def get(path: str) -> bytes:
            served[1].write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = await served[0].readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await served[0].readexactly(length)
            return head.split(b"\r\n")[0]

        assert await get("/health") == b"HTTP/1.1 200 OK"
        quiet = await connected(server, model)  # a WebSocket that sends nothing more

        async def closed_by_server(reader, writer):
            while True:
                writer.write(b"a")  # a byte now and then, as a slowloris client sends
                try:
                    if await asyncio.wait_for(reader.read(1 << 16), 0.2) == b"":
                        return True
                except TimeoutError:
                    pass
                except ConnectionResetError:  # closed with our last byte unread
                    return True

        assert await asyncio.wait_for(closed_by_server(*trickling), 30)
        assert await asyncio.wait_for(silent[0].read(), 30) == b""
        assert await get("/v1/models") == b"HTTP/1.1 200 OK"
        await quiet.update(model)
        assert (await quiet.event())["type"] == "session.updated"
        await quiet.close()
        served[1].close()
    finally:
        server.close()


# -- drain ----------------------------------------------------------------------------------------------------
async def closed_code(client, timeout=10):
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await client.event(timeout)
    return closed.value.rcvd.code, closed.value.rcvd.reason


async def test_drain_closes_idle_sockets_refuses_new_ones_and_lets_utterances_finish(engine, audio, full_text):
    server = ServerThread(engine)
    try:
        model = server.state.model_id
        idle = await connected(server, model)
        busy = await connected(server, model)
        await busy.commit()
        await busy.append(audio[:20000])
        await wait_for(lambda: sum(conn.protocol.busy() for conn in list(server.state.connections)) == 1)
        draining = server.start_drain(8.0)
        assert await closed_code(idle) == (1001, "server shutting down")
        async with aiohttp.ClientSession() as http, http.get(server.url("/health", "http")) as response:
            assert response.status == 503 and (await response.json())["status"] == "draining"
        late = await RealtimeClient.connect(server.url())
        assert late.created["code"] == "draining" and (await closed_code(late))[0] == 1001
        await busy.append(audio[20000:])  # the running utterance goes on
        await busy.commit(final=True)
        events = await busy.until("transcription.done")
        assert events[-1]["text"] == full_text
        assert await closed_code(busy) == (1001, "server shutting down")
        assert await draining is True
    finally:
        server.close()


async def test_drain_deadline_finishes_running_utterances_itself(engine, audio, full_text):
    server = ServerThread(engine)
    try:
        client = await connected(server, server.state.model_id)
        await client.commit()
        await client.append(audio)  # ... and never sends final
        await wait_for(lambda: any(conn.protocol.busy() for conn in list(server.state.connections)))
        started = time.monotonic()
        draining = server.start_drain(3.0)
        # The server ended the audio, not the client: its done comes after a notice saying so.
        assert (await client.until("error"))[-1]["code"] == "server_draining"
        done = (await client.until("transcription.done"))[-1]
        assert done["text"] == full_text
        assert (await closed_code(client))[0] == 1001
        assert await draining is True and time.monotonic() - started < 4.0
    finally:
        server.close()


async def test_drain_deadline_cuts_off_what_is_still_running(engine, audio):
    server = ServerThread(engine)
    try:
        client = await connected(server, server.state.model_id)
        await client.commit()
        await client.append(audio[:8000])
        await wait_for(lambda: any(conn.protocol.busy() for conn in list(server.state.connections)))
        assert await server.start_drain(0.0) is False  # no time at all: the utterance is cut off
        event = await client.event(10)
        assert event["type"] == "error" and event["code"] == "server_shutdown"
        assert (await closed_code(client))[0] == 1001
    finally:
        server.close()


# -- an engine that dies --------------------------------------------------------------------------------------
class _DyingEngine:
    """The engine contract's surface, with a `die()` that fails every stream as a dead engine thread does."""

    kind = "realtime"
    model_name = "dying"
    default_delay_ms = 480

    def __init__(self):
        from types import SimpleNamespace

        self.config = SimpleNamespace(max_sessions=4)
        self.healthy = True
        self.streams: list[asyncio.Queue] = []

    def metrics(self):
        from types import SimpleNamespace

        return SimpleNamespace(sessions=0, waiting=0, running=0, parked=0, evicted=0, max_sessions=4,
                               pages_used={}, pages_total={}, ticks=0, recent_tick_seconds=())

    async def start_transcription(self, delay_ms=None, *, session_id=None, sample_rate=16000, max_audio_seconds=None):
        from jaxstream.errors import EngineDeadError

        if not self.healthy:
            raise EngineDeadError("the engine thread died")
        engine, events = self, asyncio.Queue()
        self.streams.append(events)

        class Session:
            async def append(self, pcm):
                if not engine.healthy:
                    raise EngineDeadError("the engine thread died")

            async def finish(self):
                pass

            async def abort(self, reason="aborted"):
                events.put_nowait(None)

            def __aiter__(self):
                return self

            async def __anext__(self):
                event = await events.get()
                raise StopAsyncIteration if event is None else event

        return Session()

    async def die(self):
        from jaxstream.errors import EngineDeadError

        self.healthy = False
        for events in self.streams:
            events.put_nowait(EngineDeadError("the engine thread died"))


async def test_a_dead_engine_fails_its_streams_and_health_but_the_server_answers(audio):
    engine = _DyingEngine()
    server = ServerThread(engine)
    try:
        client = await connected(server, "dying")
        await client.commit()
        await client.append(audio[:4000])
        await wait_for(lambda: engine.streams)
        server.call(engine.die())
        event = await client.event()
        assert event["type"] == "error" and event["code"] == "engine_dead"
        await client.commit()  # the socket still answers; a new utterance is refused with the same code
        assert (await client.event())["code"] == "engine_dead"
        async with aiohttp.ClientSession() as http, http.get(server.url("/health", "http")) as response:
            assert response.status == 503 and (await response.json())["status"] == "engine_dead"
        late = await RealtimeClient.connect(server.url())
        assert late.created["code"] == "engine_dead" and (await closed_code(late))[0] == 1011
        await client.close()
    finally:
        server.close()
