"""Server VAD in vLLM's realtime dialect (the `turn_detection` extension of serving/vllm_realtime.py), over
loopback with a real `websockets` client: two espeak-ng sentences with 1.5 s of silence between them in one
stream, no commits, give two utterances whose boundaries are the synthesized ones and whose transcripts are
the engine's own for the audio each utterance held; `--compat vllm` ignores the field."""
import io
import shutil
import subprocess
import threading

import numpy as np
import pytest
import soundfile
import soxr

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import RealtimeClient, ServerThread
from jaxstream.serving import vad
from jaxstream.serving.vad import TurnSegmenter, parse_turn_detection, vad_config
from serve_fixtures import engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")]

SENTENCES = ("Good morning, how are you today?", "Please open the door for me.")
LEAD_S, GAP_S, TAIL_S = 0.6, 1.5, 1.2  # silence before, between and after the sentences
PREFIX_MS, SILENCE_MS = 300, 800
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": PREFIX_MS, "silence_duration_ms": SILENCE_MS}


def speak(text: str) -> np.ndarray:
    """espeak-ng's rendering of `text`, 16 kHz, trimmed to its speech (the boundaries the VAD must find)."""
    wav = subprocess.run(["espeak-ng", "--stdout", text], check=True, capture_output=True).stdout
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    audio = soxr.resample(audio, rate, SAMPLING_RATE).astype(np.float32)
    loud = np.flatnonzero(np.abs(audio) > 0.01)
    return audio[loud[0]:loud[-1] + 1]


@pytest.fixture(scope="module")
def stream():
    """(the whole stream, [(speech start, speech end) in seconds] for each sentence)."""
    silence = lambda s: np.zeros(int(s * SAMPLING_RATE), np.float32)  # noqa: E731
    pieces, spans, cursor = [silence(LEAD_S)], [], LEAD_S
    for n, text in enumerate(SENTENCES):
        speech = speak(text)
        spans.append((cursor, cursor + speech.size / SAMPLING_RATE))
        cursor += speech.size / SAMPLING_RATE + GAP_S
        pieces += [speech, silence(GAP_S if n + 1 < len(SENTENCES) else TAIL_S)]
    return np.concatenate(pieces), spans


@pytest.fixture(scope="module")
def vllm_server(engine):
    server = ServerThread(engine, ServerConfig(compat="vllm"))
    yield server
    server.close()


async def test_vad_turns_without_commits(server, engine, model, stream, monkeypatch):
    """No commit at all (and audio appended before VAD was on is segmented too): speech_started/stopped
    within 150 ms of the synthesized speech, then one transcription.done per sentence, in order, each
    equal to its concatenated deltas and to engine.transcribe of exactly the audio its turn held. The VAD
    model is taken (or loaded, ~40 ms) off the server's event loop."""
    acquire, threads = vad._POOL.acquire, []  # noqa: SLF001

    def recorded(rate):
        threads.append(threading.current_thread())
        return acquire(rate)

    monkeypatch.setattr(vad._POOL, "acquire", recorded)  # noqa: SLF001
    audio, spans = stream
    client = await RealtimeClient.connect(server.url())
    lead = int(LEAD_S * SAMPLING_RATE)
    await client.append(audio[:lead])  # held for a commit; the VAD, once on, takes it from the stream's start
    await client.update(model, turn_detection=VAD)
    updated = await client.event()
    assert updated["session"]["turn_detection"] == {**VAD, "idle_timeout_ms": None}
    step = int(0.32 * SAMPLING_RATE)
    for begin in range(lead, audio.size, step):
        await client.append(audio[begin:begin + step])
    events = []
    while sum(e["type"] == "transcription.done" for e in events) < len(SENTENCES):
        events.append(await client.event(60))
        assert events[-1]["type"] != "error", events[-1]
    await client.close()
    assert threads and server._thread not in threads  # noqa: SLF001
    kinds = [e["type"] for e in events]
    positions = lambda kind: [n for n, k in enumerate(kinds) if k == kind]  # noqa: E731
    stops, dones = positions("jaxstream.speech_stopped"), positions("transcription.done")
    assert all(stop < done for stop, done in zip(stops, dones))
    started = [e["audio_start_ms"] for e in events if e["type"] == "jaxstream.speech_started"]
    stopped = [e["audio_end_ms"] for e in events if e["type"] == "jaxstream.speech_stopped"]
    assert len(started) == len(stopped) == len(SENTENCES)
    for start_ms, end_ms, (start, end) in zip(started, stopped, spans):
        assert abs(start_ms / 1000 - start) <= 0.15 and abs(end_ms / 1000 - end) <= 0.15, (start_ms, end_ms, start, end)
    utterances, deltas = [], []
    for event in events:
        if event["type"] == "transcription.delta":
            deltas.append(event["delta"])
        elif event["type"] == "transcription.done":
            utterances.append(event)
            assert "".join(deltas) == event["text"]
            deltas = []
    for done, start_ms, end_ms in zip(utterances, started, stopped):
        # A turn holds its prefix padding, its speech, and the silence streamed to it until the stop was
        # detected (silence_duration_ms later, at an append's boundary); usage says how much in all.
        first = (start_ms - PREFIX_MS) * SAMPLING_RATE // 1000
        last = first + round(done["usage"]["audio_seconds"] * SAMPLING_RATE)
        assert 0 <= last / SAMPLING_RATE - end_ms / 1000 <= SILENCE_MS / 1000 + step / SAMPLING_RATE
        expected = await engine.transcribe(audio[first:last])
        assert done["text"] == expected.text and done["text"], (done["text"], expected.text)


