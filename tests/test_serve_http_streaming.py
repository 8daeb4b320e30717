"""HTTP streaming input of audio (specs/realtime_protocols.md §7) beyond the Mode B basics of
test_serve_http.py: Mode A (`X-Streaming-Input: true`, an NDJSON body) with aiohttp and `curl -N`, start
policies, per-key limits shared with the WebSocket routes, and drain waiting for HTTP streams. The oracle
is `engine.transcribe` of the same PCM16 audio (what `jaxstream transcribe` prints)."""
import asyncio
import json
import subprocess
import types

import aiohttp
import numpy as np
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from jaxstream.errors import CapacityError
from jaxstream.serving import sse, streaming_input
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_sessions import STREAMING_INPUT
from jaxstream.serving.limits import Limits
from jaxstream.serving.metrics import ServerMetrics
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from test_serve_http import (  # noqa: F401 - reference: a fixture
    CHUNK, SESSIONS, call, chunks_of, expected_logprobs, parse_sse, read_sse, reference)

pytestmark = pytest.mark.slow


def ndjson(model: str | None, pcm: np.ndarray, *, end: bool = True, **params) -> list[bytes]:
    """A Mode A body: the parameters line (unless `model` is None), then 0.5 s chunks, the last one
    marked end_of_input when `end`."""
    head = [{"model": model, **params}] if model is not None else []
    pieces = [pcm[i:i + CHUNK] for i in range(0, pcm.size, CHUNK)]
    chunks = [{"modality": "audio", "payload": encode_pcm16_base64(p), "end_of_input": end and n == len(pieces) - 1}
              for n, p in enumerate(pieces)]
    return [json.dumps(line).encode() + b"\n" for line in head + chunks]


def transcript(events) -> str:
    assert events[-1][1] == "[DONE]" and events[-2][1]["type"] == "transcript.text.done", events[-3:]
    assert "".join(e["delta"] for _, e in events[:-2]) == events[-2][1]["text"]
    return events[-2][1]["text"]


async def test_mode_a_transcribes_while_the_audio_arrives(server, engine, model, audio, reference):
    lines = ndjson(model, audio, include=["logprobs"])
    first_delta = asyncio.Event()

    async def body():
        yield b"".join(lines[:4])  # the parameters and 1.5 s of audio
        await asyncio.wait_for(first_delta.wait(), 60)  # text comes back before the rest is sent
        for line in lines[4:]:
            yield line

    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=body(),
                             headers={"X-Streaming-Input": "true"}) as response:
            assert response.status == 200 and response.headers["X-Accel-Buffering"] == "no"
            raw = ""
            async for line in response.content:
                raw += line.decode()
                if '"transcript.text.delta"' in raw:
                    first_delta.set()
    events = parse_sse(raw)
    assert transcript(events) == reference.text
    done = events[-2][1]
    assert [lp for _, e in events[:-2] for lp in e["logprobs"]] == done["logprobs"]
    np.testing.assert_allclose([lp["logprob"] for lp in done["logprobs"]], expected_logprobs(engine, reference),
                               atol=2e-3)


def test_curl_mode_a_without_a_parameters_line(server, audio, reference, tmp_path):
    path = tmp_path / "audio.ndjson"
    path.write_bytes(b"".join(ndjson(None, audio)))
    out = subprocess.run(["curl", "-sS", "-N", server.url("/v1/audio/transcriptions", "http"),
                          "-H", "X-Streaming-Input: true", "-H", "Transfer-Encoding: chunked",
                          "--data-binary", f"@{path}"], capture_output=True, text=True, timeout=120, check=True).stdout
    events = parse_sse(out)
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert transcript(events) == reference.text


async def post_mode_a(server, body: bytes, value: str = "true") -> tuple[int, str]:
    """(status, body text) of a Mode A request with the header `X-Streaming-Input: <value>`."""
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=body,
                             headers={"X-Streaming-Input": value}) as response:
            return response.status, await response.text()


async def test_mode_a_takes_the_header_as_the_form_takes_a_flag(server, model, audio, reference):
    """Only `X-Streaming-Input: true` switched Mode A on: `1` or `True ` was taken for an upload, and answered "Send
    the audio as multipart/form-data", without a word of the header. The header takes the values the form's boolean
    fields take (true, false, 1, 0, in any case), and another value is refused naming it."""
    body = b"".join(ndjson(model, audio))
    for value in ("1", "True "):
        status, text = await post_mode_a(server, body, value)
        assert status == 200 and transcript(parse_sse(text)) == reference.text, value
    for value in ("yes", "0"):
        status, text = await post_mode_a(server, body, value)
        error = json.loads(text)["error"]
        assert (status, error["code"]) == (400, "invalid_request") and "`X-Streaming-Input: true`" in error["message"]


