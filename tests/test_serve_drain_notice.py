"""A draining server (SIGTERM: app.drain) that ends a stream's input itself says so: an `error` `server_draining`,
naming the seconds of audio the output covers, comes after the last delta and right before the done (vLLM's protocol
in strict mode, /ws, HTTP streaming input); `--compat vllm` sends what vLLM would, the done only. Before, the done
came as if the client had ended the audio: a transcript cut at 28.6 s of a 58.7 s file looked complete. The done
(vLLM's protocol, the OpenAI dialect's completed transcript, HTTP's `transcript.text.done` and Mode B's result) says
it too, for a client that reads it alone. A Mode A input its start policy still holds back has no transcript to
finish: it is stopped, saying why. Audio a client appends after the drain ended its utterance is dropped without an
answer, not held for an utterance that will never start (held, it reached max_pending_seconds and was answered with
audio_limit_exceeded) nor refused (the OpenAI dialect answered each append with an error); so are the chunks of a
Mode A body, where a Mode B chunk gets a 409 `input_finished`. More drain tests of the OpenAI dialect and of
Kyutai's protocol are in their own modules (test_serve_openai.py, test_serve_kyutai.py), those of text completions
over HTTP in test_serve_drain_http_text.py.

The oracle of a transcript is the engine's own for the audio the server says it received, as sent (PCM16); the
OpenAI dialect's (24 kHz, which engine.transcribe does not take) and Mode B's are checked against their deltas."""
import asyncio
import contextlib
import json

import aiohttp
import numpy as np
import pytest
import soxr
import websockets

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving import streaming_input
from jaxstream.serving.audio_codecs import decode_pcm16_base64, encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_sessions import STREAMING_INPUT
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import RealtimeClient, ServerThread
from serve_fixtures import audio, engine, engine_returns_to_baseline  # noqa: F401 - pytest fixtures
from test_serve_http import SESSIONS, call, parse_sse

pytestmark = pytest.mark.slow

PIECE = SAMPLING_RATE // 2  # samples per append
# A client sending faster than real time, as a file client does: between the drain's end of its utterance and the
# done (the engine computes the audio it had queued) appends keep coming, and they must not be answered.
SPEEDUP = 8
# Under one append: a client whose appends the drain's server held for a later utterance was refused at once.
PENDING_LIMIT = Limits(max_pending_seconds=0.25)
CHUNK_S = 2.0  # Mode B's chunks
DRAIN_S = 4.0  # the drain ends running inputs itself half-way (app.drain keeps the rest for their flush)


def as_sent(pcm: np.ndarray) -> np.ndarray:
    return decode_pcm16_base64(encode_pcm16_base64(pcm), max_samples=pcm.size)


async def send_until_closed(send, audio: np.ndarray, sent: list) -> None:
    """Sends `audio` in PIECEs, over and over, at SPEEDUP times real time (the engine's backpressure may slow it
    more), until the socket closes; `sent` gets each piece whose send completed."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            for begin in range(0, audio.size, PIECE):
                await send(audio[begin:begin + PIECE])
                sent.append(audio[begin:begin + PIECE])
                await asyncio.sleep(PIECE / SAMPLING_RATE / SPEEDUP)


async def events_until_closed(receive) -> tuple[list, int]:
    """(every event until the server closes, the close code)."""
    events = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            events.append(await receive())
    return events, closed.value.rcvd.code


def drained_sse(events: list) -> tuple[dict, dict]:
    """(the notice, the done) of a drained HTTP transcript stream, checked: the notice is its one error, after the
    last delta and right before the done, which says it too (`truncated`, `truncation`), both naming the done's own
    seconds. The notice was logged when the drain ended the input, so deltas of the audio the engine still had queued
    came after it."""
    kinds = [event if event == "[DONE]" else event["type"] for event in events]
    assert kinds[-3:] == ["error", "transcript.text.done", "[DONE]"] and kinds.count("error") == 1, kinds
    notice, done = events[-3]["error"], events[-2]
    seconds = done["usage"]["seconds"]
    assert (notice["code"], notice["type"]) == ("server_draining", "server_error"), notice
    assert f"the first {seconds:.2f} s of audio" in notice["message"], notice
    assert done["truncated"] is True, done
    assert done["truncation"] == {"code": "server_draining", "message": notice["message"], "audio_seconds": seconds}
    assert "".join(event["delta"] for event in events[:-3]) == done["text"]
    return notice, done


async def check_covered(engine, sent: list, seconds: float, text: str) -> None:
    """The transcript `text` is the engine's for the first `seconds` of what was sent, and later audio was sent."""
    stream = as_sent(np.concatenate(sent))
    received = round(seconds * SAMPLING_RATE)
    assert 0 < received <= stream.size, (received, stream.size)
    assert text == (await engine.transcribe(stream[:received])).text


