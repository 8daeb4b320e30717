"""Server VAD in OpenAI's realtime transcription dialect on `/v1/realtime` (specs/realtime_protocols.md §4):
`turn_detection` (server_vad, semantic_vad) cuts the turns itself, driven over loopback by the official `openai`
SDK and a plain `websockets` client: where speech starts and stops, the idle timeout, defaults, an engine that
refuses a turn's item, a VAD that fails to start."""
import asyncio
import base64

import numpy as np
import pytest

from jaxstream.serving.audio_codecs import encode_pcm16_base64
from serve_fixtures import engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from serve_openai_fixtures import Client, at_24k, ga_update, pcm_base64, transcripts, wer
from serve_openai_fixtures import reference, speech  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


async def test_server_vad_splits_two_sentences(server, model, speech, reference):
    """Two sentences with 1.5 s of silence between them in one stream, through the SDK: two items committed by
    the server, speech_started/stopped within 150 ms of where the speech really starts and stops."""
    silence = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    stream = np.concatenate([silence(0.6), speech, silence(1.5), speech, silence(1.2)])
    loud = np.convolve(np.abs(speech), np.ones(160) / 160, "same") > 0.02
    first, last = np.flatnonzero(loud)[[0, -1]] / 16000
    starts = [0.6 + first, 0.6 + speech.size / 16000 + 1.5 + first]
    stops = [0.6 + last, 0.6 + speech.size / 16000 + 1.5 + last]
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="unused", websocket_base_url=server.url("/v1"))
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session=ga_update(model, turn_detection={
            "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 800})["session"])
        while (updated := await conn.recv()).type != "session.updated":
            pass
        assert updated.session.audio.input.turn_detection.silence_duration_ms == 800
        for chunk in pcm_base64(at_24k(stream), 24000):
            await conn.input_audio_buffer.append(audio=chunk)
        events = []
        while sum(e.type == "conversation.item.done" for e in events) < 2:
            events.append(await asyncio.wait_for(conn.recv(), 60))
    await client.close()
    started = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    arrived = [(e.type, getattr(e, "item_id", None) or getattr(getattr(e, "item", None), "id", None),
                getattr(getattr(e, "item", None), "status", None) or getattr(e, "error", None)) for e in events]
    assert len(started) == len(stopped) == 2, arrived
    for event, expected in zip(started, starts):
        assert abs(event.audio_start_ms / 1000 - expected) <= 0.15, (event, expected)
    for event, expected in zip(stopped, stops):
        assert abs(event.audio_end_ms / 1000 - expected) <= 0.15, (event, expected)
    texts = {e.item_id: e.transcript for e in events
             if e.type == "conversation.item.input_audio_transcription.completed"}
    # The two items are transcribed at once (the second turn streams while the first is finishing), so their
    # transcripts may complete in either order (under the full suite's load the second came first).
    assert [e.item_id for e in started] == [e.item_id for e in stopped], arrived
    assert sorted(texts) == sorted(e.item_id for e in started), arrived
    for text in texts.values():
        # Each item also holds 300 ms of prefix padding and the silence up to the stop's detection: a
        # different context than the bare speech, which may move the tiny model's last word.
        assert wer(reference, text) <= 0.2, (reference, text)


async def test_idle_timeout_and_semantic_vad(server, model):
    """No speech for idle_timeout_ms: timeout_triggered, and the silent buffer is committed as an item.
    semantic_vad is accepted (served as server VAD, its eagerness picking the silence duration)."""
    client = await Client.connect(server)
    await client.until("session.created")
    await client.send(ga_update(model, turn_detection={"type": "server_vad", "idle_timeout_ms": 5000}))
    await client.until("session.updated")
    for chunk in pcm_base64(np.zeros(int(5.3 * 24000), np.float32), 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    events = await client.until("conversation.item.done")
    (timeout,) = [e for e in events if e["type"] == "input_audio_buffer.timeout_triggered"]
    assert timeout["audio_start_ms"] == 0 and 5000 <= timeout["audio_end_ms"] <= 5400
    assert [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"] == [timeout["item_id"]]
    await client.send(ga_update(model, turn_detection={"type": "semantic_vad", "eagerness": "high"}))
    updated = (await client.until("session.updated"))[-1]
    assert updated["session"]["audio"]["input"]["turn_detection"] == {"type": "semantic_vad", "eagerness": "high"}
    await client.ws.close()


async def test_vad_times_stay_on_the_connection_clock_across_a_format_change(server, model, speech):
    """2 s of G.711 (8 kHz), cleared; then 24 kHz PCM with server VAD: speech_started/stopped count those 2 s
    as 2 s, within 150 ms of where the speech really starts and stops."""
    client = await Client.connect(server)
    await client.until("session.created")
    await client.send(ga_update(model, fmt={"type": "audio/pcmu"}))
    await client.until("session.updated")
    await client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\xff" * 16000).decode()})
    await client.send({"type": "input_audio_buffer.clear"})
    await client.until("input_audio_buffer.cleared")
    await client.send(ga_update(model, turn_detection={"type": "server_vad", "silence_duration_ms": 800}))
    await client.until("session.updated")
    lead = 2.0 + 1.0  # the G.711 audio, then the silence before the speech
    stream = np.concatenate([np.zeros(16000, np.float32), speech, np.zeros(int(1.2 * 16000), np.float32)])
    for chunk in pcm_base64(at_24k(stream), 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    events = await client.until("conversation.item.done")
    await client.ws.close()
    loud = np.convolve(np.abs(speech), np.ones(160) / 160, "same") > 0.02
    first, last = np.flatnonzero(loud)[[0, -1]] / 16000
    (started,) = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    (stopped,) = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert abs(started["audio_start_ms"] / 1000 - (lead + first)) <= 0.15, (started, lead + first)
    assert abs(stopped["audio_end_ms"] / 1000 - (lead + last)) <= 0.15, (stopped, lead + last)


async def test_null_vad_settings_take_their_defaults(server, model, speech):
    """threshold, prefix_padding_ms and silence_duration_ms null in server_vad count as absent ("null clears",
    spec §4.3): the session says OpenAI's defaults, as for a bare server_vad, and the VAD turns speech into an
    item."""
    client = await Client.connect(server)
    await client.until("session.created")
    await client.send(ga_update(model, turn_detection={"type": "server_vad"}))
    bare = (await client.until("session.updated"))[-1]["session"]["audio"]["input"]["turn_detection"]
    await client.send(ga_update(model, turn_detection=None))
    await client.until("session.updated")
    await client.send(ga_update(model, turn_detection={"type": "server_vad", "threshold": None,
                                                       "prefix_padding_ms": None, "silence_duration_ms": None,
                                                       "idle_timeout_ms": None}))
    updated = (await client.until("session.updated"))[-1]["session"]["audio"]["input"]["turn_detection"]
    assert updated == bare == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                               "silence_duration_ms": 500, "idle_timeout_ms": None}
    stream = np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(16000, np.float32)])
    for chunk in pcm_base64(at_24k(stream), 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    events = await client.until("conversation.item.done")
    await client.ws.close()
    assert "error" not in {e["type"] for e in events}, events
    assert [e["type"] for e in events if e["type"].startswith("input_audio_buffer.")] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]


async def vad_turn_with_items_refused(server, model, speech, monkeypatch, refuse):
    """(a client in server-VAD mode whose items' engine sessions `refuse` opens, one turn of speech at 24 kHz)."""
    import jaxstream.serving.openai_realtime as openai_realtime

    client = await Client.connect(server)
    await client.until("session.created")
    await client.send(ga_update(model, turn_detection={"type": "server_vad"}))
    await client.until("session.updated")
    monkeypatch.setattr(openai_realtime, "start_session", refuse)
    return client, at_24k(np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(16000, np.float32)]))


