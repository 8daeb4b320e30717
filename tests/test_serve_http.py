"""The HTTP routes of `jaxstream serve`, driven over loopback by real clients: the SSE conventions of
specs/realtime_protocols.md §8 (sse.py) and the Mode B streaming-input sessions of §7.2 with aiohttp; and what the
other test_serve_http*.py modules import from here: the sample's wav, its engine.transcribe `reference`, SSE parsing
and a JSON call. OpenAI's `/v1/audio/transcriptions` with the `openai` SDK and `curl -N`:
test_serve_http_transcriptions.py."""
import asyncio
import io
import itertools
import json
import logging
import os
import socket
import types

import aiohttp
import numpy as np
import pytest
import soundfile
from aiohttp import web
from aiohttp.test_utils import TestServer

from jaxstream.serving import sse
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.http_sessions import REPLICA_HEADER, STREAMING_INPUT
from jaxstream.serving.testing import wait_engine_baseline, wait_engine_sessions, wait_until
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


SESSIONS = "/v1/streaming_input/sessions"


CHUNK = 8000  # 0.5 s


@pytest.fixture(scope="module")
def wav(audio):
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def reference(engine, audio):
    """engine.transcribe of the sample as the server receives it (PCM16, as in the wav and the chunks)."""
    pcm16 = np.round(np.clip(audio, -1, 1 - 2 ** -15) * 32768).astype(np.int16).astype(np.float32) / 32768
    return asyncio.run(engine.transcribe(pcm16))


def expected_logprobs(engine, done) -> list[float]:
    """engine.transcribe's logprobs of the text tokens (the ones OpenAI's `logprobs` list)."""
    return [lp for token, lp in zip(done.token_ids, done.logprobs) if not engine.tokenizer.is_control(token)]


