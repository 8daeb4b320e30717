"""The `/ws` JSON-envelope protocol (specs/realtime_protocols.md §5), driven over loopback by a real
`websockets` client: transcripts against the engine's own, the close codes 1000/4000/4001/4002/4003, the
message and cancel rate limits, cancel and barge-in, server VAD, the error schema, disconnects at every
protocol point, and a hypothesis fuzz of malformed frames."""
import asyncio
import base64
import json

import aiohttp
import jiwer
import numpy as np
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as sync_connect

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits, RollingWindowLimiter
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import INTERNAL_ERRORS, fuzz_text
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

CHUNK = 4000  # samples per append (250 ms)
_REPLIES = {"session.created", "session.updated", "pong", "session_end", "cancelled", "error", "transcription.delta",
            "transcription.done", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
            "input_audio_buffer.timeout_triggered"}


@pytest.fixture(scope="module")
def reference(engine, audio):
    """engine.transcribe's text of the sample."""
    return asyncio.run(engine.transcribe(audio)).text


@pytest.fixture(scope="module")
def strict_server(engine):
    """A key, a cap of two connections, small rate limits (60 s windows: nothing leaves them during a test)
    and an error budget smaller than the rate-limit errors one test provokes: a server of its own, as these
    would get in the other tests' way."""
    config = ServerConfig(api_keys=("k-1",), ws_max_messages_per_window=6, ws_max_cancels_per_window=2,
                          limits=Limits(max_connections=2, max_errors_per_minute=2))
    server = ServerThread(engine, config)
    yield server
    server.close()


class Client:
    """An envelope client over one `websockets` connection."""

    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def connect(cls, server, query: str = "", **kwargs) -> "Client":
        return cls(await websockets.connect(server.url("/ws") + query, max_size=None, **kwargs))

    async def send(self, kind: str, payload: dict | None = None, *, request_id=None, session_id="s1") -> None:
        await self.ws.send(json.dumps({"type": kind, "session_id": session_id, "request_id": request_id,
                                       "payload": payload or {}}))

    async def event(self, timeout: float = 60.0) -> dict:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        assert set(event) == {"type", "session_id", "request_id", "payload"}, event
        assert event["type"] in _REPLIES, event
        if event["type"] == "error":
            assert set(event["payload"]) == {"code", "message", "reason_code", "details"}, event
            assert isinstance(event["payload"]["details"], dict) and event["payload"]["message"]
        return event

    async def until(self, kind: str, request_id=None) -> list[dict]:
        """Events up to the first of type `kind` (and `request_id`, when given)."""
        events = []
        while not events or events[-1]["type"] != kind or (request_id and events[-1]["request_id"] != request_id):
            events.append(await self.event())
        return events

    async def append(self, pcm: np.ndarray, request_id=None) -> None:
        for begin in range(0, pcm.size, CHUNK):
            await self.send("input_audio_buffer.append", {"audio": encode_pcm16_base64(pcm[begin:begin + CHUNK])},
                            request_id=request_id)

    async def expect_error(self, code: str, reason_code: str, request_id=None) -> dict:
        event = await self.event()
        assert event["type"] == "error", event
        assert (event["payload"]["code"], event["payload"]["reason_code"]) == (code, reason_code), event
        assert event["request_id"] == request_id, event
        return event

    async def closed_with(self, code: int) -> str:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await self.event(10)
        assert closed.value.rcvd.code == code
        return closed.value.rcvd.reason


async def opened(server, query: str = "", **kwargs) -> Client:
    client = await Client.connect(server, query, **kwargs)
    created = await client.event()
    assert created["type"] == "session.created" and created["session_id"] is None and created["request_id"] is None
    assert created["payload"]["id"].startswith("sess-")
    return client


async def no_connections(server) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while server.state.connections:
        assert loop.time() < deadline, "connections stay open"
        await asyncio.sleep(0.01)


