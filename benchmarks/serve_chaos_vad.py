"""Server-VAD behaviours of serve_chaos.py: `turn_detection` (OpenAI's server_vad object) on /v1/realtime, in vLLM's
protocol (jaxstream's extension: serving/vllm_realtime.py) and in OpenAI's dialect (serving/openai_realtime.py).
Speech between silences and no commit: the server cuts the turns and transcribes each; silence alone: nothing, or
with `idle_timeout_ms` the timeout event. A turn holds its prefix padding, its speech and the silence streamed up to
the append in which its stop was found, so its transcript is compared with other runs that cut the same stream into
appends of the same size.
"""
import json
import random

import numpy as np

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.vad import parse_turn_detection
from serve_chaos_clients import (RATE_24K, Bad, Chaos, Socket, append, behaviour, deltas, feed, openai_socket,
                                 openai_update, pieces)

VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 800}
LEAD_S, TAIL_S = 0.6, 1.5  # silence before the speech, and after it (longer than silence_duration_ms)
IDLE_MS = 5000  # the least idle_timeout_ms the server takes
SIZES_MS = (80, 250, 1000)  # append sizes (fixed, so that transcripts of the same cut repeat)


def stream(c: Chaos, rate: int, speech: bool, rng: random.Random) -> tuple[list[np.ndarray], int]:
    """(appends, their size in ms) of a stream: silence, the sample's speech, silence; or silence alone, longer than
    IDLE_MS."""
    pcm = (c.pcm if rate == SAMPLING_RATE else c.pcm24)["full"]
    quiet = lambda seconds: np.zeros(int(seconds * rate), np.float32)  # noqa: E731
    audio = np.concatenate([quiet(LEAD_S), pcm, quiet(TAIL_S)]) if speech else quiet(IDLE_MS / 1000 + 0.5)
    ms = rng.choice(SIZES_MS)
    return pieces(audio, rng, (ms * rate // 1000,)), ms


def check_timeout(event: dict, ms: int) -> None:
    """The timeout of IDLE_MS of silence from the stream's start, found in the append that crossed it."""
    if event["audio_start_ms"] != 0 or not IDLE_MS <= event["audio_end_ms"] <= IDLE_MS + ms:
        raise Bad(f"timeout_triggered after {IDLE_MS} ms of silence in {ms} ms appends: {event}")


@behaviour
async def realtime_vad(c, rng):
    """vLLM's protocol: per turn jaxstream.speech_started, jaxstream.speech_stopped, then its transcription.done,
    whose deltas (those since the previous done) add up to it. Silence alone: no event (a probe's error comes first);
    with idle_timeout_ms, jaxstream.timeout_triggered and no utterance."""
    speech, idle = rng.random() < 0.6, rng.random() < 0.5
    ws = await c.open("/v1/realtime")
    await ws.until("session.created")
    settings = {**VAD, "idle_timeout_ms": IDLE_MS} if idle and not speech else VAD
    await ws.send({"type": "session.update", "model": c.model, "turn_detection": settings})
    updated = (await ws.until("session.updated"))[-1]
    if updated["session"]["turn_detection"] != parse_turn_detection(settings):
        raise Bad(f"session.updated says turn_detection {updated['session']['turn_detection']}")
    chunks, ms = stream(c, SAMPLING_RATE, speech, rng)
    await feed(ws, chunks, append, rng)
    events = await probed(ws, "unknown_event")
    if not speech:
        kinds = [e["type"] for e in events]
        if kinds != (["jaxstream.timeout_triggered"] if idle and not speech else []):
            raise Bad(f"silence answered with {kinds}")
        if kinds:
            check_timeout(events[0], ms)
        return await ws.close()
    started = sum(e["type"] == "jaxstream.speech_started" for e in events)
    while sum(e["type"] == "transcription.done" for e in events) < started:
        events.append(await ws.recv())
    turns, order, said = [], [], []
    for event in events:
        kind = event["type"]
        order.append(kind.removeprefix("jaxstream."))
        if kind == "transcription.done":
            if deltas(said) != event["text"]:
                raise Bad(f"turn {len(turns) + 1}: deltas do not add up to its done's {event['text'][:80]!r}")
            turns.append(event["text"])
            said = []
        elif kind == "transcription.delta":
            said.append(event)
        elif kind not in ("jaxstream.speech_started", "jaxstream.speech_stopped"):
            raise Bad(f"unexpected {json.dumps(event)[:200]}")
    # Turn i: started, stopped, done in that order (turn i + 1 may start before turn i's done).
    marks = {kind: [n for n, k in enumerate(order) if k == kind] for kind in ("speech_started", "speech_stopped")}
    dones = [n for n, k in enumerate(order) if k == "transcription.done"]
    if not started or not all(a < b < d for a, b, d in zip(marks["speech_started"], marks["speech_stopped"], dones,
                                                             strict=True)):
        raise Bad(f"turn events out of order: {[k for k in order if k != 'transcription.delta']}")
    c.same(("vad", ms), " | ".join(turns))
    await ws.close()


async def probed(ws: Socket, code: str) -> list[dict]:
    """Sends an event the server refuses with `code` and returns every event before that error: the server answers
    frames in order, so what it sent while taking the audio comes first."""
    await ws.send({"type": "response.create"})
    events = []
    while (event := await ws.recv())["type"] != "error":
        events.append(event)
    if (event.get("error") if isinstance(event.get("error"), dict) else event).get("code") != code:
        raise Bad(f"the probe got {json.dumps(event)[:200]}")
    return events


@behaviour
async def openai_vad(c, rng):
    """OpenAI's dialect: per turn input_audio_buffer.speech_started, .speech_stopped and .committed of one item,
    whose deltas add up to its ...transcription.completed and which ends completed (conversation.item.done); items may
    complete in either order. Silence alone: no event; with idle_timeout_ms, input_audio_buffer.timeout_triggered, and
    the silent buffer committed as an item that completes."""
    speech, idle = rng.random() < 0.6, rng.random() < 0.5
    ws = await openai_socket(c, rng)
    settings = {**VAD, "idle_timeout_ms": IDLE_MS} if idle and not speech else VAD
    update = openai_update(c.model)
    update["session"]["audio"]["input"]["turn_detection"] = settings
    await ws.send(update)
    updated = (await ws.until("session.updated"))[-1]
    if updated["session"]["audio"]["input"]["turn_detection"] != parse_turn_detection(settings):
        raise Bad(f"session.updated says turn_detection {updated['session']['audio']['input']['turn_detection']}")
    await ws.until("rate_limits.updated")
    chunks, ms = stream(c, RATE_24K, speech, rng)
    await feed(ws, chunks, append, rng, RATE_24K)
    events = await probed(ws, "unsupported_event")
    opened = [e["item_id"] for e in events if e["type"] in ("input_audio_buffer.speech_started",
                                                            "input_audio_buffer.timeout_triggered")]
    if not speech and not idle:
        if events:
            raise Bad(f"silence answered with {[e['type'] for e in events]}")
        return await ws.close()
    if not opened:
        raise Bad(f"no turn in {'speech' if speech else 'silence with idle_timeout_ms'}")
    while sum(e["type"] == "conversation.item.done" for e in events) < len(opened):
        events.append(await ws.recv())
    transcripts = []
    for item in opened:
        mine = [e for e in events if e.get("item_id") == item or e.get("item", {}).get("id") == item]
        kinds = [e["type"] for e in mine if e["type"].startswith("input_audio_buffer.")]
        expected = (["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"] if speech
                    else ["input_audio_buffer.timeout_triggered"]) + ["input_audio_buffer.committed"]
        if kinds != expected:
            raise Bad(f"item {item}: {kinds}")
        (done,) = [e for e in mine if e["type"] == "conversation.item.input_audio_transcription.completed"]
        if deltas(mine) != done["transcript"]:
            raise Bad(f"item {item}: deltas do not add up to its transcript {done['transcript'][:80]!r}")
        if [e["item"]["status"] for e in mine if e["type"] == "conversation.item.done"] != ["completed"]:
            raise Bad(f"item {item} did not end completed")
        transcripts.append(done["transcript"])
    if not speech:
        check_timeout(next(e for e in events if e["type"] == "input_audio_buffer.timeout_triggered"), ms)
    else:
        c.same(("vad24", ms), " | ".join(transcripts))
    await ws.close()