# -- vLLM's protocol ------------------------------------------------------------------------------------------
async def test_vllm_drain_notice_comes_between_the_last_delta_and_the_done(engine, audio):
    """The client streams without end (never a final commit): the drain ends the utterance, and the event before
    its done is the notice; the audio the client goes on sending is dropped without an error. The done says it
    too (`truncated`, `truncation`: a client that reads the done alone could not tell), where the done of an
    utterance the client ended itself says nothing of the kind."""
    server = ServerThread(engine, ServerConfig(limits=PENDING_LIMIT))
    try:
        client = await RealtimeClient.connect(server.url())
        await client.update(server.state.model_id)
        assert (await client.event())["type"] == "session.updated"
        await client.commit()
        await client.append(audio[:PIECE])
        await client.commit(final=True)
        whole = (await client.until("transcription.done"))[-1]
        assert "truncated" not in whole and "truncation" not in whole, whole
        await client.commit()
        sent = []
        sender = asyncio.create_task(send_until_closed(client.append, audio, sent))
        first = await client.event()
        assert first["type"] == "transcription.delta", first  # the utterance runs: the drain waits for it
        draining = server.start_drain(DRAIN_S)
        events, code = await events_until_closed(client.event)
        await sender
        events.insert(0, first)
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in events]
        assert kinds[-2:] == ["error", "transcription.done"] and set(kinds[:-2]) == {"transcription.delta"}, kinds
        notice, done = events[-2:]
        seconds = done["usage"]["audio_seconds"]
        assert notice["code"] == "server_draining" and f"the first {seconds:.2f} s of audio" in notice["error"]
        assert done["truncated"] is True, done
        assert done["truncation"] == {"code": "server_draining", "message": notice["error"], "audio_seconds": seconds}
        assert "".join(event["delta"] for event in events[:-2]) == done["text"]
        await check_covered(engine, sent, seconds, done["text"])
    finally:
        server.close()


async def test_vllm_compat_drain_sends_only_what_vllm_sends(engine, audio):
    """vLLM has no such notice: `--compat vllm` ends the utterance with its done alone, in vLLM's shape."""
    server = ServerThread(engine, ServerConfig(compat="vllm"))
    try:
        client = await RealtimeClient.connect(server.url())
        await client.update(server.state.model_id)  # vLLM answers nothing
        await client.commit()
        await client.append(audio[:2 * SAMPLING_RATE])
        first = await client.event()
        assert first["type"] == "transcription.delta", first
        draining = server.start_drain(DRAIN_S)
        events, code = await events_until_closed(client.event)
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in [first, *events]]
        assert kinds[-1] == "transcription.done" and set(kinds[:-1]) == {"transcription.delta"}, kinds
        assert set(events[-1]) == {"type", "text", "usage"}
    finally:
        server.close()