def transcript(events: list[dict], request_id: str) -> tuple[str, dict]:
    """(the utterance's joined deltas, its done event)."""
    deltas = "".join(e["payload"]["delta"] for e in events
                     if e["type"] == "transcription.delta" and e["request_id"] == request_id)
    (done,) = [e for e in events if e["type"] == "transcription.done" and e["request_id"] == request_id]
    return deltas, done


# -- the guide's flow, ids, end -----------------------------------------------------------------------------
async def test_utterance_matches_the_engine_and_end_closes_1000(server, model, audio, reference):
    client = await opened(server)
    await client.send("session.update", {"model": model, "transcription_delay_ms": 480}, request_id="r0")
    updated = await client.event()
    assert updated["type"] == "session.updated" and (updated["session_id"], updated["request_id"]) == ("s1", "r0")
    assert updated["payload"] == {"model": model, "transcription_delay_ms": 480, "turn_detection": None}
    await client.send("session.update", {"transcription_delay_ms": None})  # back to the engine's default
    assert (await client.event())["payload"]["transcription_delay_ms"] == server.state.engine.default_delay_ms
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="utt-1")
    await client.append(audio, request_id="utt-1")
    await client.send("input_audio_buffer.commit", {"final": True}, request_id="utt-1")
    events = await client.until("transcription.done")
    deltas, done = transcript(events, "utt-1")
    assert deltas == done["payload"]["text"] == reference and all(e["session_id"] == "s1" for e in events)
    usage = done["payload"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["audio_seconds"] == pytest.approx(audio.size / SAMPLING_RATE, abs=0.1)
    assert [w["word"] for w in done["payload"]["words"]] == reference.split()
    # A message without a session_id is answered with the connection's latest one.
    await client.ws.send(json.dumps({"type": "ping", "request_id": "p1"}))
    pong = await client.event()
    assert (pong["type"], pong["session_id"], pong["request_id"], pong["payload"]) == ("pong", "s1", "p1", {})
    await client.send("end", request_id="bye")
    end = await client.event()
    assert (end["type"], end["request_id"]) == ("session_end", "bye")
    await client.closed_with(1000)


async def test_errors_have_the_schema_and_keep_the_socket(server, model, audio):
    client = await opened(server)
    cases = [
        ("not json", "invalid_json", "invalid_json", None),
        (json.dumps([1]), "invalid_request", "invalid_envelope", None),
        (json.dumps({"type": "ping", "request_id": 7}), "invalid_request", "invalid_envelope", None),
        (json.dumps({"type": "ping", "request_id": "x" * 300}), "invalid_request", "invalid_envelope", None),
        (json.dumps({"type": "ping", "request_id": "r", "payload": []}), "invalid_request", "invalid_envelope", "r"),
        (json.dumps({"type": "response.create", "request_id": "r"}), "unknown_event", "unknown_event", "r"),
        (json.dumps({"request_id": "r"}), "unknown_event", "unknown_event", "r"),
        (("session.update", {"model": "other-model"}), "invalid_request", "model_not_allowed", "r"),
        (("session.update", {"transcription_delay_ms": 100}), "invalid_request", "invalid_payload", "r"),
        (("session.update", {"turn_detection": {"type": "loud"}}), "invalid_request", "invalid_payload", "r"),
        (("input_audio_buffer.append", {"audio": "@@@"}), "invalid_audio", "invalid_audio", "r"),
        (("input_audio_buffer.append", {}), "invalid_request", "invalid_payload", "r"),
        (("input_audio_buffer.commit", {"final": "yes"}), "invalid_request", "invalid_payload", "r"),
        (("input_audio_buffer.commit", {"final": True}), "invalid_request", "no_active_utterance", "r"),
        (("cancel", {"reason": 5}), "invalid_request", "invalid_payload", "r"),
    ]
    for frame, code, reason_code, request_id in cases:
        if isinstance(frame, tuple):
            await client.send(*frame, request_id="r")
        else:
            await client.ws.send(frame)
        await client.expect_error(code, reason_code, request_id)
    await client.ws.send(b"\x00binary")
    await client.expect_error("invalid_frame", "binary_frame")
    # A long value echoed in an error is cut, and says so.
    await client.ws.send(json.dumps({"type": "t" * 100, "request_id": "long"}))
    error = await client.expect_error("unknown_event", "unknown_event", "long")
    assert error["payload"]["message"] == f"Unknown message type: {'t' * 64}...", error
    # An utterance with no audio cannot be finalised, and nothing of it is left running.
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="u")
    await client.send("input_audio_buffer.commit", {"final": True}, request_id="u")
    await client.expect_error("input_audio_buffer_commit_empty", "input_audio_buffer_commit_empty", "u")
    await client.send("ping", request_id="still-open")
    assert (await client.event())["request_id"] == "still-open"
    await client.ws.close()