@pytest.mark.parametrize("params, param, words", [
    ({"response_format": "srt"}, "response_format", "response_format 'srt' cannot be streamed; use json or text"),
    ({"response_format": "verbose_json", "timestamp_granularities": ["word"]}, "response_format",
     "cannot be streamed"),
    ({"response_format": "xml"}, "response_format", "response_format must be one of"),
    ({"stream": False}, "stream", "stream must be true or absent, got False"),
    ({"timestamp_granularities": ["word"]}, "timestamp_granularities", "must be `verbose_json` if"),
    ({"response_format": "text", "include": ["logprobs"]}, "include", "logprobs needs response_format json"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number from 0 to 1, got 'hot'"),
    ({"temperature": 1.5}, "temperature", "got 1.5"),
    ({"chunking_strategy": "manual"}, "chunking_strategy", 'chunking_strategy must be "auto" or a server_vad'),
    ({"chunking_strategy": {"type": "server_vad", "silence_duration_ms": -5}}, "chunking_strategy", "server_vad"),
], ids=["srt", "verbose_json", "unknown format", "stream false", "granularities", "text with logprobs",
        "temperature text", "temperature over 1", "chunking_strategy text", "negative silence"])
async def test_mode_a_refuses_parameters_asking_for_another_answer(server, model, audio, params, param, words):
    """Mode A's parameters line may hold the upload's fields (spec §7.1), and its answer is always the stream:
    `response_format: srt`, `stream: false` and the like were ignored, a 200 stream in place of what was asked.
    They are refused with the upload's wording, at the 422 of Mode A's other parameters; so are the upload's typed
    fields (temperature, chunking_strategy) that the upload refuses, which Mode A took unchecked."""
    status, text = await post_mode_a(server, b"".join(ndjson(model, audio[:CHUNK], **params)))
    error = json.loads(text)["error"]
    assert (status, error["code"], error["param"]) == (422, "invalid_request", param) and words in error["message"]


async def test_mode_a_takes_the_parameters_it_honours(server, model, audio, reference):
    vad = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500}
    status, text = await post_mode_a(server, b"".join(ndjson(model, audio, response_format="text", stream=True,
                                                            temperature=0, chunking_strategy=vad)))
    assert status == 200 and transcript(parse_sse(text)) == reference.text


@pytest.mark.parametrize("params, param", [({"temperature": True}, "params.temperature"),
                                           ({"chunking_strategy": {"type": "semantic"}}, "params.chunking_strategy"),
                                           ({"temperature": 0.3, "chunking_strategy": "auto"}, None)])
async def test_mode_b_checks_the_uploads_typed_fields(server, model, audio, params, param):
    """Mode B's audio `params` took any temperature or chunking_strategy; they are checked as the upload's
    fields are, and refused at Mode B's 422."""
    chunk = {"sequence_id": 0, "payload": encode_pcm16_base64(audio[:CHUNK]), "end_of_input": True}
    async with aiohttp.ClientSession() as http:
        status, created = await call(http, server, "POST", SESSIONS,
                                     json={"model": model, "params": params, "chunk": chunk})
        if param is None:
            assert status == 201, created
            status, result = await call(http, server, "GET", f"{SESSIONS}/{created['session_id']}/result")
            assert status == 200 and "text" in result, result
            return
    assert (status, created["error"]["code"], created["error"]["param"]) == (422, "invalid_request", param)


@pytest.mark.parametrize("policy, started", [
    ({"start_policy": "on_min_length", "min_audio_seconds": 1.0}, [False, True, True]),
    ({"start_policy": "on_min_length", "min_bytes": 3 * 2 * CHUNK}, [False, False, True]),
    ({"streaming_input": {"start_policy": "on_end_only"}}, [False, False, False]),
])
async def test_audio_start_policies(server, model, audio, reference, policy, started):
    chunks = chunks_of(audio)
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model, **policy})
        base = f"{SESSIONS}/{created['session_id']}"
        answers = [(await call(http, server, "POST", base + "/chunks", json=c))[1] for c in chunks]
        status, result = await call(http, server, "GET", base + "/result")
    assert [a["started"] for a in answers[:3]] == started and answers[-1]["started"]
    assert status == 200 and result["text"] == reference.text