# -- the OpenAI dialect ---------------------------------------------------------------------------------------
async def test_openai_drain_drops_appends_and_marks_the_transcript_truncated(engine, audio):
    """A client that goes on appending through the drain: the item the drain committed ends with the notice, then
    its `...transcription.completed`, which says it was cut short too (`truncated`, `truncation`); the appends that
    come while no item is open are dropped without an answer. They were each answered with an error `draining`."""
    server = ServerThread(engine)
    rate = 24000  # the dialect's PCM rate
    pcm = soxr.resample(audio, SAMPLING_RATE, rate).astype(np.float32)
    try:
        ws = await websockets.connect(server.url() + "?intent=transcription", max_size=None)

        async def append(piece: np.ndarray) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(piece)}))

        async def receive() -> dict:
            return json.loads(await asyncio.wait_for(ws.recv(), 60))

        sender = asyncio.create_task(send_until_closed(append, pcm, []))
        while (first := await receive())["type"] != "conversation.item.input_audio_transcription.delta":
            pass
        draining = server.start_drain(DRAIN_S)
        events, code = await events_until_closed(receive)
        await sender
        assert code == 1001 and await draining is True
    finally:
        server.close()
    kinds = [event["type"] for event in events]
    errors = [event["error"] for event in events if event["type"] == "error"]
    assert [error["code"] for error in errors] == ["server_draining"], errors
    at = kinds.index("conversation.item.input_audio_transcription.completed")
    notice, completed = events[at - 1]["error"], events[at]
    assert notice["code"] == "server_draining", kinds  # right before the transcript
    assert kinds[-1] == "conversation.item.done" and "conversation.item.added" not in kinds, kinds  # no new item
    seconds = completed["truncation"]["audio_seconds"]
    assert f"the first {seconds:.2f} s of audio" in notice["message"] and completed["truncated"] is True
    assert completed["truncation"] == {"code": "server_draining", "message": notice["message"],
                                       "audio_seconds": seconds}
    assert completed["transcript"] == first["delta"] + "".join(
        event["delta"] for event in events if event["type"].endswith("transcription.delta"))


# -- /ws ------------------------------------------------------------------------------------------------------
async def test_envelope_drain_notice_carries_the_utterances_ids_and_seconds(engine, audio):
    server = ServerThread(engine, ServerConfig(limits=PENDING_LIMIT))
    try:
        ws = await websockets.connect(server.url("/ws"), max_size=None)

        async def send(kind: str, payload: dict) -> None:
            await ws.send(json.dumps({"type": kind, "session_id": "s1", "request_id": "u", "payload": payload}))

        async def receive() -> dict:
            return json.loads(await asyncio.wait_for(ws.recv(), 60))

        assert (await receive())["type"] == "session.created"
        await send("input_audio_buffer.commit", {"final": False})
        sent = []
        sender = asyncio.create_task(send_until_closed(
            lambda pcm: send("input_audio_buffer.append", {"audio": encode_pcm16_base64(pcm)}), audio, sent))
        first = await receive()
        assert first["type"] == "transcription.delta", first
        draining = server.start_drain(DRAIN_S)
        events, code = await events_until_closed(receive)
        await sender
        assert code == 1001 and await draining is True
        kinds = [event["type"] for event in [first, *events]]
        assert kinds[-2:] == ["error", "transcription.done"] and set(kinds[:-2]) == {"transcription.delta"}, kinds
        notice, done = events[-2:]
        seconds = done["payload"]["usage"]["audio_seconds"]
        assert (notice["session_id"], notice["request_id"]) == ("s1", "u")
        assert notice["payload"]["code"] == notice["payload"]["reason_code"] == "server_draining"
        assert notice["payload"]["details"] == {"audio_seconds": seconds}
        assert f"the first {seconds:.2f} s of audio" in notice["payload"]["message"]
        assert done["payload"]["truncated"] is True  # and the done says so too, for a client that reads it alone
        assert done["payload"]["truncation"] == {"code": "server_draining", "message": notice["payload"]["message"],
                                                 "audio_seconds": seconds}
        await check_covered(engine, sent, seconds, done["payload"]["text"])
    finally:
        server.close()