# -- cancel and barge-in --------------------------------------------------------------------------------
async def test_cancel_and_barge_in(server, audio, reference):
    client = await opened(server)
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="utt-1")
    await client.append(audio[:2 * SAMPLING_RATE], request_id="utt-1")
    await client.until("transcription.delta", "utt-1")  # it really runs
    await client.send("cancel", {"reason": "client_request"}, request_id="c1")
    events = await client.until("cancelled")
    assert events[-1]["request_id"] == "c1"
    assert events[-1]["payload"] == {"reason": "client_request", "request_ids": ["utt-1"]}
    # Audio appended outside an utterance is dropped by a cancel: the next utterance starts empty.
    await client.append(audio[:CHUNK])
    await client.send("cancel", request_id="c2")
    assert (await client.event())["payload"] == {"reason": "client_request", "request_ids": []}
    # Barge-in: a new commit aborts the running utterance and starts its own.
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="utt-2")
    await client.append(audio, request_id="utt-2")
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="utt-3")
    events = await client.until("cancelled")
    assert events[-1]["request_id"] == "utt-3"
    assert events[-1]["payload"] == {"reason": "barge_in", "request_ids": ["utt-2"]}
    assert not [e for e in events if e["type"] == "transcription.done"]
    await client.append(audio, request_id="utt-3")
    await client.send("input_audio_buffer.commit", {"final": True}, request_id="utt-3")
    events = await client.until("transcription.done")
    assert {e["request_id"] for e in events} == {"utt-3"}  # nothing more of the aborted ones
    assert transcript(events, "utt-3") == (reference, events[-1])
    await client.ws.close()


# -- server VAD (opt-in) --------------------------------------------------------------------------------
async def test_server_vad_starts_and_finalises_utterances(server, model, audio, reference):
    silence = np.zeros(int(0.8 * SAMPLING_RATE), np.float32)
    stream = np.concatenate([silence, audio, silence, silence])
    client = await opened(server)
    await client.send("session.update", {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}})
    updated = await client.event()
    assert updated["payload"]["turn_detection"]["type"] == "server_vad"
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="manual")
    await client.expect_error("invalid_request", "turn_detection_enabled", "manual")
    await client.append(stream)
    events = await client.until("transcription.done")
    (started,) = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    (stopped,) = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert started["request_id"] == stopped["request_id"] == events[-1]["request_id"] == "vad-1"
    loud = np.flatnonzero(np.convolve(np.abs(audio), np.ones(160) / 160, "same") > 0.02)
    assert abs(started["payload"]["audio_start_ms"] / 1000 - (0.8 + loud[0] / SAMPLING_RATE)) <= 0.15
    deltas, done = transcript(events, "vad-1")
    # The utterance also holds the prefix padding and the silence until the stop: another context than the
    # bare sample, which may move the tiny model's last word.
    assert deltas == done["payload"]["text"] and jiwer.wer(reference, done["payload"]["text"]) <= 0.2
    # Nobody speaks for idle_timeout_ms: the silence is committed as an utterance of its own.
    await client.send("session.update", {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}})
    await client.until("session.updated")
    await client.append(np.zeros(int(5.3 * SAMPLING_RATE), np.float32))
    events = await client.until("transcription.done")
    (timeout,) = [e for e in events if e["type"] == "input_audio_buffer.timeout_triggered"]
    assert timeout["request_id"] == events[-1]["request_id"] == "vad-2"
    start_ms = stream.size * 1000 // SAMPLING_RATE  # positions are on the connection's audio clock
    assert timeout["payload"]["audio_start_ms"] == start_ms
    assert 5000 <= timeout["payload"]["audio_end_ms"] - start_ms <= 5300
    await client.send("session.update", {"turn_detection": None})
    assert (await client.event())["payload"]["turn_detection"] is None
    await client.ws.close()