async def test_sequence_record_is_bounded(server, model, audio):
    """The ids a session remembers do not grow with the number of chunks; an old duplicate is still
    acknowledged once."""
    short = audio[:4000]
    pieces = [{"sequence_id": n, "payload": encode_pcm16_base64(short[n * 50:(n + 1) * 50])} for n in range(80)]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model, "start_policy": "on_end_only"})
        base = f"{SESSIONS}/{created['session_id']}"
        for piece in pieces:
            assert (await call(http, server, "POST", base + "/chunks", json=piece))[0] == 202
        session = server.app[STREAMING_INPUT].sessions[created["session_id"]]
        assert len(session.recent) < 80 and not session.held and session.next_seq == 80
        assert (await call(http, server, "POST", base + "/chunks", json=pieces[0]))[1]["duplicate"]
        other = encode_pcm16_base64(np.full(50, 0.25, np.float32))
        status, body = await call(http, server, "POST", base + "/chunks", json={**pieces[79], "payload": other})
        assert status == 409 and body["error"]["code"] == "sequence_conflict"
        assert (await call(http, server, "POST", base + "/finish"))[0] == 200
        assert (await call(http, server, "GET", base + "/result"))[0] == 200


async def test_sequence_ids_far_ahead_are_refused_and_a_gap_is_counted(server, model, audio):
    """What a held chunk costs is bounded by how far ahead its id may be, not only by how many are held: an
    id past the window is refused with a 4xx (§7.2: held until the gap fills, or rejected), and a finish
    refused for a gap says how many ids are missing in a short answer (it listed all of them: 26 MB and
    seconds of a blocked event loop for one id of 3,000,000)."""
    window = server.app[STREAMING_INPUT].max_held_chunks
    piece = chunks_of(audio[:CHUNK])[0]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        for far in (10 ** 9, window):
            status, body = await call(http, server, "POST", base + "/chunks", json={**piece, "sequence_id": far})
            assert 400 <= status < 500 and body["error"]["param"] == "sequence_id", body
        status, body = await call(http, server, "POST", base + "/chunks", json={**piece, "sequence_id": window - 1})
        assert status == 202 and body["held"] == [window - 1]
        status, body = await call(http, server, "POST", base + "/finish")
        assert status == 409 and body["error"]["code"] == "chunks_missing"
        assert str(window - 1) in body["error"]["message"] and len(json.dumps(body)) < 1024, body


@pytest.mark.parametrize("refused_end", ["finish", "empty end_of_input chunk"])
async def test_a_refused_end_leaves_the_session_open_for_its_input(server, model, audio, reference, refused_end):
    """Ending an input before any payload is refused (422 no_input) and ends nothing: the chunks that follow
    are taken and transcribed (§7.2's 409 is for a chunk after an accepted end). The result asked meanwhile is
    the same refusal, saying what to do: it was a 409 "finish the session first", which the finish had refused."""
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        if refused_end == "finish":
            status, body = await call(http, server, "POST", base + "/finish")
        else:
            empty_end = {"sequence_id": 0, "payload": "", "end_of_input": True}
            status, body = await call(http, server, "POST", base + "/chunks", json=empty_end)
        assert status == 422 and body["error"]["code"] == "no_input"
        assert "send chunks with a payload, then finish" in body["error"]["message"], body
        assert await call(http, server, "GET", base + "/result") == (status, body)
        for chunk in chunks_of(audio):
            assert (await call(http, server, "POST", base + "/chunks", json=chunk))[0] == 202
        status, result = await call(http, server, "GET", base + "/result")
    assert status == 200 and result["text"] == reference.text


async def test_a_result_before_the_end_says_what_the_input_lacks(server, model, audio):
    """Before its input ended, a session's result answers what a finish would: chunks missing (409
    chunks_missing, naming them), else a finish to come (409 input_not_finished, saying how)."""
    first, second = chunks_of(audio)[:2]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
        base = f"{SESSIONS}/{created['session_id']}"
        assert (await call(http, server, "POST", base + "/chunks", json=second))[0] == 202  # held: 0 is missing
        finish = await call(http, server, "POST", base + "/finish")
        result = await call(http, server, "GET", base + "/result")
        assert finish == result and result[0] == 409 and result[1]["error"]["code"] == "chunks_missing", result
        assert (await call(http, server, "POST", base + "/chunks", json=first))[0] == 202
        status, body = await call(http, server, "GET", base + "/result")
        assert (status, body["error"]["code"]) == (409, "input_not_finished")
        assert f"{base}/finish" in body["error"]["message"], body
        assert (await call(http, server, "POST", base + "/finish"))[0] == 200
        assert (await call(http, server, "GET", base + "/result"))[0] == 200