# -- HTTP streaming input -------------------------------------------------------------------------------------
async def mode_a_through_a_drain(server, body) -> list:
    """The SSE events of a Mode A request sending `body`, drained once its first delta came; closes `server`."""
    try:
        draining, raw = None, ""
        async with aiohttp.ClientSession() as http, http.post(
                server.url("/v1/audio/transcriptions", "http"), data=body,
                headers={"X-Streaming-Input": "true"}) as response:
            async for line in response.content:
                raw += line.decode()
                if draining is None and "transcript.text.delta" in raw:
                    draining = server.start_drain(DRAIN_S)
        assert await draining is True
    finally:
        server.close()
    return [data for _, data in parse_sse(raw)]


async def test_mode_a_drain_notice_precedes_the_transcripts_end(engine, audio):
    """A Mode A request whose input never ends by itself: the drain ends it, and its stream says so right before the
    transcript's done, which covers the audio received and says so too."""
    server = ServerThread(engine)
    chunks = [{"modality": "audio", "payload": encode_pcm16_base64(audio[i:i + PIECE])}
              for i in range(0, audio.size, PIECE)]

    async def body():
        yield "".join(json.dumps(line) + "\n" for line in [{"model": server.state.model_id}, *chunks]).encode()
        await asyncio.sleep(60)  # the input stays open

    _, done = drained_sse(await mode_a_through_a_drain(server, body()))
    await check_covered(engine, [audio], done["usage"]["seconds"], done["text"])


async def test_mode_a_drain_drops_the_chunks_a_client_goes_on_sending(engine, audio):
    """A Mode A client that goes on sending chunks after the drain ended its input: they are dropped, and the stream
    still ends with the transcript the notice promised. Before, the next chunk went to the ended engine session,
    which refused it: the stream ended with an error `session_closed` and no transcript."""
    server = ServerThread(engine)
    sent = []

    async def body():
        yield (json.dumps({"model": server.state.model_id}) + "\n").encode()
        while True:  # until the client stops sending: it has the answer
            for begin in range(0, audio.size, PIECE):
                piece = audio[begin:begin + PIECE]
                yield (json.dumps({"payload": encode_pcm16_base64(piece)}) + "\n").encode()
                sent.append(piece)
                await asyncio.sleep(PIECE / SAMPLING_RATE / SPEEDUP)

    _, done = drained_sse(await mode_a_through_a_drain(server, body()))
    assert done["text"]
    await check_covered(engine, sent, done["usage"]["seconds"], done["text"])


async def test_mode_a_input_held_back_by_its_start_policy_is_not_transcribed_and_says_why(engine, audio):
    """A Mode A input that start_policy on_end_only still holds back when the drain comes has no engine session, and
    a draining `jaxstream serve` starts none (its engine refuses new sessions from the drain's start on): the stream
    ends with `server_shutdown` at once, and its message says why nothing was transcribed of the audio received. It
    said "server shutting down"."""
    server = ServerThread(engine)
    seconds = 2.0
    lines = [{"model": server.state.model_id, "start_policy": "on_end_only"},
             *({"payload": encode_pcm16_base64(audio[i:i + PIECE])} for i in range(0, round(seconds * SAMPLING_RATE),
                                                                                 PIECE))]

    async def body():
        yield "".join(json.dumps(line) + "\n" for line in lines).encode()
        await asyncio.sleep(60)  # the input stays open

    def held() -> float:
        handles = [conn for conn in server.state.connections if isinstance(conn, streaming_input.DrainHandle)]
        return handles[0].feed.audio_seconds if handles else 0.0

    try:
        async with aiohttp.ClientSession() as http, http.post(
                server.url("/v1/audio/transcriptions", "http"), data=body(),
                headers={"X-Streaming-Input": "true"}) as response:
            async with asyncio.timeout(30):
                while held() < seconds:  # every chunk is in the feed, held back
                    await asyncio.sleep(0.02)
            draining = server.start_drain(DRAIN_S)
            raw = await response.text()
        assert await draining is True  # nothing was cut off: nothing ran
    finally:
        server.close()
    events = [data for _, data in parse_sse(raw)]
    assert [event if event == "[DONE]" else event["type"] for event in events] == ["error", "[DONE]"], events
    error = events[0]["error"]
    assert (error["code"], error["type"]) == ("server_shutdown", "server_error"), error
    assert error["message"] == ("The server is shutting down and starts no new transcription: the 2.00 s of audio "
                                "received were held back by start_policy on_end_only and never reached the engine, so "
                                "there is no transcription; send the input again to another replica"), error


