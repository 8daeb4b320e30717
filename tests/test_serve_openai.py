"""OpenAI's realtime transcription dialect on `/v1/realtime` (specs/realtime_protocols.md §4), driven over
loopback by the official `openai` SDK (GA shape) and by a plain `websockets` client (beta shape, G.711,
errors, fuzz): manual turns, input formats, switching dialect by the first event, drain, errors echoing the
client's event_id. Server VAD: test_serve_openai_vad.py."""
import asyncio
import base64
import json
import re
import warnings

import numpy as np
import pytest
import soxr
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as sync_connect

from jaxstream.serving.audio_codecs import G711_TABLES, encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.openai_session_config import LOGPROBS
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import INTERNAL_ERRORS, fuzz_text
from serve_fixtures import engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from serve_openai_fixtures import CHUNK_S, Client, at_24k, ga_update, pcm_base64, transcripts, wer
from serve_openai_fixtures import reference, speech  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


def g711_base64(pcm16k: np.ndarray, law: str) -> list[str]:
    """8 kHz G.711 of `pcm16k`, in CHUNK_S appends: each sample becomes the code whose value is nearest."""
    table = G711_TABLES[law]
    order = np.argsort(table)
    pcm = np.clip(soxr.resample(pcm16k, 16000, 8000), -1, 1)
    pos = np.clip(np.searchsorted(table[order], pcm), 1, 255)
    nearer_low = np.abs(pcm - table[order][pos - 1]) < np.abs(pcm - table[order][pos])
    codes = order[np.where(nearer_low, pos - 1, pos)].astype(np.uint8)
    step = int(CHUNK_S * 8000)
    return [base64.b64encode(codes[i:i + step].tobytes()).decode() for i in range(0, codes.size, step)]


# -- GA, through the official SDK -----------------------------------------------------------------------
async def test_sdk_manual_turns_pipeline(server, engine, model, speech, reference):
    """Two turns on one connection with manual commits, the second streamed right after the first commit:
    the SDK parses every event, items chain by previous_item_id, each transcript matches the 16 kHz one,
    and concatenated deltas equal the completed transcript. With logprobs included, every text token comes
    with its bytes and log-probability, as `engine.transcribe` gives them for the 16 kHz audio."""
    from openai import AsyncOpenAI

    audio = at_24k(speech)
    # The engine's own answer for this 24 kHz audio, resampled as a session's front end does (in one piece rather
    # than per append, and batched otherwise), for the logprobs: the resampler's chunk edges move a confident
    # token's logprob by f32 rounding and an unsure one's (-2.2 nats) by up to ~0.4 %.
    solo = await engine.transcribe(soxr.resample(audio, 24000, 16000, quality="HQ"), delay_ms=480)
    client = AsyncOpenAI(api_key="unused", websocket_base_url=server.url("/v1"))
    async with client.realtime.connect(model=model) as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.type == "transcription"
        limits = await conn.recv()  # the connection's budgets (serving/limits.py)
        assert limits.type == "rate_limits.updated"
        assert [(r.name, r.limit, r.reset_seconds) for r in limits.rate_limits] == [
            ("audio_seconds", int(server.state.config.limits.max_audio_seconds), None),
            ("session_seconds", int(server.state.config.limits.max_session_seconds), None)]
        assert all(0 <= r.limit - r.remaining <= 1 for r in limits.rate_limits)
        await conn.session.update(session={**ga_update(model, delay="medium")["session"], "include": [LOGPROBS]})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert (await conn.recv()).type == "rate_limits.updated"
        assert updated.session.audio.input.transcription.delay == "medium"
        assert updated.session.include == [LOGPROBS]
        for _ in range(2):
            for chunk in pcm_base64(audio, 24000):
                await conn.input_audio_buffer.append(audio=chunk)
            await conn.input_audio_buffer.commit()
        events, done = [], 0
        while done < 2:
            event = await asyncio.wait_for(conn.recv(), 60)
            events.append(event)
            done += event.type == "conversation.item.done"
    await client.close()
    kinds = [e.type for e in events]
    assert kinds.count("conversation.item.added") == 2 and kinds.count("input_audio_buffer.committed") == 2
    committed = [e for e in events if e.type == "input_audio_buffer.committed"]
    assert committed[0].previous_item_id is None and committed[1].previous_item_id == committed[0].item_id
    completed = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    for item in completed:
        deltas = "".join(e.delta for e in events if e.type.endswith("transcription.delta")
                         and e.item_id == item.item_id)
        assert deltas == item.transcript
        assert item.usage.total_tokens == item.usage.input_tokens + item.usage.output_tokens
        assert item.usage.input_token_details.audio_tokens > 0
        assert item.transcript == reference  # the engine resamples 24 kHz; the words do not move
        streamed = [lp for e in events if e.type.endswith("transcription.delta") and e.item_id == item.item_id
                    for lp in e.logprobs]
        assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in item.logprobs]
        # The bytes spell the transcript (SentencePiece's decode drops the first word's leading space).
        assert bytes(b for lp in item.logprobs for b in lp.bytes).decode().removeprefix(" ") == item.transcript
        expected = [lp for token, lp in zip(solo.token_ids, solo.logprobs) if not engine.tokenizer.is_control(token)]
        np.testing.assert_allclose([lp.logprob for lp in item.logprobs], expected, rtol=1e-2, atol=2e-3)
    done_items = [e.item for e in events if e.type == "conversation.item.done"]
    assert [i.id for i in done_items] == [c.item_id for c in committed]
    assert all(i.status == "completed" and i.content[0].transcript for i in done_items)