async def test_idle_timeout_without_prefix_padding_ends_its_turn_with_an_empty_done(server):
    """With prefix_padding_ms 0 an idle timeout has no audio to commit. The server's commit is no client
    mistake: the turn ends with a done, as every turn does (OpenAI commits the empty buffer too), empty since
    nobody spoke, and no input_audio_buffer_commit_empty error follows (it did, on every timeout)."""
    client = await opened(server)
    vad = {"type": "server_vad", "prefix_padding_ms": 0, "idle_timeout_ms": 5000}
    await client.send("session.update", {"turn_detection": vad})
    await client.until("session.updated")
    await client.append(np.zeros(int(5.3 * SAMPLING_RATE), np.float32), request_id="a")
    timeout, done = await client.event(), await client.event()
    assert (timeout["type"], timeout["request_id"]) == ("input_audio_buffer.timeout_triggered", "vad-1")
    assert (done["type"], done["request_id"], done["payload"]["text"]) == ("transcription.done", "vad-1", ""), done
    await client.send("ping", request_id="p")
    assert (await client.event())["type"] == "pong"  # nothing else came
    await client.ws.close()


async def test_an_update_whose_vad_fails_to_start_changes_nothing(server, audio, monkeypatch):
    """A new segmenter that cannot be built fails the update whole: the one running goes on detecting speech
    (it used to be closed first, its model back in the pool, and the session found no speech any more)."""
    from jaxstream.serving import vad as vad_module

    def broken(*args, **kwargs):
        raise RuntimeError("no VAD model")

    client = await opened(server)
    vad = {"type": "server_vad", "silence_duration_ms": 500}
    await client.send("session.update", {"turn_detection": vad})
    await client.until("session.updated")
    monkeypatch.setattr(vad_module, "SpeechDetector", broken)
    await client.send("session.update", {"turn_detection": {**vad, "silence_duration_ms": 800}}, request_id="u")
    assert (await client.event())["type"] == "error"
    monkeypatch.undo()
    silence = np.zeros(int(0.8 * SAMPLING_RATE), np.float32)
    await client.append(np.concatenate([silence, audio, silence, silence]))
    events = [await client.event(timeout=20)]
    while events[-1]["type"] != "transcription.done":
        events.append(await client.event(timeout=20))
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.speech_stopped" in kinds, kinds
    await client.ws.close()


async def test_a_vad_turn_the_model_ended_early_still_stops_under_its_id(server, engine, audio, monkeypatch):
    """[STREAMING_PAD] stands in for the end-of-text id, so the model ends vad-1's utterance at its first
    decode step, long before the speech stops: speech_stopped still names vad-1 (it used to say null)."""
    client = await opened(server)
    await client.send("session.update", {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}})
    await client.until("session.updated")
    monkeypatch.setattr(engine.core, "eos_id", engine.tokenizer.streaming_pad_id)
    silence = np.zeros(int(0.8 * SAMPLING_RATE), np.float32)
    await client.append(np.concatenate([silence, audio]))
    events = await client.until("transcription.done", "vad-1")  # ended early: the speech has not stopped
    await engine.wait_until_idle()
    monkeypatch.undo()
    await client.append(np.concatenate([silence, silence]))
    events += await client.until("input_audio_buffer.speech_stopped")
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert [e["request_id"] for e in started] == [events[-1]["request_id"]] == ["vad-1"], events
    await client.ws.close()