# -- SSE behaviour ------------------------------------------------------------------------------------------
def parse_sse(text: str) -> list[tuple[int | None, object]]:
    """(id, data) of each event; data parsed as JSON unless it is [DONE]. Comments are skipped."""
    events = []
    for block in text.split("\n\n"):
        fields = [line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")]
        if not fields:
            continue
        found = dict(fields)
        data = found["data"]
        events.append((int(found["id"]) if "id" in found else None, data if data == "[DONE]" else json.loads(data)))
    return events


async def read_sse(response, count: int | None = None) -> tuple[list, str]:
    """Reads events (all of them, or the first `count`) from an aiohttp response; also the raw text."""
    raw, events = "", []
    async for line in response.content:
        raw += line.decode()
        if raw.endswith("\n\n"):
            events = parse_sse(raw)
            if count is not None and len(events) >= count:
                break
    return parse_sse(raw), raw


async def _serve(handler) -> TestServer:
    """`handler` answering GET / on a started loopback test server (the caller closes it)."""
    app = web.Application()
    app.router.add_get("/", handler)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    return test_server


async def test_the_first_event_timeout_runs_from_the_producers_last_progress():
    """A producer still working (its progress count moves on) is not timed out before its first event, even
    one that comes after several timeouts' time; one that stops working is, from then on."""
    log, working, work = sse.EventLog(), True, itertools.count()

    async def handler(request):
        response, _ = await sse.stream_log(request, log, send_timeout_s=30, after=sse.last_event_id(request),
                                           first_event_timeout_s=0.3, progress=lambda: next(work) if working else -1)
        return response

    test_server = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as http:
            late = asyncio.get_running_loop().call_later(1.2, log.append, {"late": True})
            async with http.get(test_server.make_url("/")) as response:
                events, _ = await read_sse(response, count=1)
            assert events == [(1, {"late": True})]
            late.cancel()
            working = False
            async with http.get(test_server.make_url("/"), headers={"Last-Event-ID": "1"}) as response:
                events, _ = await read_sse(response)
            assert events[0][1]["error"]["code"] == "first_token_timeout" and events[-1][1] == "[DONE]"
    finally:
        await test_server.close()


async def test_stream_log_keepalive_first_event_timeout_and_replay_gap():
    log = sse.EventLog(capacity=2)

    async def handler(request):
        timeout = float(request.query.get("timeout", "0")) or None
        response, _ = await sse.stream_log(request, log, send_timeout_s=30, after=sse.last_event_id(request),
                                           keepalive_s=0.1, first_event_timeout_s=timeout)
        return response

    test_server = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(test_server.make_url("/?timeout=0.4")) as response:
                events, raw = await read_sse(response)
            assert ": keepalive\n\n" in raw
            assert events[0][1]["error"]["code"] == "first_token_timeout" and events[-1][1] == "[DONE]"
            for n in range(3):
                log.append({"n": n})
            log.close()  # ids 1..4; the buffer keeps 3 and 4
            async with http.get(test_server.make_url("/"), headers={"Last-Event-ID": "2"}) as response:
                assert (await read_sse(response))[0] == [(3, {"n": 2}), (4, "[DONE]")]
            async with http.get(test_server.make_url("/"), headers={"Last-Event-ID": "1"}) as response:
                events, _ = await read_sse(response)
            assert events[0][0] == 1 and events[0][1]["error"]["code"] == "replay_unavailable"
            # Resumed after its end (EventSource reconnects when a stream closes): [DONE] again, not an empty
            # body; an id the stream never had: an error and [DONE] (a live stream waited for that id and
            # skipped every event before it).
            async with http.get(test_server.make_url("/"), headers={"Last-Event-ID": "4"}) as response:
                assert (await read_sse(response))[0] == [(4, "[DONE]")]
            async with http.get(test_server.make_url("/"), headers={"Last-Event-ID": "99"}) as response:
                events, _ = await read_sse(response)
            assert [event_id for event_id, _ in events] == [4, 4] and events[-1][1] == "[DONE]"
            assert events[0][1]["error"]["code"] == "invalid_last_event_id"
    finally:
        await test_server.close()


@pytest.mark.parametrize("head", [
    b"Content-Length: abc\r\n",  # not a number
    b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n",  # a chunk size that is not hex
    b"X-Long: " + b"x" * 20_000 + b"\r\n",  # a header line over aiohttp's 8190 bytes
], ids=["content_length", "chunk_size", "long_header"])
async def test_a_malformed_request_is_one_warning_line_not_an_error_with_a_traceback(server, head, caplog):
    """aiohttp answers a request it cannot parse with a 400 and logged it at ERROR with the parser's traceback: a
    scanner could fill the log and set off alerts that key on ERROR."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.server.port)
    try:
        with caplog.at_level(logging.INFO, logger="aiohttp.server"):
            writer.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 10)
            await wait_until(lambda: any(r.name == "aiohttp.server" for r in caplog.records))
    finally:
        writer.close()
    assert status.split()[1] == b"400", status
    (record,) = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.WARNING and record.exc_info is None and "\n" not in record.getMessage()
    assert "malformed request answered 400: " in record.getMessage(), record.getMessage()


async def test_client_disconnect_aborts_the_engine_session(server, model, audio):
    long = np.tile(audio, 8)  # 28 s: still transcribing when the client leaves after its first event
    buffer = io.BytesIO()
    soundfile.write(buffer, long, 16000, format="WAV")
    aborted = server.state.metrics.utterances.labels(outcome="aborted")
    before = aborted._value.get()
    form = aiohttp.FormData()
    form.add_field("file", buffer.getvalue(), filename="long.wav")
    form.add_field("model", model)
    form.add_field("stream", "true")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
            assert response.status == 200
            events, _ = await read_sse(response, count=1)
            assert events[0][1]["type"] == "transcript.text.delta"
            response.close()  # drops the connection (leaving the context would read the stream to its end)
    await wait_engine_baseline(server.state.engine, timeout=10)
    assert aborted._value.get() == before + 1


async def test_a_silent_lead_does_not_time_out_a_streamed_upload(server, engine, model, audio, monkeypatch):
    """An upload's first text comes where its speech starts, which may be minutes in: the engine working
    through the silence is no stuck stream. The first-event timeout (15 s; a fifth of a second here, so that
    8 s of silence outlast it) runs from the engine's last computed audio: it used to end the stream and
    abort the transcription (found with 180 s)."""
    monkeypatch.setattr(sse, "FIRST_EVENT_TIMEOUT_S", 0.2)
    pcm = np.concatenate([np.zeros(8 * 16000, np.float32), audio])
    expected = (await engine.transcribe(pcm)).text
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm, 16000, format="WAV")
    form = aiohttp.FormData()
    form.add_field("file", buffer.getvalue(), filename="lead.wav")
    form.add_field("model", model)
    form.add_field("stream", "true")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
            assert response.status == 200
            events, _ = await read_sse(response)
    data = [event for _, event in events]
    assert data[-1] == "[DONE]" and data[-2]["type"] == "transcript.text.done", data[:2]
    assert "".join(event["delta"] for event in data[:-2]) == data[-2]["text"] == expected


# -- Mode B streaming-input sessions ------------------------------------------------------------------------
def chunks_of(pcm: np.ndarray) -> list[dict]:
    pieces = [pcm[i:i + CHUNK] for i in range(0, pcm.size, CHUNK)]
    return [{"sequence_id": n, "modality": "audio", "payload": encode_pcm16_base64(piece),
             "end_of_input": n == len(pieces) - 1} for n, piece in enumerate(pieces)]


async def call(http, server, method, path, **kwargs):
    async with http.request(method, server.url(path, "http"), **kwargs) as response:
        return response.status, await response.json()


async def test_out_of_order_and_duplicate_chunks_give_engine_transcribe_result(server, engine, model, audio,
                                                                                reference):
    chunks = chunks_of(audio)
    order = [1, 0, 3, 3, 2] + list(range(4, len(chunks)))  # 1 and 3 wait for a gap; 3 twice
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url(SESSIONS, "http"), json={"model": model, "modality": "audio", "stream": None,
                                                                  "params": {"include": ["logprobs"]}}) as response:
            status, created = response.status, await response.json()
            # The replica a gateway routes the session's later requests to (deploy/README.md).
            assert response.headers[REPLICA_HEADER] == os.environ.get("JAXSTREAM_REPLICA_ID", socket.gethostname())
        assert status == 201 and created["expires_in"] > 0
        base = f"{SESSIONS}/{created['session_id']}"
        answers = [await call(http, server, "POST", base + "/chunks", json=chunks[n]) for n in order]
        assert answers[0] == (202, {**answers[0][1], "started": False, "held": [1]})
        assert answers[1][1]["started"] and answers[1][1]["next_sequence_id"] == 2
        assert answers[3][0] == 200 and answers[3][1]["duplicate"]
        assert answers[4][1]["next_sequence_id"] == 4
        status, result = await call(http, server, "GET", base + "/result")
        assert status == 200 and result["text"] == reference.text
        assert [w["word"] for w in result["words"]] == [w.word for w in reference.words]
        np.testing.assert_allclose([lp["logprob"] for lp in result["logprobs"]], expected_logprobs(engine, reference),
                                   atol=2e-3)
        again = await call(http, server, "POST", base + "/finish")
        assert again[0] == 200 and again[1]["state"] == "finished"  # finish after end_of_input: no effect
        late = await call(http, server, "POST", base + "/chunks", json={**chunks[0], "sequence_id": 99})
        assert late[0] == 409 and late[1]["error"]["code"] == "input_finished"
        # §7.2: a repeated end_of_input has no further effect (an empty one: a payload is new input, above).
        ended = await call(http, server, "POST", base + "/chunks", json={**chunks[0], "sequence_id": 99,
                                                                         "payload": "", "end_of_input": True})
        assert ended[0] == 200 and ended[1]["duplicate"] and ended[1]["state"] == "finished", ended


async def test_resumed_event_stream_yields_every_event_once(server, model, audio, reference):
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model, "stream": True,
                                                                      "chunk": chunks_of(audio)[0]})
        base = server.url(f"{SESSIONS}/{created['session_id']}", "http")
        async with http.get(base + "/events") as response:
            assert response.headers["Cache-Control"] == "no-cache"
            for chunk in chunks_of(audio)[1:]:
                assert (await call(http, server, "POST", f"{SESSIONS}/{created['session_id']}/chunks",
                                   json=chunk))[0] == 202
            first, _ = await read_sse(response, count=2)
            response.close()  # the stream drops
        first = first[:2]
        async with http.get(base + "/events", headers={"Last-Event-ID": str(first[-1][0])}) as response:
            rest, _ = await read_sse(response)
    events = first + rest
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "[DONE]" and events[-2][1]["text"] == reference.text
    assert "".join(data["delta"] for _, data in events[:-2]) == reference.text


async def test_payload_cap_closes_the_session_and_frees_the_engine(server, engine, model, audio, monkeypatch):
    monkeypatch.setattr(server.app[STREAMING_INPUT], "max_payload_bytes", 3 * 2 * CHUNK)
    chunks = chunks_of(audio)
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        statuses = [(await call(http, server, "POST", base + "/chunks", json=chunk))[0] for chunk in chunks[:3]]
        assert statuses == [202, 202, 202]
        await wait_engine_sessions(engine, 1)
        status, body = await call(http, server, "POST", base + "/chunks", json=chunks[3])
        assert status == 413 and body["error"]["code"] == "payload_too_large"
        await wait_engine_baseline(engine)
        assert (await call(http, server, "POST", base + "/chunks", json=chunks[4]))[0] == 410
        assert (await call(http, server, "GET", base + "/result"))[0] == 410


async def test_session_errors_and_idle_timeout(server, model, audio, monkeypatch):
    chunk = chunks_of(audio)[0]
    async with aiohttp.ClientSession() as http:
        assert (await call(http, server, "POST", SESSIONS + "/nope/chunks", json=chunk))[0] == 404
        assert (await call(http, server, "POST", SESSIONS, json={"model": "other"}))[0] == 404
        for body in ({"start_policy": "sometimes"}, {"start_policy": "on_min_length"}, {"modality": "video"},
                     {"stream": "yes"}, {"start_policy": "on_first_chunk", "min_bytes": 4}):
            assert (await call(http, server, "POST", SESSIONS, json=body))[0] == 422
        for include in (["words"], "logprobs"):
            status, answer = await call(http, server, "POST", SESSIONS, json={"params": {"include": include}})
            assert status == 422 and answer["error"]["param"] == "params.include", answer
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        for bad in ({"sequence_id": -1, "payload": chunk["payload"]}, {"sequence_id": 0, "payload": "%%"},
                    {"sequence_id": 0, "payload": chunk["payload"], "modality": "text"}):
            assert (await call(http, server, "POST", base + "/chunks", json=bad))[0] == 422
        assert (await call(http, server, "POST", base + "/chunks", json=chunk))[0] == 202
        conflict = await call(http, server, "POST", base + "/chunks", json={**chunk, "end_of_input": True})
        assert conflict[0] == 409 and conflict[1]["error"]["code"] == "sequence_conflict"
        assert (await call(http, server, "GET", base + "/result"))[0] == 409
        assert (await call(http, server, "GET", base + "/events"))[0] == 409  # created without stream
        monkeypatch.setattr(server.app[STREAMING_INPUT], "session_timeout_s", 0.3)
        await asyncio.sleep(1.2)
        status, body = await call(http, server, "POST", base + "/chunks", json={**chunk, "sequence_id": 1})
        assert status == 410 and body["error"]["code"] == "session_expired"


async def test_the_reaper_outlives_a_session_it_cannot_judge(server, model, audio, monkeypatch):
    """A session whose stream had ended a loop turn before its release ran (`done_at` still None) made the
    reaper raise TypeError and stop for good: no session expired again, and finished sessions piled up (found
    by a chaos run: 95 finished sessions 30 s past a 5 s timeout). A session in that state, first in the
    registry, must not keep a finished one from expiring."""
    registry = server.app[STREAMING_INPUT]
    stuck = types.SimpleNamespace(id="stuck", done_at=None, input_ended=True, last_activity=0.0, detached_at=None,
                                  listeners=set(), closed=False, stream=types.SimpleNamespace(done=True))

    async def put_first():
        registry.sessions = {"stuck": stuck, **registry.sessions}

    server.call(put_first())
    monkeypatch.setattr(registry, "session_timeout_s", 0.3)
    try:
        async with aiohttp.ClientSession() as http:
            chunk = {**chunks_of(audio[:CHUNK])[0], "end_of_input": True}
            _, created = await call(http, server, "POST", SESSIONS, json={"model": model, "chunk": chunk})
            base = f"{SESSIONS}/{created['session_id']}"
            for _ in range(100):
                status, body = await call(http, server, "GET", base + "/result")
                if status == 410:
                    break
                await asyncio.sleep(0.1)
            assert status == 410 and "expired" in body["error"]["message"], body
    finally:
        registry.sessions.pop("stuck", None)


async def test_finish_without_audio_and_abandoned_stream(server, engine, model, audio, monkeypatch):
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        status, body = await call(http, server, "POST", base + "/finish")
        assert status == 422 and body["error"]["code"] == "no_input"
        monkeypatch.setattr(server.app[STREAMING_INPUT], "resume_grace_s", 0.3)
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model, "stream": True,
                                                                      "chunk": chunks_of(audio)[0]})
        base = f"{SESSIONS}/{created['session_id']}"
        async with http.get(server.url(base + "/events", "http")) as response:
            assert response.status == 200
            response.close()  # and nobody comes back: the session and its engine session go
        for _ in range(100):
            status, body = await call(http, server, "GET", base + "/result")  # 409 while the input is open
            if status == 410:
                break
            await asyncio.sleep(0.1)
        assert status == 410 and "not resumed" in body["error"]["message"]
        await wait_engine_baseline(engine)