# -- formats --------------------------------------------------------------------------------------------
def test_g711_tables_match_audioop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    for law, decode in (("pcmu", audioop.ulaw2lin), ("pcma", audioop.alaw2lin)):
        expected = np.frombuffer(decode(bytes(range(256)), 2), "<i2") / 32768.0
        np.testing.assert_array_equal(G711_TABLES[law], expected.astype(np.float32))


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
async def test_g711_input(server, engine, model, speech, reference, law):
    """G.711 through the server transcribes exactly like the engine fed the same decoded 8 kHz samples.

    Not compared with the 16 kHz transcript: G.711 keeps only the band below 4 kHz, and the tiny test
    model, trained on 16 kHz audio, already changes most words of this sample when it is merely
    band-limited to 8 kHz and back (no companding at all), so no small WER bound against 16 kHz holds
    for it; the check that matters is that the wire and the resampler lose nothing more."""
    chunks = g711_base64(speech, law)
    client = await Client.connect(server)
    await client.until("session.created")
    await client.send(ga_update(model, {"type": f"audio/{law}"}))
    updated = (await client.until("session.updated"))[-1]
    assert updated["session"]["audio"]["input"]["format"] == {"type": f"audio/{law}"}
    for chunk in chunks:
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    await client.send({"type": "input_audio_buffer.commit"})
    (transcript,) = transcripts(await client.until("conversation.item.done")).values()
    await client.ws.close()
    session = await engine.start_transcription(sample_rate=8000)
    for chunk in chunks:
        await session.append(G711_TABLES[law][np.frombuffer(base64.b64decode(chunk), np.uint8)])
    await session.finish()
    expected = [event async for event in session][-1].text
    assert transcript == expected and transcript, (transcript, expected, reference)