async def test_audio_is_held_again_once_vad_went_on_and_off_after_an_early_end(server, engine, audio, monkeypatch):
    """The model ended an utterance on its own ([STREAMING_PAD] stands in for its end-of-text id, so the
    first decode step ends it): audio is dropped until the next commit. Turning VAD on and off meanwhile
    starts over: audio appended after that waits for the next commit, as always (it used to be dropped)."""
    client = await opened(server)
    monkeypatch.setattr(engine.core, "eos_id", engine.tokenizer.streaming_pad_id)
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="early")
    await client.append(audio[:20000], request_id="early")
    await client.until("transcription.done", "early")
    await engine.wait_until_idle()
    monkeypatch.undo()
    for turn_detection in ({"type": "server_vad"}, None):
        await client.send("session.update", {"turn_detection": turn_detection})
        assert (await client.event())["type"] == "session.updated"
    await client.append(audio, request_id="held")
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="held")
    await client.send("input_audio_buffer.commit", {"final": True}, request_id="held")
    _, done = transcript(await client.until("transcription.done", "held"), "held")
    assert done["payload"]["usage"]["audio_seconds"] == pytest.approx(audio.size / SAMPLING_RATE, abs=0.1)
    assert done["payload"]["text"] == (await engine.transcribe(audio)).text
    await client.ws.close()


async def test_drain_finishes_the_running_utterance_then_closes_1001(engine, audio):
    """A draining server ends the utterance still taking audio itself, sends its done, then closes 1001.
    (8 s: half of it waits for the utterance to end on its own, half is left for its flush, on a busy CI box.)"""

    piece = audio[:2 * SAMPLING_RATE]
    expected = (await engine.transcribe(piece)).text
    server = ServerThread(engine)
    try:
        client = await opened(server)
        await client.send("input_audio_buffer.commit", {"final": False}, request_id="u")
        await client.append(piece, request_id="u")
        events = await client.until("transcription.delta")  # it runs: the drain must wait for it
        draining = server.start_drain(8.0)
        events += await client.until("transcription.done")
        assert transcript(events, "u") == (expected, events[-1])
        await client.closed_with(1001)
        assert await draining is True
    finally:
        server.close()


# -- auth, capacity, rate limits --------------------------------------------------------------------------
async def test_a_bad_key_is_answered_after_the_upgrade_with_4001(strict_server):
    for query, headers in (("", {}), ("?api_key=nope", {}), ("", {"X-API-Key": "nope"})):
        client = await Client.connect(strict_server, query, additional_headers=headers)
        error = await client.expect_error("unauthorized", "invalid_api_key")
        assert error["session_id"] is None
        await client.closed_with(4001)
    for query, headers in (("?api_key=k-1", {}), ("", {"X-API-Key": "k-1"}), ("", {"Authorization": "Bearer k-1"})):
        client = await opened(strict_server, query, additional_headers=headers)
        await client.ws.close()


async def test_capacity_is_refused_with_4002(strict_server):
    await no_connections(strict_server)  # the server forgets the earlier tests' sockets just after they close
    clients = [await opened(strict_server, "?api_key=k-1") for _ in range(2)]
    third = await Client.connect(strict_server, "?api_key=k-1")
    await third.expect_error("capacity", "max_connections")
    await third.closed_with(4002)
    for client in clients:
        await client.ws.close()