@pytest.mark.parametrize("refused", ["first chunk", "last chunk", "finish"])
async def test_an_engine_at_capacity_keeps_the_session_and_its_input(server, engine, model, audio, reference,
                                                                      monkeypatch, refused):
    """An engine at its session limit answers 503 with Retry-After: try again later (http_errors). The
    session keeps what it received, and the retry of the refused chunk or finish starts the engine with the
    whole input, once (it closed the session: the retry got 410 and the uploaded audio was lost)."""
    real_start = engine.start_transcription
    refusals = []

    async def start_transcription(*args, **kwargs):
        if refusals:
            raise refusals.pop()
        return await real_start(*args, **kwargs)

    monkeypatch.setattr(engine, "start_transcription", start_transcription)
    # The last chunk holds most of the speech: were it applied twice, the transcript would show it.
    chunks = [{"sequence_id": n, "payload": encode_pcm16_base64(piece), "end_of_input": n == 1 and refused != "finish"}
              for n, piece in enumerate((audio[:CHUNK], audio[CHUNK:]))]
    calls = [("/chunks", chunk) for chunk in chunks] + ([("/finish", None)] if refused == "finish" else [])
    at = 0 if refused == "first chunk" else len(calls) - 1
    policy = "on_first_chunk" if refused == "first chunk" else "on_end_only"
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={"model": model, "start_policy": policy})
        base = server.url(f"{SESSIONS}/{created['session_id']}", "http")
        for n, (path, body) in enumerate(calls):
            if n == at:
                refusals.append(CapacityError("the engine holds all the sessions it can; try again later"))
                async with http.post(base + path, json=body) as response:
                    assert response.status == 503 and int(response.headers["Retry-After"]) >= 1
                    assert (await response.json())["error"]["code"] == "capacity"
            async with http.post(base + path, json=body) as response:
                answer = await response.json()
                assert response.status == (200 if path == "/finish" else 202), answer
                assert not answer.get("duplicate")
        status, result = await call(http, server, "GET", f"{SESSIONS}/{created['session_id']}/result")
    assert status == 200 and result["text"] == reference.text


async def test_per_key_limits_are_shared_with_websockets(engine, model, audio):
    config = ServerConfig(api_keys=("a", "b", "c"), limits=Limits(max_streams_per_key=1,
                                                                  max_requests_per_minute_per_key=4))
    server = ServerThread(engine, config)
    try:
        async with aiohttp.ClientSession() as http:
            def key(k):
                return {"Authorization": f"Bearer {k}"}
            status, created = await call(http, server, "POST", SESSIONS, json={"model": server.state.model_id},
                                         headers=key("a"))
            assert status == 201  # key a holds its one stream
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(server.url() + "?api_key=a")
            assert refused.value.response.status_code == 429
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            async with websockets.connect(server.url() + "?api_key=b"):
                again = await call(http, server, "POST", SESSIONS, json={}, headers=key("b"))
                assert again[0] == 429 and again[1]["error"]["code"] == "rate_limit_exceeded"
            await call(http, server, "POST", f"{SESSIONS}/{created['session_id']}/chunks", headers=key("a"),
                       json=chunks_of(audio)[0] | {"end_of_input": True})
            statuses = []
            for _ in range(3):  # key a's 4th request in the minute is its last one
                async with http.get(server.url("/v1/models", "http"), headers=key("a")) as response:
                    statuses.append((response.status, response.headers.get("Retry-After")))
            assert [s for s, _ in statuses] == [200, 429, 429] and int(statuses[1][1]) > 1
            async with http.get(server.url("/v1/models", "http"), headers=key("c")) as response:
                assert response.status == 200  # other keys are not affected
        await wait_engine_baseline(engine)
    finally:
        server.close()