async def test_beta_shape(server, model, speech, reference):
    """The SDK's beta client (`OpenAI-Beta: realtime=v1`): transcription_session.update with pcm16 and
    logprobs, items announced by conversation.item.created and no conversation.item.done."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="unused", websocket_base_url=server.url("/v1"))
    async with client.beta.realtime.connect(model=model) as conn:
        created = json.loads(await conn.recv_bytes())  # the beta SDK has no model of this event
        assert created["type"] == "transcription_session.created"
        await conn.transcription_session.update(session={
            "input_audio_format": "pcm16", "input_audio_transcription": {"model": model, "language": "en"},
            "turn_detection": None, "include": [LOGPROBS]}, event_id="u1")
        while (updated := await conn.recv()).type != "transcription_session.updated":
            pass
        assert updated.session.input_audio_transcription.language == "en" and updated.session.include == [LOGPROBS]
        for chunk in pcm_base64(at_24k(speech), 24000):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        events = []
        while not events or events[-1].type != "conversation.item.input_audio_transcription.completed":
            events.append(await asyncio.wait_for(conn.recv(), 60))
    await client.close()
    kinds = {e.type for e in events}
    assert "conversation.item.created" in kinds and "conversation.item.added" not in kinds
    completed = events[-1]
    assert wer(reference, completed.transcript) <= 0.1
    assert [lp.token for lp in completed.logprobs] and all(lp.logprob <= 0 for lp in completed.logprobs)


# -- the first event picks the dialect; drain ------------------------------------------------------------
async def test_an_openai_first_event_switches_the_dialect(server, model, speech, reference):
    """No OpenAI handshake: vLLM's session.created at connect, then an OpenAI-shaped session.update makes
    the connection OpenAI's: its session.created and session.updated follow, and turns work."""
    client = Client(await websockets.connect(server.url(), max_size=None))
    assert json.loads(await client.ws.recv())["id"].startswith("sess-")  # vLLM's
    await client.send({**ga_update(model), "event_id": "first"})
    kinds = [(await client.event())["type"] for _ in range(4)]
    assert kinds == ["session.created", "rate_limits.updated", "session.updated", "rate_limits.updated"]
    for chunk in pcm_base64(at_24k(speech), 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    await client.send({"type": "input_audio_buffer.commit"})
    assert list(transcripts(await client.until("conversation.item.done")).values()) == [reference]
    await client.ws.close()


async def test_a_beta_first_event_switches_to_the_beta_dialect(server, model, speech, reference):
    """No OpenAI handshake and transcription_session.update first: the connection speaks the beta dialect,
    as with the beta handshake (spec §4.2, §4.4): transcription_session.* and conversation.item.created, no
    GA event names."""
    client = Client(await websockets.connect(server.url(), max_size=None))
    assert json.loads(await client.ws.recv())["id"].startswith("sess-")  # vLLM's
    await client.send({"type": "transcription_session.update", "session": {
        "input_audio_format": "pcm16", "input_audio_transcription": {"model": model}, "turn_detection": None}})
    kinds = [(await client.event())["type"] for _ in range(4)]
    assert kinds == ["transcription_session.created", "rate_limits.updated", "transcription_session.updated",
                     "rate_limits.updated"]
    for chunk in pcm_base64(at_24k(speech), 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    await client.send({"type": "input_audio_buffer.commit"})
    events = await client.until("conversation.item.input_audio_transcription.completed")
    kinds = {e["type"] for e in events}
    assert "conversation.item.created" in kinds and not kinds & {"conversation.item.added", "conversation.item.done"}
    assert list(transcripts(events).values()) == [reference]
    await client.ws.close()


async def test_drain_commits_the_open_item_and_closes(engine, model, speech, reference):
    """A draining server commits the item still open, sends its transcript, then closes with 1001. Between the
    item's last delta and its transcript an `error` `server_draining` says the transcript covers only the audio
    received (the server, not the client, ended the item; nothing said so)."""

    server = ServerThread(engine)
    try:
        client = await Client.connect(server)
        await client.until("session.created")
        for chunk in pcm_base64(at_24k(speech), 24000):
            await client.send({"type": "input_audio_buffer.append", "audio": chunk})
        await client.until("conversation.item.added")
        draining = server.start_drain(3.0)
        events = await client.until("conversation.item.done")
        kinds = [e["type"] for e in events]
        committed, completed = (kinds.index("input_audio_buffer.committed"),
                                kinds.index("conversation.item.input_audio_transcription.completed"))
        assert set(kinds[committed + 1:completed - 1]) <= {"conversation.item.input_audio_transcription.delta"}
        notice = events[completed - 1]["error"]
        assert (notice["code"], notice["type"]) == ("server_draining", "server_error"), events[completed - 1]
        covered = re.search(r"the first ([0-9.]+) s of audio", notice["message"])
        assert float(covered.group(1)) == pytest.approx(speech.size / 16000, abs=0.011), notice
        assert list(transcripts(events).values()) == [reference]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await client.event(10)
        assert closed.value.rcvd.code == 1001
        assert await draining is True
    finally:
        server.close()


async def test_a_draining_server_drops_the_next_turns_audio_and_refuses_http_as_a_server_error(engine, model, speech):
    """A busy connection of a draining server commits its item and appends audio for the next turn: the server
    starts no new transcription and drops that audio without an error per append (a client still streaming would
    spend its error budget on them), refuses its commit as the server's `draining`, finishes the committed item
    (whole: the client ended it, so it is not marked truncated) and closes with 1001. The HTTP routes of the same
    server refuse with a 503 typed `server_error`, as OpenAI types a server that cannot serve (its 503
    "overloaded"; http_errors.error_type)."""
    import aiohttp


    server = ServerThread(engine)
    try:
        client = await Client.connect(server)
        await client.until("session.created")
        await client.send(ga_update(model))  # manual turns: the item stays open until the commit
        await client.until("session.updated")
        one_second = at_24k(speech[:16000])
        await client.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(one_second)})
        await client.until("conversation.item.added")  # an item with audio: drain waits for the connection
        draining = server.start_drain(30.0)
        async with aiohttp.ClientSession() as http, asyncio.timeout(30):
            while True:  # until the server drains: the HTTP routes then refuse as they do
                async with http.post(server.url("/v1/audio/transcriptions", "http"), data=b"") as response:
                    http_error = (response.status, (await response.json())["error"])
                if response.status == 503:
                    break
                await asyncio.sleep(0.05)
        assert (http_error[1]["code"], http_error[1]["type"]) == ("draining", "server_error"), http_error
        await client.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
        for index in range(3):
            await client.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(one_second),
                               "event_id": f"a{index}"})
        # Their commit: no item holds them, and the refusal is the server's (it was the client's
        # input_audio_buffer_commit_empty, "buffer only has 0ms of audio", for the 3 s it sent).
        await client.send({"type": "input_audio_buffer.commit", "event_id": "c2"})
        events = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                events.append(await client.event())
        assert closed.value.rcvd.code == 1001, closed.value
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert [(e["code"], e["type"], e["event_id"]) for e in errors] == [("draining", "server_error", "c2")], errors
        done = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
        assert len(done) == 1 and done[0]["transcript"] and "truncated" not in done[0], events
        assert not [e for e in events if e["type"] == "conversation.item.added"], events  # no new item opened
        assert await draining is True  # the committed item still finished
    finally:
        server.close()


