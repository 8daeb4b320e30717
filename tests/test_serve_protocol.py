"""`/v1/realtime` and the SageMaker route, driven over loopback by a real `websockets` client: the realtime
conformance list (specs/realtime_protocols.md §2, 25-54) in both compat modes, a hypothesis fuzz of
malformed frames, health, models and metrics. Auth, subprotocols and connection limits:
test_serve_auth_limits.py."""
import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as sync_connect

from jaxstream.serving.app import ServerState
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import RealtimeClient, ServerThread, stream_utterance, wait_engine_baseline
from serve_fixtures import INTERNAL_ERRORS, connected, expect_error, fuzz_text
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_server(engine):
    server = ServerThread(engine, ServerConfig(compat="vllm"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(engine, audio):
    """engine.transcribe's text for a few slices of the sample, computed once."""
    pieces = {"full": audio, "head": audio[:28000], "tail": audio[20000:]}

    async def run():
        return {name: (await engine.transcribe(pcm)).text for name, pcm in pieces.items()}

    return asyncio.run(run())




async def still_usable(client):
    await client.send({"type": "probe"})
    await expect_error(client, "unknown_event", "probe")


# -- 25-29: session events ----------------------------------------------------------------------------
async def test_connect_sends_session_created(server):
    import time

    client = await RealtimeClient.connect(server.url())
    assert client.created["type"] == "session.created"
    assert client.created["id"].startswith("sess-") and abs(client.created["created"] - time.time()) < 5
    await client.close()


async def test_update_is_acknowledged_in_strict_mode_and_silent_in_vllm_mode(server, vllm_server, model):
    client = await RealtimeClient.connect(server.url())
    await client.update(model, transcription_delay_ms=240)
    ack = await client.event()
    assert ack == {"type": "session.updated", "session": {"id": client.created["id"], "model": model,
                                                         "transcription_delay_ms": 240}}
    await client.close()
    client = await RealtimeClient.connect(vllm_server.url())
    await client.update(model)
    await still_usable(client)  # the first event after the update is the probe's error: no ack
    await client.close()


@pytest.mark.parametrize("update, code, contains", [
    ({"model": "no-such-model"}, "model_not_found", "The model `no-such-model` does not exist."),
    ({}, "invalid_event", "Missing required field: model"),
    ({"model": None}, "invalid_event", "Missing required field: model"),
    ({"model": ""}, "model_not_found", "``"),
    ({"model": 7}, "model_not_found", "`7`"),
    ({"model": "MODEL", "transcription_delay_ms": 100}, "invalid_request", "transcription_delay_ms"),
    ({"model": "MODEL", "transcription_delay_ms": True}, "invalid_request", "transcription_delay_ms"),
    # A string that holds an allowed number is shown as the string it is, not as the number.
    ({"model": "MODEL", "transcription_delay_ms": "480"}, "invalid_request", 'an integer, one of 80, '),
    ({"model": "MODEL", "transcription_delay_ms": "480"}, "invalid_request", '; got "480"'),
])
async def test_bad_session_update(server, model, update, code, contains):
    client = await RealtimeClient.connect(server.url())
    update = {k: (model if v == "MODEL" else v) for k, v in update.items()}
    await client.send({"type": "session.update", **update})
    await expect_error(client, code, contains)
    await client.commit()  # a failed update validates nothing
    await expect_error(client, "model_not_validated")
    await client.close()


async def test_empty_model_is_accepted_in_vllm_mode(vllm_server):
    client = await RealtimeClient.connect(vllm_server.url())
    await client.update("")
    await client.commit()
    await client.commit(final=True)
    done = (await client.until("transcription.done"))[-1]  # vLLM: an empty commit gives an empty done
    assert done["text"] == "" and set(done) == {"type", "text", "usage"}
    await client.close()


async def test_commit_before_update_starts_nothing(server, engine):
    client = await RealtimeClient.connect(server.url())
    await client.commit()
    await expect_error(client, "model_not_validated", "Model not validated")
    assert engine.metrics().sessions == 0
    await client.close()


# -- 30-37: appends and malformed events --------------------------------------------------------------
async def test_audio_appended_before_update_and_commit_is_transcribed(server, model, audio, reference):
    client = await RealtimeClient.connect(server.url())
    await client.append(audio)
    await client.update(model)
    await client.until("session.updated")
    await client.commit()
    await client.commit(final=True)
    done = (await client.until("transcription.done"))[-1]
    assert done["text"] == reference["full"]
    await client.close()


async def test_non_json_and_unknown_types_keep_the_socket(server):
    client = await RealtimeClient.connect(server.url())
    await client.send("{not json")
    await expect_error(client, "invalid_json", "Invalid JSON")
    await client.send({"type": "response.create"})
    await expect_error(client, "unknown_event", "Unknown event type: response.create")
    await client.send({"audio": "AAAA"})
    await expect_error(client, "unknown_event", "Unknown event type: None")
    await still_usable(client)
    await client.close()


@pytest.mark.parametrize("payload, strict_only", [
    ("AAA", False),  # bad padding
    (base64.b64encode(b"\x01\x02\x03").decode(), False),  # odd byte count
    ("", False),  # empty
    ("AAAA*AAAA", True),  # a junk character: vLLM drops it and decodes the rest
])
async def test_bad_audio_is_invalid_audio(server, vllm_server, model, payload, strict_only):
    client = await connected(server, model)
    await client.commit()
    await client.send({"type": "input_audio_buffer.append", "audio": payload})
    await expect_error(client, "invalid_audio", "Invalid audio data")
    await client.commit(final=True)  # nothing was queued: the utterance is empty
    await expect_error(client, "input_audio_buffer_commit_empty")
    await client.close()
    client = await connected(vllm_server, model)
    await client.send({"type": "input_audio_buffer.append", "audio": payload})
    if strict_only:
        await still_usable(client)
    else:
        event = await expect_error(client, "invalid_audio")
        assert event == {"type": "error", "error": "Invalid audio data", "code": "invalid_audio"}
    await client.close()


async def test_oversized_frames_close_with_1009_and_long_appends_are_refused(server, model):
    limits = server.state.config.limits
    too_big = server.state.metrics.connections_closed.labels(route="/v1/realtime", outcome="message_too_big")
    before = too_big._value.get()
    client = await connected(server, model)
    too_long = np.zeros(int(limits.max_append_seconds * 16000) + 2, np.float32)
    await client.append(too_long)
    await expect_error(client, "invalid_audio", "longer than")
    with pytest.raises(websockets.ConnectionClosed) as closed:
        # The server may close while the frame is still being sent (seen on a loaded machine).
        await client.send("x" * (limits.max_message_bytes + 1))
        await client.event()
    assert closed.value.rcvd.code == 1009
    # Logged and counted as such (aiohttp's close_code said 1006 after the failed close handshake).
    for _ in range(100):
        if too_big._value.get() > before:
            break
        await asyncio.sleep(0.1)
    assert too_big._value.get() == before + 1
    client = await connected(server, model)  # the server goes on
    await still_usable(client)
    await client.close()


@pytest.mark.parametrize("event, contains", [
    ({"type": "input_audio_buffer.append"}, "audio"),
    ({"type": "input_audio_buffer.append", "audio": 12}, "audio"),
    ({"type": "input_audio_buffer.commit", "final": "maybe"}, "final"),
    ({"type": "input_audio_buffer.commit", "final": None}, "final"),
    ([{"type": "session.update"}], "JSON object"),
    ("3", "JSON object"),
])
async def test_malformed_events_are_processing_errors(server, model, event, contains):
    client = await connected(server, model)
    await client.send(json.dumps(event))
    await expect_error(client, "processing_error", contains)
    await still_usable(client)
    await client.close()


# -- 38-43: utterances ----------------------------------------------------------------------------------
async def test_happy_path_deltas_done_words_and_usage(server, model, audio, reference, engine):
    client = await connected(server, model)
    result = await stream_utterance(client, audio)
    done = result["done"]
    assert "".join(text for text, _ in result["deltas"]) == done["text"] == reference["full"]
    assert all(text for text, _ in result["deltas"])  # no empty deltas
    usage = done["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == 1 + 32 + engine.default_delay_ms // 80
    assert usage["completion_tokens"] > 0 and usage["audio_seconds"] == pytest.approx(audio.size / 16000)
    assert [w["word"] for w in done["words"]] == done["text"].split()
    assert all(0 <= w["start"] <= w["end"] <= usage["audio_seconds"] for w in done["words"])
    await client.close()


async def test_vllm_mode_done_has_exactly_vllm_fields(vllm_server, model, audio, reference):
    client = await connected(vllm_server, model)
    done = (await stream_utterance(client, audio))["done"]
    assert done["text"] == reference["full"] and set(done) == {"type", "text", "usage"}
    assert set(done["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                                  "completion_tokens_details"}
    await client.close()


async def test_empty_commit_is_an_error_and_the_next_utterance_works(server, model, audio, reference):
    client = await connected(server, model)
    await client.commit()
    await client.commit(final=True)
    await expect_error(client, "input_audio_buffer_commit_empty")
    assert (await stream_utterance(client, audio))["done"]["text"] == reference["full"]
    await client.close()


async def test_commit_while_running(server, vllm_server, model, audio, reference):
    client = await connected(server, model)
    await client.commit()
    await client.append(audio[:16000])
    await client.commit()
    await expect_error(client, "generation_in_progress")
    await client.append(audio[16000:])
    await client.commit(final=True)
    assert (await client.until("transcription.done"))[-1]["text"] == reference["full"]
    await client.close()
    client = await connected(vllm_server, model)  # vLLM ignores it; the audio goes on the same utterance
    await client.commit()
    await client.append(audio[:16000])
    await client.commit()
    await client.append(audio[16000:])
    await client.commit(final=True)
    assert (await client.until("transcription.done"))[-1]["text"] == reference["full"]
    await client.close()


async def test_pipelined_next_utterance_keeps_its_audio(server, model, audio, reference):
    """final, then commit{} and the next utterance's audio before the first done: nothing is lost."""
    client = await connected(server, model)
    await client.commit()
    await client.append(audio[:28000])
    await client.commit(final=True)
    await client.append(audio[20000:25000])  # appended after final, before commit: kept for the next one
    await client.commit()
    await client.append(audio[25000:])
    await client.commit(final=True)
    first = await client.until("transcription.done")
    second = await client.until("transcription.done")
    assert first[-1]["text"] == reference["head"] and second[-1]["text"] == reference["tail"]
    assert "".join(e["delta"] for e in second[:-1]) == reference["tail"]
    await client.close()


async def test_audio_after_a_queued_final_waits_for_the_next_utterance(server, model, audio, engine):
    """A queued utterance (commit{} during finalisation) whose final also arrives before the first done holds
    only the audio up to that final: what follows is kept for the utterance after it (module table)."""
    first, queued, later = audio[:28000], audio[28000:40000], audio[40000:]
    client = await connected(server, model)
    await client.commit()
    await client.append(first)
    await client.commit(final=True)
    await client.commit()  # queued: starts when the first done is sent
    await client.append(queued)
    await client.commit(final=True)
    await client.append(later)  # after the queued one's final: the next utterance's
    dones = [(await client.until("transcription.done"))[-1] for _ in range(2)]
    await client.commit()
    await client.commit(final=True)
    dones.append((await client.until("transcription.done"))[-1])
    await client.close()
    for done, pcm in zip(dones, (first, queued, later)):
        assert done["usage"]["audio_seconds"] == pytest.approx(pcm.size / 16000), (done, pcm.size)
        assert done["text"] == (await engine.transcribe(pcm)).text


async def test_audio_is_held_again_once_vad_went_on_and_off_after_an_early_end(server, model, audio, engine,
                                                                              monkeypatch):
    """The engine ended an utterance on its own (an end-of-text id; here [STREAMING_PAD] stands in for it, so
    the first decode step ends it): strict mode then drops audio until the next commit. Turning VAD on and
    off meanwhile starts over: audio appended after that is held for the next commit, as always (it used to
    be dropped, and that commit started an empty utterance)."""
    client = await connected(server, model)
    monkeypatch.setattr(engine.core, "eos_id", engine.tokenizer.streaming_pad_id)
    await client.commit()
    await client.append(audio[:20000])
    ended = (await client.until("transcription.done"))[-1]  # without a final: the engine ended it
    assert ended["usage"]["audio_seconds"] < audio.size / 16000
    await engine.wait_until_idle()
    monkeypatch.undo()
    await client.update(model, turn_detection={"type": "server_vad"})
    assert (await client.event())["type"] == "session.updated"
    await client.update(model, turn_detection=None)
    assert (await client.event())["type"] == "session.updated"
    await client.append(audio)
    await client.commit()
    await client.commit(final=True)
    done = (await client.until("transcription.done"))[-1]
    await client.close()
    assert done["usage"]["audio_seconds"] == pytest.approx(audio.size / 16000)
    assert done["text"] == (await engine.transcribe(audio)).text


async def test_stray_final_is_an_error_and_does_not_poison_the_next_utterance(server, vllm_server, model, audio,
                                                                              reference):
    client = await connected(server, model)
    await client.commit(final=True)
    await expect_error(client, "no_active_generation")
    assert (await stream_utterance(client, audio))["done"]["text"] == reference["full"]
    await client.commit(final=True)  # a duplicate final after done
    await expect_error(client, "no_active_generation", "No transcription is running")
    await client.commit()
    await client.append(audio)
    await client.commit(final=True)
    await client.commit(final=True)  # a duplicate final before done: the error says why, the done still comes
    events = []
    while not events or events[-1]["type"] != "transcription.done":
        events.append(await client.event())
    errors = [e for e in events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["no_active_generation"], errors
    assert "already ended (final was sent): wait for its transcription.done" in errors[0]["error"]
    assert events[-1]["text"] == reference["full"]
    await client.close()
    client = await connected(vllm_server, model)
    await client.commit(final=True)  # vLLM: silent; jaxstream does not reproduce the poisoning
    assert (await stream_utterance(client, audio))["done"]["text"] == reference["full"]
    await client.close()


async def test_two_sequential_utterances_are_independent(server, model, audio, reference):
    client = await connected(server, model)
    first = await stream_utterance(client, audio[:28000])
    second = await stream_utterance(client, audio[20000:])
    assert first["done"]["text"] == reference["head"] and second["done"]["text"] == reference["tail"]
    await client.close()


async def test_per_session_delay(server, model, audio, engine):
    client = await connected(server, model, transcription_delay_ms=160)
    done = (await stream_utterance(client, audio))["done"]
    assert done["usage"]["prompt_tokens"] == 1 + 32 + 2
    assert done["text"] == (await engine.transcribe(audio, delay_ms=160)).text
    await client.close()


# -- 51-54 ----------------------------------------------------------------------------------------------
async def test_binary_frames(server, vllm_server, model):
    client = await connected(server, model)
    await client.send(b"\x00\x01binary")
    await expect_error(client, "invalid_frame")
    await still_usable(client)
    await client.close()
    client = await connected(vllm_server, model)
    await client.send(b"\x00\x01binary")
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await client.event()
    assert closed.value.rcvd.code == 1003


async def metrics_text(server) -> str:
    async with aiohttp.ClientSession() as http, http.get(server.url("/metrics", "http")) as response:
        assert response.status == 200
        return await response.text()


def metric(text: str, line_start: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    assert len(values) == 1, line_start
    return values[0]


async def test_connection_metrics_go_up_and_down(server, model, audio):
    open_now = 'jaxstream_ws_connections{route="/v1/realtime"}'
    durations = 'jaxstream_ws_connection_duration_seconds_count{route="/v1/realtime"}'
    for _ in range(250):  # an earlier test's connection may still be closing on the server's side
        before = await metrics_text(server)
        if metric(before, open_now) == 0:
            break
        await asyncio.sleep(0.02)
    assert metric(before, open_now) == 0
    client = await connected(server, model)
    await client.send("oops")
    await expect_error(client, "invalid_json")
    assert metric(await metrics_text(server), open_now) == metric(before, open_now) + 1
    await stream_utterance(client, audio[:16000])
    await client.close()
    for _ in range(250):  # the engine's metrics snapshot trails its state by a tick or so
        after = await metrics_text(server)
        if metric(after, open_now) == metric(before, open_now) and metric(after, "jaxstream_engine_sessions") == 0:
            break
        await asyncio.sleep(0.02)
    assert metric(after, durations) >= metric(before, durations) + 1
    assert metric(after, 'jaxstream_errors_total{code="invalid_json"}') >= 1
    assert metric(after, "jaxstream_engine_sessions") == 0
    assert metric(after, "jaxstream_first_delta_seconds_count") >= 1
    assert metric(after, "jaxstream_finalize_seconds_count") >= 1
    assert metric(after, "jaxstream_tick_seconds_count") >= 1
    assert 'jaxstream_kv_pages_used{pool="decoder"}' in after


async def test_health_and_models(server, model):
    """/health, open to anyone, says the state alone: it named the model, whose id may be a path on the server
    (/v1/models, behind the key, has it), and why a load failed (vLLM's has no body at all)."""
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/healthz", "/ping"):
            async with http.get(server.url(path, "http")) as response:
                assert response.status == 200 and await response.json() == {"status": "ok"}
        async with http.get(server.url("/v1/models", "http")) as response:
            body = await response.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [model]
    failed = ServerState(ServerConfig(served_model_name="/srv/models/private"))
    failed.load_error = FileNotFoundError("no params.json in /srv/models/private")
    assert failed.health() == (503, {"status": "failed"})


# -- SageMaker route ------------------------------------------------------------------------------------
async def test_sagemaker_route_gives_the_same_transcript_and_takes_binary_json(server, model, audio, reference):
    client = await RealtimeClient.connect(server.url("/invocations-bidirectional-stream"))
    assert client.created["type"] == "session.created"
    await client.send(json.dumps({"type": "session.update", "model": model}).encode())
    assert (await client.event())["type"] == "session.updated"
    await asyncio.wait_for(await client.ws.ping(), 10)  # protocol pings are answered
    await client.send(b"\xff\xfe")
    await expect_error(client, "invalid_json")
    result = await stream_utterance(client, audio, chunk=2048)  # the SageMaker example's 4 KB chunks
    assert result["done"]["text"] == reference["full"]
    await client.close()


# -- fuzz -------------------------------------------------------------------------------------------------
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | fuzz_text(20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(fuzz_text(8), inner,
                                                                                 max_size=4), max_leaves=12)
_types = st.sampled_from(["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                          "transcription.delta", "", "error", "\ud800"])
_audio = st.one_of(st.text(max_size=40), st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
                   _json)
_events = st.fixed_dictionaries({"type": _types}, optional={
    "model": st.one_of(st.just("MODEL"), _json), "audio": _audio, "final": _json,
    "transcription_delay_ms": st.one_of(st.integers(-100, 3000), _json),
    "turn_detection": st.one_of(_json, st.fixed_dictionaries(
        {"type": st.sampled_from(["server_vad", "semantic_vad", "vad"])},
        optional={"threshold": _json, "silence_duration_ms": _json, "eagerness": _json}))})
_frames = st.one_of(
    _events.map(json.dumps), _json.map(json.dumps), st.text(max_size=60), st.binary(max_size=60),
    st.lists(_events, min_size=1, max_size=3).map(json.dumps))
_REPLIES = {"error", "session.updated", "transcription.delta", "transcription.done", "jaxstream.speech_started",
            "jaxstream.speech_stopped", "jaxstream.timeout_triggered"}


async def test_fuzzed_frames_get_structured_answers_and_keep_the_socket(server, model, engine, audio, reference):
    """Any sequence of frames gets only well-formed events back, and the socket stays open: after each
    sequence a sentinel event's `unknown_event` error arrives last. (A plain websocket: the server runs on
    its own thread, so blocking this test's loop is harmless.)"""
    with sync_connect(server.url(), max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames=st.lists(_frames, min_size=1, max_size=4))
        def check(frames):
            for frame in frames:
                ws.send(frame.replace('"MODEL"', json.dumps(model)) if isinstance(frame, str) else frame)
            ws.send(json.dumps({"type": "fuzz.sentinel"}))
            while True:
                event = json.loads(ws.recv(timeout=30))
                assert isinstance(event, dict) and event.get("type") in _REPLIES, event
                if event["type"] == "error":
                    assert isinstance(event["code"], str) and isinstance(event["error"], str) and event["error"]
                    assert event["error"] not in INTERNAL_ERRORS, event
                    if event["error"] == "Unknown event type: fuzz.sentinel":
                        break

        check()
    await wait_engine_baseline(engine)
    assert engine.healthy
    client = await connected(server, model)
    assert (await stream_utterance(client, audio))["done"]["text"] == reference["full"]
    await client.close()