async def test_message_and_cancel_rate_limits(strict_server):
    await no_connections(strict_server)
    client = await opened(strict_server, "?api_key=k-1")
    for n in range(2):
        await client.send("cancel", request_id=f"c{n}")
        assert (await client.event())["type"] == "cancelled"
    await client.send("cancel", request_id="c2")
    error = await client.expect_error("rate_limited", "cancel_rate_limited", "c2")
    assert error["payload"]["details"]["limit"] == 2 and error["payload"]["details"]["window_seconds"] == 60
    for n in range(3):  # messages 4 to 6 of the window
        await client.send("session.update", request_id=f"u{n}")
        assert (await client.event())["type"] == "session.updated"
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="over")
    error = await client.expect_error("rate_limited", "message_rate_limited", "over")
    assert 0 < error["payload"]["details"]["retry_after_seconds"] <= 60
    await client.ws.send("not json")  # unparseable frames count too
    await client.expect_error("rate_limited", "message_rate_limited")
    # Three rate-limit errors and the socket is still open: they are not the error budget's (2 here).
    await client.send("ping", request_id="p")  # ping, pong and end are not counted
    assert (await client.event())["type"] == "pong"
    await client.send("pong")
    await client.send("end", request_id="e")
    assert (await client.event())["type"] == "session_end"
    await client.closed_with(1000)


def test_rolling_window_limiter(monkeypatch):
    """Against a hand-moved clock: a rolling window admits `limit` events in any `window_s` stretch."""
    now = [100.0]
    monkeypatch.setattr("jaxstream.serving.limits.time.monotonic", lambda: now[0])
    limiter = RollingWindowLimiter(3, 10.0)
    for at in (100.0, 104.0, 109.0):
        now[0] = at
        assert limiter.allow()
    assert not limiter.allow() and limiter.retry_after() == pytest.approx(1.0)  # 100 + 10 - 109
    now[0] = 110.0  # the first event left the window: one more fits, not two
    assert limiter.allow() and not limiter.allow()
    now[0] = 114.0
    assert limiter.allow() and not limiter.allow() and limiter.retry_after() == pytest.approx(5.0)
    with pytest.raises(ValueError):
        RollingWindowLimiter(0, 1.0)


# -- deadlines ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deadline_server(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(idle_timeout_s=0.6, max_session_seconds=2.0)))
    yield server
    server.close()


async def test_idle_timeout_closes_4000_and_protocol_pings_do_not_count(deadline_server, audio):
    client = await opened(deadline_server)
    await client.send("input_audio_buffer.commit", {"final": False}, request_id="u")
    await client.append(audio[:CHUNK], request_id="u")

    async def ping_frames():  # WebSocket Ping frames are answered but are not activity (§5.5)
        while True:
            await client.ws.ping()
            await asyncio.sleep(0.1)

    pinger = asyncio.create_task(ping_frames())
    try:
        error = (await client.until("error"))[-1]
    finally:
        pinger.cancel()
        await asyncio.gather(pinger, return_exceptions=True)
    assert (error["payload"]["code"], error["payload"]["reason_code"]) == ("idle_timeout", "idle_timeout")
    await client.closed_with(4000)


async def test_maximum_duration_closes_4003(deadline_server):
    client = await opened(deadline_server)
    events = []
    try:
        for n in range(60):  # active all along: only the duration can end it
            await client.send("ping", request_id=f"p{n}")
            events.append(await client.event(10))
            if events[-1]["type"] == "error":
                break
            await asyncio.sleep(0.1)
    except websockets.ConnectionClosed:
        pass  # closed between two pings: the error before the close is still to be read
    while not events or events[-1]["type"] != "error":
        events.append(await client.event(10))
    assert events[-1]["payload"]["reason_code"] == "max_duration_exceeded" and len(events) > 5
    await client.closed_with(4003)