async def test_an_error_is_the_last_event_of_a_failed_stream():
    """`fail` (a Mode B session closed, a drain that runs out of time) logs its error while the engine session
    may still hold output queued for the pump: what the pump appends after it used to follow the error on the
    SSE stream, a transcript.text.done included. The error now ends the log."""
    class Input(streaming_input.EngineInput):
        aborted = None

        async def abort(self, reason):
            self.aborted = reason

    log = sse.EventLog()
    stream = Input(state=types.SimpleNamespace(metrics=ServerMetrics()), log=log)
    log.append({"type": "transcript.text.delta", "delta": "he"})
    stream.fail("session_closed", "The session was closed")
    assert log.append({"type": "transcript.text.done", "text": "he who"}) is None  # the pump, a turn later
    await asyncio.sleep(0)
    assert [data["type"] if isinstance(data, dict) else data for _, data in log.after(0)] == [
        "transcript.text.delta", "error", sse.DONE]
    assert stream.aborted == "session_closed"
    # Counted, as every error event sent is (jaxstream_errors); once: the log is closed after it.
    stream.fail("server_shutdown", "The server shut down")
    registry = stream.state.metrics.registry
    assert registry.get_sample_value("jaxstream_errors_total", {"code": "session_closed"}) == 1
    assert registry.get_sample_value("jaxstream_errors_total", {"code": "server_shutdown"}) is None


def test_a_failure_after_the_stream_ended_is_not_counted_again():
    """The pumps end a stream whose engine session failed with `sse.close_with_error`, as `EngineInput.fail` ends
    one it closes. A stream `fail` already ended (and whose engine session it aborted) has had its error: the
    pump's failure that follows is neither sent nor counted (it was counted, a second error for one stream)."""
    metrics, log = ServerMetrics(), sse.EventLog()
    sse.close_with_error(log, "session_closed", "The session was closed", metrics)
    sse.close_with_error(log, "aborted", "The session was aborted", metrics)
    assert [data["error"]["code"] if isinstance(data, dict) else data for _, data in log.after(0)] == [
        "session_closed", sse.DONE]
    assert metrics.registry.get_sample_value("jaxstream_errors_total", {"code": "session_closed"}) == 1
    assert metrics.registry.get_sample_value("jaxstream_errors_total", {"code": "aborted"}) is None


async def test_wrong_keys_share_their_address_budget(engine):
    """/ws checks the key after the upgrade, so its handshakes with wrong keys reach the per-key request
    limit: they count against the client's address, not a fresh identity per key (10 of 10 random keys
    used to be upgraded against a limit of 5). The server's own keys keep their own budgets."""
    server = ServerThread(engine, ServerConfig(api_keys=("a",), limits=Limits(max_requests_per_minute_per_key=3)))
    try:
        statuses = []
        for n in range(4):
            try:
                async with websockets.connect(server.url("/ws") + f"?api_key=wrong{n}") as ws:
                    statuses.append(101)
                    assert json.loads(await ws.recv())["payload"]["code"] == "unauthorized"
            except websockets.InvalidStatus as exc:
                statuses.append(exc.response.status_code)
        assert statuses == [101, 101, 101, 429]
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url("/v1/models", "http"), headers={"Authorization": "Bearer a"}) as response:
                assert response.status == 200
    finally:
        server.close()


async def test_drain_ends_the_input_of_http_streams_and_waits_for_them(engine, audio, reference):
    server = ServerThread(engine)
    lines = ndjson(server.state.model_id, audio, end=False)

    async def body():
        yield b"".join(lines)  # all the audio, but the input never ends by itself
        await asyncio.sleep(60)

    try:
        async with aiohttp.ClientSession() as http:
            _, idle = await call(http, server, "POST", SESSIONS, json={})  # a Mode B session that never starts
            drained, raw = None, ""
            async with http.post(server.url("/v1/audio/transcriptions", "http"), data=body(),
                                 headers={"X-Streaming-Input": "true"}) as response:
                async for line in response.content:
                    raw += line.decode()
                    if drained is None and "transcript.text.delta" in raw:
                        drained = server.start_drain(6.0)
            assert await drained  # nothing was cut off
            assert (await call(http, server, "POST", f"{SESSIONS}/{idle['session_id']}/finish"))[0] == 410
        events = parse_sse(raw)
        # The server ended the input, not the client: the stream says so once, and goes on to its done.
        notices = [event for _, event in events if event != "[DONE]" and event["type"] == "error"]
        assert [notice["error"]["code"] for notice in notices] == ["server_draining"], notices
        assert transcript([(i, event) for i, event in events if event not in notices]) == reference.text
        await wait_engine_baseline(engine)
    finally:
        server.close()