# -- errors ---------------------------------------------------------------------------------------------
async def test_errors_echo_the_event_id_and_keep_the_socket(server, model, speech):
    client = await Client.connect(server)
    await client.until("rate_limits.updated")  # after session.created
    cases = [
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
        ({"type": "response.create"}, "unsupported_event", "type"),
        ({"type": "input_audio_buffer.append", "audio": "@@@"}, "invalid_audio", "audio"),
        ({"type": "input_audio_buffer.append"}, "invalid_event", "audio"),
        (ga_update("no-such-model"), "model_not_found", "session.audio.input.transcription.model"),
        (ga_update(model, {"type": "audio/pcm", "rate": 16000}), "invalid_value",
         "session.audio.input.format.rate"),
        (ga_update(model, delay="instant"), "invalid_value", "session.audio.input.transcription.delay"),
        (ga_update(model, language="klingon"), "invalid_value", "session.audio.input.transcription.language"),
        ({"type": "session.update", "session": {"type": "realtime"}}, "invalid_value", "session.type"),
        ({"type": "session.update", "session": {"include": ["item.input_audio_transcription.words"]}},
         "invalid_value", "session.include"),
        ({"type": "session.update", "session": {"include": "logprobs"}}, "invalid_type", "session.include"),
        # A list or an object where a name is expected: refused as a bad value, not an internal error.
        (ga_update(model, {"type": ["audio/pcm"]}), "invalid_value", "session.audio.input.format"),
        (ga_update(model, delay=["low"]), "invalid_value", "session.audio.input.transcription.delay"),
        (ga_update(model, turn_detection={"type": "semantic_vad", "eagerness": {"low": 1}}), "invalid_value",
         "session.audio.input.turn_detection.eagerness"),
        ({"type": "transcription_session.update", "session": {"input_audio_format": ["pcm16"]}}, "invalid_value",
         "session.input_audio_format"),
        ({"type": "transcription_session.update", "session": {"input_audio_transcription": {"delay": {}}}},
         "invalid_value", "session.input_audio_transcription.delay"),
    ]
    for n, (event, code, param) in enumerate(cases):
        await client.send({**event, "event_id": f"evt_{n}"})
        error = await client.event()
        assert error["type"] == "error", error
        assert error["error"]["code"] == code and error["error"]["event_id"] == f"evt_{n}", error
        assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    # Too short (50 ms) is refused like empty, and the audio stays: more audio then commits fine.
    short = at_24k(speech)[:1200]
    await client.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(short)})
    await client.send({"type": "input_audio_buffer.commit", "event_id": "short"})
    events = await client.until("error")
    assert events[-1]["error"]["code"] == "input_audio_buffer_commit_empty"
    assert events[-1]["error"]["event_id"] == "short"
    # clear drops the open item: cleared, and the item ends "incomplete".
    await client.send({"type": "input_audio_buffer.clear"})
    events = await client.until("input_audio_buffer.cleared")
    assert [e["item"]["status"] for e in events if e["type"] == "conversation.item.done"] == ["incomplete"]
    await client.send({"type": "input_audio_buffer.commit", "event_id": "after-clear"})
    assert (await client.until("error"))[-1]["error"]["event_id"] == "after-clear"
    await client.ws.close()


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | fuzz_text(12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(fuzz_text(8), inner,
                                                                                 max_size=3), max_leaves=8)