async def test_final_ends_the_turn_in_progress_and_vad_turns_off(server, model, stream):
    """commit{final} mid-speech ends that turn (its done follows, no speech_stopped); commit{} does
    nothing; turn_detection cannot change while a turn transcribes, and null brings manual commits back."""
    audio, spans = stream
    client = await RealtimeClient.connect(server.url())
    await client.update(model, turn_detection=VAD)
    await client.event()
    await client.commit()  # no-op under VAD
    await client.append(audio[:int((spans[0][0] + 0.8) * SAMPLING_RATE)])  # into the first sentence
    assert (await client.event())["type"] == "jaxstream.speech_started"
    await client.update(model, turn_detection=None)
    error = await client.event()
    assert error["type"] == "error" and error["code"] == "invalid_request" and "turn_detection" in error["error"]
    await client.commit(final=True)
    events = await client.until("transcription.done")
    assert "jaxstream.speech_stopped" not in [e["type"] for e in events] and events[-1]["text"]
    await client.update(model, turn_detection=None)
    updated = await client.event()
    assert updated["type"] == "session.updated" and updated["session"]["turn_detection"] is None
    await client.commit(final=True)  # manual mode again: nothing runs
    assert (await client.event())["code"] == "no_active_generation"
    await client.close()


async def test_idle_timeout_is_reported_without_an_utterance(server, model, engine):
    client = await RealtimeClient.connect(server.url())
    await client.update(model, turn_detection={"type": "server_vad", "idle_timeout_ms": 5000})
    await client.event()
    for _ in range(4):
        await client.append(np.zeros(int(1.4 * SAMPLING_RATE), np.float32))
    timeout = await client.event()
    assert timeout["type"] == "jaxstream.timeout_triggered" and timeout["audio_start_ms"] == 0
    assert 5000 <= timeout["audio_end_ms"] <= 5600
    assert engine.metrics().sessions == 0  # silence is not transcribed
    await client.close()


async def test_segmenter_keeps_the_connection_clock_and_every_sample(stream):
    """TurnSegmenter alone: started after earlier audio it finds the same turns, shifted by that audio; a
    turn's audio is the stream itself from prefix_padding_ms before the speech on, no sample lost or doubled."""
    audio, _ = stream
    config = vad_config(parse_turn_detection(VAD))
    step, offset = int(0.32 * SAMPLING_RATE), 12345

    async def turns(stream_start):
        segmenter = TurnSegmenter(config, SAMPLING_RATE, stream_start)
        events = []
        for begin in range(0, audio.size, step):
            events += await segmenter.push(audio[begin:begin + step])
        segmenter.close()
        return events

    plain = await turns(0)
    assert [(e.kind, e.sample) for e in await turns(offset)] == [(e.kind, e.sample + offset) for e in plain]
    assert [e.kind for e in plain if e.kind != "speech"] == ["started", "stopped"] * len(SENTENCES)
    for event in plain:
        if event.kind == "started":
            first, held = event.sample - PREFIX_MS * SAMPLING_RATE // 1000, [event.audio]
        else:
            held.append(event.audio)
        if event.kind == "stopped":
            turn = np.concatenate(held)
            assert first + turn.size >= event.sample
            np.testing.assert_array_equal(turn, audio[first:first + turn.size])