async def test_mode_b_chunks_held_or_sent_after_the_drain_ended_the_input_are_not_applied(engine, audio):
    """A Mode B client whose chunks were held for a gap when the drain ended the input, and which goes on sending:
    the request that filled the gap succeeds (its chunk was applied; it was a 409 `session_closed`, then one naming
    a chunk it did not send), the held chunks the drain left are dropped, a chunk sent afterwards gets 409
    `input_finished` saying that the server ended the input, and the result and the events carry the transcript the
    notice promised, marked cut short."""
    server = ServerThread(engine)
    # 4 min: applying it takes the engine far longer than the drain waits before it ends the input (DRAIN_S / 2)
    long = np.tile(audio, 55)
    step = round(CHUNK_S * SAMPLING_RATE)
    pieces = [long[begin:begin + step] for begin in range(0, long.size, step)]

    def chunk(seq: int) -> dict:
        return {"sequence_id": seq, "payload": encode_pcm16_base64(pieces[seq % len(pieces)])}

    try:
        async with aiohttp.ClientSession() as http:
            status, created = await call(http, server, "POST", SESSIONS,
                                         json={"model": server.state.model_id, "stream": True})
            assert status == 201, created
            base = f"{SESSIONS}/{created['session_id']}"
            session = server.app[STREAMING_INPUT].sessions[created["session_id"]]
            for seq in [0, *range(2, len(pieces))]:  # 0 starts the engine session; the rest wait for 1
                assert (await call(http, server, "POST", base + "/chunks", json=chunk(seq)))[0] == 202
            gap = asyncio.create_task(call(http, server, "POST", base + "/chunks", json=chunk(1)))
            async with asyncio.timeout(60):
                while session.next_seq < 2:  # the held chunks are being applied
                    await asyncio.sleep(0.05)
            draining = server.start_drain(DRAIN_S)
            gap_answer = await gap
            late_answer = await call(http, server, "POST", base + "/chunks", json=chunk(len(pieces)))
            result = await call(http, server, "GET", base + "/result")
            async with http.get(server.url(base + "/events", "http")) as response:
                raw = await response.text()
            assert await draining is True
    finally:
        server.close()
    assert gap_answer[0] == 202 and gap_answer[1]["held"] == [], gap_answer
    assert (late_answer[0], late_answer[1]["error"]["code"]) == (409, "input_finished"), late_answer
    assert "The server is shutting down" in late_answer[1]["error"]["message"], late_answer  # not the client's end
    _, done = drained_sse([data for _, data in parse_sse(raw)])
    seconds = done["usage"]["seconds"]
    assert result[0] == 200 and result[1]["text"] == done["text"], result
    assert result[1]["truncated"] is True and result[1]["truncation"] == done["truncation"], result
    # What the transcript covers is whole chunks, the two applied before the drain at least: those dropped never
    # reached the engine. (The transcript of that much audio is checked
    # against the engine's by the tests above; here it would cost more than the rest of the test.)
    assert seconds >= 2 * CHUNK_S and seconds % CHUNK_S == 0, seconds