_types = st.sampled_from(["session.update", "transcription_session.update", "input_audio_buffer.append",
                          "input_audio_buffer.commit", "input_audio_buffer.clear", "response.create", "", "\ud800"])


# The session's enumerated fields, each a right value or any JSON (a list where a name is expected, ...).
_turn_detection = st.one_of(_json, st.fixed_dictionaries(
    {"type": st.sampled_from(["server_vad", "semantic_vad"])}, optional={"eagerness": _json, "threshold": _json}))


_input = st.fixed_dictionaries({}, optional={
    "format": st.one_of(_json, st.fixed_dictionaries({"type": st.one_of(st.just("audio/pcm"), _json)})),
    "transcription": st.one_of(_json, st.fixed_dictionaries({}, optional={
        "delay": st.one_of(st.just("low"), _json), "model": _json, "language": _json})),
    "noise_reduction": st.one_of(_json, st.fixed_dictionaries({"type": _json})), "turn_detection": _turn_detection})


_events = st.fixed_dictionaries({"type": _types}, optional={
    "event_id": _json, "audio": st.one_of(_json, st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode())),
    "session": st.one_of(_json, st.fixed_dictionaries({}, optional={
        "type": st.one_of(st.just("transcription"), _json), "input_audio_format": st.one_of(st.just("pcm16"), _json),
        "input_audio_transcription": st.one_of(_json, st.fixed_dictionaries({}, optional={"delay": _json})),
        "turn_detection": _turn_detection, "include": _json,
        "audio": st.fixed_dictionaries({}, optional={"input": st.one_of(_input, _json)})}))})


_frames = st.one_of(_events.map(json.dumps), _json.map(json.dumps), st.text(max_size=40))


async def test_fuzzed_events_get_well_formed_answers(server, engine):
    """Malformed OpenAI events get only well-formed events back and the socket stays open: after each
    sequence a sentinel's error arrives, echoing its event_id."""
    with sync_connect(server.url() + "?intent=transcription", max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames=st.lists(_frames, min_size=1, max_size=3))
        def check(frames):
            for frame in frames:
                ws.send(frame)
            ws.send(json.dumps({"type": "fuzz.sentinel", "event_id": "sentinel"}))
            while True:
                event = json.loads(ws.recv(timeout=30))
                assert isinstance(event, dict) and isinstance(event.get("event_id"), str), event
                if event["type"] == "error":
                    assert isinstance(event["error"]["code"], str) and event["error"]["message"]
                    assert event["error"]["message"] not in INTERNAL_ERRORS, event
                    assert event["error"]["event_id"] is None or isinstance(event["error"]["event_id"], str)
                    if event["error"]["event_id"] == "sentinel":
                        break
            ws.send(json.dumps({"type": "input_audio_buffer.clear"}))  # drop any item the frames opened
            while json.loads(ws.recv(timeout=30))["type"] != "input_audio_buffer.cleared":
                pass

        check()
    await wait_engine_baseline(engine)
    assert engine.healthy


async def test_vllm_clients_still_get_the_vllm_dialect(server):
    async with websockets.connect(server.url()) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["id"].startswith("sess-")


async def test_the_connections_end_for_its_own_conduct_is_the_clients_error(engine):
    """The error event before an idle connection is closed is typed as OpenAI types the end of a session that
    outlived its limit (`invalid_request_error`), as the HTTP streams type it; it said `server_error`."""
    server = ServerThread(engine, ServerConfig(limits=Limits(idle_timeout_s=0.5)))
    try:
        client = await Client.connect(server)
        assert (await client.event())["type"] == "session.created"
        while (event := await client.event(10))["type"] != "error":
            assert event["type"] == "rate_limits.updated", event
        error = event["error"]
        assert (error["code"], error["type"]) == ("idle_timeout", "invalid_request_error")
        await client.ws.close()
    finally:
        server.close()