# -- disconnects at every protocol point leave the engine at baseline ---------------------------------------
async def engine_holds_a_session(engine, timeout: float = 5.0) -> None:
    """Returns once the engine holds a session (parked waiting for audio, or running)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.metrics().sessions < 1:
        assert loop.time() < deadline, "the engine never took the connection's session"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("point", ["after_commit", "mid_append", "after_final", "vad_speech"])
async def test_disconnect_frees_the_engine(server, engine, audio, point, how):
    client = await opened(server)
    if point == "vad_speech":
        await client.send("session.update", {"turn_detection": {"type": "server_vad"}})
        await client.event()
        await client.append(audio[:2 * SAMPLING_RATE])
        await client.until("input_audio_buffer.speech_started")
    else:
        await client.send("input_audio_buffer.commit", {"final": False}, request_id="u")
    if point in ("mid_append", "after_final"):
        await client.append(audio[:2 * SAMPLING_RATE], request_id="u")
    if point == "mid_append":  # a large frame still in flight when the connection goes
        await client.send("input_audio_buffer.append", {"audio": "AAAA" * 200_000}, request_id="u")
    if point == "after_final":
        await client.send("input_audio_buffer.commit", {"final": True}, request_id="u")
        await client.until("transcription.delta")
    if point != "after_final":  # (there the delta showed it running; it may end on its own any moment now)
        await engine_holds_a_session(engine)
    if how == "close":
        await client.ws.close()
    else:  # the TCP connection vanishes without a closing handshake
        client.ws.transport.abort()
    await wait_engine_baseline(engine, timeout=5)
    await no_connections(server)
    assert engine.healthy
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url("/metrics", "http")) as response:
            metrics = await response.text()
    assert "\njaxstream_engine_sessions 0.0\n" in metrics and "\njaxstream_engine_healthy 1.0\n" in metrics


# -- fuzz ---------------------------------------------------------------------------------------------------
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | fuzz_text(12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(fuzz_text(8), inner,
                                                                                 max_size=3), max_leaves=8)
# Every type but `end`, which closes the socket the fuzz runs on.
_types = st.one_of(st.sampled_from(["ping", "pong", "cancel", "session.update", "input_audio_buffer.append",
                                    "input_audio_buffer.commit", "transcription.delta", ""]), _json)
_payloads = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "audio": st.one_of(_json, st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode())),
    "final": st.one_of(st.booleans(), _json), "model": st.one_of(st.just("MODEL"), _json),
    "reason": _json, "transcription_delay_ms": st.one_of(st.sampled_from([80, 480, 2400]), _json),
    "turn_detection": st.one_of(st.none(), st.just({"type": "server_vad"}), _json, st.fixed_dictionaries(
        {"type": st.just("semantic_vad")}, optional={"eagerness": _json}))}))
_envelopes = st.fixed_dictionaries({"type": _types}, optional={
    "session_id": st.one_of(fuzz_text(8), _json), "request_id": st.one_of(fuzz_text(8), _json),
    "payload": _payloads})
_frames = st.one_of(_envelopes.map(json.dumps), _json.map(json.dumps), st.text(max_size=40), st.binary(max_size=20))


async def test_fuzzed_frames_get_structured_errors_and_keep_the_socket(server, model, engine):
    """Any frames get only well-formed envelopes back and the socket stays open: after each sequence a
    sentinel's `unknown_event` error arrives, echoing its request_id. (A plain websocket: the server runs on
    its own thread, so blocking this test's loop is harmless.)"""
    with sync_connect(server.url("/ws"), max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames=st.lists(_frames, min_size=1, max_size=4))
        def check(frames):
            for frame in frames:
                ws.send(frame.replace('"MODEL"', json.dumps(model)) if isinstance(frame, str) else frame)
            ws.send(json.dumps({"type": "fuzz.sentinel", "request_id": "sentinel"}))
            while True:
                event = json.loads(ws.recv(timeout=30))
                assert isinstance(event, dict) and set(event) == {"type", "session_id", "request_id", "payload"}
                assert event["type"] in _REPLIES and isinstance(event["payload"], dict), event
                if event["type"] == "error":
                    payload = event["payload"]
                    assert set(payload) == {"code", "message", "reason_code", "details"}, event
                    assert isinstance(payload["code"], str) and isinstance(payload["reason_code"], str)
                    assert isinstance(payload["details"], dict) and payload["message"]
                    assert payload["message"] not in INTERNAL_ERRORS, event
                    if event["request_id"] == "sentinel":
                        assert payload["code"] == "unknown_event"
                        break

        check()
    await wait_engine_baseline(engine)
    assert engine.healthy