async def test_a_turn_whose_item_cannot_open_still_stops(server, model, speech, monkeypatch):
    """The engine refuses the item of a VAD turn (at capacity): the client gets the error, then the turn's
    speech_stopped all the same (one append held the whole turn: its stop used to be skipped with the rest of
    the append's turn events), and the next turn is an item as usual."""
    import jaxstream.serving.openai_realtime as openai_realtime
    from jaxstream.errors import CapacityError

    start_session = openai_realtime.start_session

    async def refused_once(*args, **kwargs):
        monkeypatch.setattr(openai_realtime, "start_session", start_session)
        raise CapacityError("the engine holds 64 sessions, its limit; try again later")

    client, stream = await vad_turn_with_items_refused(server, model, speech, monkeypatch, refused_once)
    await client.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(stream)})
    events = [e for e in await client.until("input_audio_buffer.speech_stopped")
              if e["type"] != "rate_limits.updated"]
    assert [e["type"] for e in events] == ["input_audio_buffer.speech_started", "error",
                                           "input_audio_buffer.speech_stopped"], events
    assert events[1]["error"]["code"] == "capacity" and events[2]["item_id"] is None
    await client.send({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(stream)})
    events = await client.until("conversation.item.done")
    await client.ws.close()
    assert "error" not in {e["type"] for e in events}, events


async def test_a_turn_at_capacity_is_one_error_however_many_appends_it_spans(server, model, speech, monkeypatch):
    """The engine is at capacity for a whole VAD turn streamed in 320 ms appends: one error for the turn, not
    one per append (each speech push used to try to open an item again: a 12 s turn at 50 appends a second
    is the 600 errors a minute that close the connection), then its speech_stopped."""
    from jaxstream.errors import CapacityError

    async def refused(*args, **kwargs):
        raise CapacityError("the engine holds 64 sessions, its limit; try again later")

    client, stream = await vad_turn_with_items_refused(server, model, speech, monkeypatch, refused)
    for chunk in pcm_base64(stream, 24000):
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    events = [e for e in await client.until("input_audio_buffer.speech_stopped")
              if e["type"] != "rate_limits.updated"]
    await client.ws.close()
    assert [e["type"] for e in events] == ["input_audio_buffer.speech_started", "error",
                                           "input_audio_buffer.speech_stopped"], [e["type"] for e in events]


async def test_an_update_whose_vad_fails_to_start_changes_nothing(server, model, speech, reference, monkeypatch):
    """A segmenter that cannot be built fails the update as a whole: the session stays as it was (format and
    manual turns), as the spec's "session.updated: the effective configuration" must then say."""
    import jaxstream.serving.openai_realtime as openai_realtime

    async def broken(*args, **kwargs):
        raise RuntimeError("no VAD model")

    client = await Client.connect(server)
    await client.until("session.created")
    monkeypatch.setattr(openai_realtime, "start_turn_segmenter", broken)
    await client.send(ga_update(model, fmt={"type": "audio/pcmu"}, turn_detection={"type": "server_vad"}))
    error = (await client.until("error"))[-1]
    assert error["error"]["code"] == "processing_error", error
    monkeypatch.undo()
    await client.send({"type": "session.update", "session": {"type": "transcription"}})
    session = (await client.until("session.updated"))[-1]["session"]["audio"]["input"]
    assert session["turn_detection"] is None and session["format"] == {"type": "audio/pcm", "rate": 24000}
    for chunk in pcm_base64(at_24k(speech), 24000):  # manual turns at 24 kHz, as before the update
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
    await client.send({"type": "input_audio_buffer.commit"})
    assert list(transcripts(await client.until("conversation.item.done")).values()) == [reference]
    await client.ws.close()