@pytest.mark.parametrize("threshold", [0.15, 0.1])
async def test_a_low_threshold_still_ends_turns(stream, threshold):
    """threshold <= 0.15 (legal: [0, 1]): turns still end, in the silence after each sentence, as Silero's own
    stop threshold has a floor (max(threshold - 0.15, 0.01))."""
    audio, spans = stream
    config = vad_config(parse_turn_detection({**VAD, "threshold": threshold}))
    segmenter, events, step = TurnSegmenter(config, SAMPLING_RATE), [], int(0.32 * SAMPLING_RATE)
    for begin in range(0, audio.size, step):
        events += [e for e in await segmenter.push(audio[begin:begin + step]) if e.kind != "speech"]
    segmenter.close()
    assert [e.kind for e in events] == ["started", "stopped"] * len(SENTENCES), events
    for (started, stopped), (start, end) in zip(zip(events[::2], events[1::2]), spans):
        assert abs(started.sample / SAMPLING_RATE - start) <= 0.15, (started.sample, start)
        assert end - 0.15 <= stopped.sample / SAMPLING_RATE < end + GAP_S / 2, (stopped.sample, end)


async def test_null_settings_take_their_defaults(server, model, stream):
    """threshold, prefix_padding_ms and silence_duration_ms null count as absent (spec §4.3, "null clears"):
    the session says OpenAI's defaults and the VAD turns the first sentence into an utterance."""
    audio, spans = stream
    client = await RealtimeClient.connect(server.url())
    await client.update(model, turn_detection={"type": "server_vad", "threshold": None, "prefix_padding_ms": None,
                                               "silence_duration_ms": None, "idle_timeout_ms": None})
    updated = await client.event()
    assert updated["session"]["turn_detection"] == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                                    "silence_duration_ms": 500, "idle_timeout_ms": None}, updated
    await client.append(audio[:int((spans[0][1] + 1.0) * SAMPLING_RATE)])  # the first sentence and 1 s after it
    events = await client.until("transcription.done")
    await client.close()
    assert [e["type"] for e in events if e["type"].startswith("jaxstream.")] == [
        "jaxstream.speech_started", "jaxstream.speech_stopped"] and events[-1]["text"]


async def test_an_update_whose_vad_fails_to_start_changes_nothing(server, model, engine, stream, monkeypatch):
    """A segmenter that cannot be built fails the update as a whole: no session.updated, manual commits as
    before, and the audio held for a commit is still there."""
    import jaxstream.serving.vllm_realtime as vllm_realtime

    async def broken(*args, **kwargs):
        raise RuntimeError("no VAD model")

    audio, spans = stream
    held = audio[:int((spans[0][1] + 0.2) * SAMPLING_RATE)]  # the first sentence
    client = await RealtimeClient.connect(server.url())
    await client.update(model)
    await client.event()
    await client.append(held)
    monkeypatch.setattr(vllm_realtime, "start_turn_segmenter", broken)
    await client.update(model, turn_detection=VAD)
    error = await client.event()
    assert error["type"] == "error" and error["code"] == "processing_error", error
    monkeypatch.undo()
    await client.commit()
    await client.commit(final=True)
    done = (await client.until("transcription.done"))[-1]
    await client.close()
    assert done["usage"]["audio_seconds"] == pytest.approx(held.size / SAMPLING_RATE)
    assert done["text"] == (await engine.transcribe(held)).text and done["text"]


@pytest.mark.parametrize("turn_detection, contains", [
    ({"type": "loud_vad"}, "turn_detection.type"),
    ({"type": "server_vad", "threshold": 2}, "turn_detection.threshold"),
    ({"type": "semantic_vad", "eagerness": "eager"}, "turn_detection.eagerness"),
    ({"type": "semantic_vad", "eagerness": ["low"]}, "turn_detection.eagerness"),  # not an internal error
])
async def test_bad_turn_detection_is_refused(server, model, turn_detection, contains):
    client = await RealtimeClient.connect(server.url())
    await client.update(model, turn_detection=turn_detection)
    error = await client.event()
    assert error["type"] == "error" and error["code"] == "invalid_request" and contains in error["error"], error
    await client.commit()  # a failed update validates nothing
    assert (await client.event())["code"] == "model_not_validated"
    await client.close()


async def test_vllm_compat_ignores_turn_detection(vllm_server, model, stream):
    """As vLLM, which reads only `model`: no ack, no VAD events, the manual protocol as before."""
    audio, spans = stream
    client = await RealtimeClient.connect(vllm_server.url())
    await client.update(model, turn_detection=VAD)
    await client.append(audio[:SAMPLING_RATE])
    await client.commit()
    await client.commit(final=True)
    events = await client.until("transcription.done")
    assert {e["type"] for e in events} <= {"transcription.delta", "transcription.done"}
    await client.close()