# -- the maximum duration of HTTP streams -------------------------------------------------------------------
MAX_AGE_S = 2.0
GIVE_UP_S = 60.0  # far under the idle timeout (150 s) and Mode B's session timeout (300 s), which alone ended them


@pytest.fixture(scope="module")
def short_lived(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(max_session_seconds=MAX_AGE_S)))
    yield server
    server.close()


def _max_duration_error(events) -> dict:
    """The error that ends a stream at its maximum duration: the code the WebSocket routes close with at that
    age (limits.duration_breach; test_serve_protocol's transcript of /v1/realtime), typed as OpenAI's Realtime
    API types its own `session_expired` (invalid_request_error: the client held the session too long)."""
    assert events[-1][1] == "[DONE]", events[-3:]
    error = events[-2][1]
    assert error["type"] == "error" and error["error"]["code"] == "max_duration_exceeded", error
    assert error["error"]["type"] == "invalid_request_error", error
    assert f"maximum duration of {MAX_AGE_S:g} s" in error["error"]["message"], error
    return error


async def _errors_counted(http, server, code: str) -> float:
    """`jaxstream_errors_total{code=...}` of the server's /metrics, read with prometheus_client's own parser."""
    async with http.get(server.url("/metrics", "http")) as response:
        assert response.status == 200
        text = await response.text()
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == "jaxstream_errors"
               for sample in family.samples
               if sample.name == "jaxstream_errors_total" and sample.labels.get("code") == code)


async def test_mode_a_ends_at_the_maximum_duration(short_lived, audio):
    """A Mode A request sending a little audio every few minutes, under the idle timeout, held an engine session
    and a connection slot for good: max_session_seconds closed WebSockets only. It now ends as a WebSocket
    does at that age, with an `error` event and the engine session aborted (engine_returns_to_baseline), and
    the error is counted in `jaxstream_errors` as a WebSocket's at that age is (websocket.py counts every breach
    it sends); it was not."""
    lines = ndjson(short_lived.state.model_id, audio, end=False)
    ended = asyncio.Event()

    async def body():
        yield b"".join(lines[:3])  # the parameters and 1 s of audio; then the input stays open
        await asyncio.wait_for(ended.wait(), GIVE_UP_S * 2)

    async with aiohttp.ClientSession() as http:
        counted = await _errors_counted(http, short_lived, "max_duration_exceeded")
        async with http.post(short_lived.url("/v1/audio/transcriptions", "http"), data=body(),
                             headers={"X-Streaming-Input": "true"}) as response:
            assert response.status == 200
            try:
                events, _ = await asyncio.wait_for(read_sse(response), GIVE_UP_S)
            except TimeoutError:
                raise AssertionError(f"the stream was still open {GIVE_UP_S:g} s in") from None
            finally:
                ended.set()
        assert await _errors_counted(http, short_lived, "max_duration_exceeded") == counted + 1
    _max_duration_error(events)


async def test_a_mode_b_session_is_closed_at_the_maximum_duration(short_lived, audio):
    """A Mode B session sending a chunk every few minutes, under its session timeout, held an engine session and
    a connection slot for good. At max_session_seconds it is now closed: its event stream ends with the
    WebSockets' code, later calls are 410 and the engine session is aborted (engine_returns_to_baseline); the
    error is counted in `jaxstream_errors`, as a WebSocket's is."""
    chunks = chunks_of(audio)
    async with aiohttp.ClientSession() as http:
        counted = await _errors_counted(http, short_lived, "max_duration_exceeded")
        status, created = await call(http, short_lived, "POST", SESSIONS, json={"stream": True})
        assert status == 201, created
        base = f"{SESSIONS}/{created['session_id']}"
        status, answer = await call(http, short_lived, "POST", base + "/chunks", json=chunks[0])
        assert status == 202 and answer["started"], answer
        async with http.get(short_lived.url(base + "/events", "http")) as response:
            try:
                events, _ = await asyncio.wait_for(read_sse(response), GIVE_UP_S)
            except TimeoutError:
                raise AssertionError(f"the session was still open {GIVE_UP_S:g} s in") from None
        _max_duration_error(events)
        assert await _errors_counted(http, short_lived, "max_duration_exceeded") == counted + 1
        status, answer = await call(http, short_lived, "POST", base + "/chunks", json=chunks[1])
        assert status == 410 and answer["error"]["code"] == "session_expired", answer
        assert f"maximum duration of {MAX_AGE_S:g} s" in answer["error"]["message"], answer
