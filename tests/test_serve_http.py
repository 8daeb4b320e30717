"""The HTTP routes of `jaxstream serve`, driven over loopback by real clients: OpenAI's
`/v1/audio/transcriptions` with the official `openai` SDK and `curl -N`, the SSE conventions of
specs/realtime_protocols.md §8 (sse.py), and the Mode B streaming-input sessions of §7.2 with aiohttp."""
import asyncio
import io
import itertools
import json
import os
import socket
import subprocess
import threading
import types
import zlib
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import openai
import pytest
import soundfile
from aiohttp import web
from aiohttp.test_utils import TestServer

from jaxstream.serving import http_transcriptions, sse
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_sessions import REPLICA_HEADER, STREAMING_INPUT
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, wait_engine_baseline, wait_engine_sessions
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


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=120)


# -- /v1/audio/transcriptions with the openai SDK ----------------------------------------------------------
def expected_logprobs(engine, done) -> list[float]:
    """engine.transcribe's logprobs of the text tokens (the ones OpenAI's `logprobs` list)."""
    return [lp for token, lp in zip(done.token_ids, done.logprobs) if not engine.tokenizer.is_control(token)]


def test_sdk_json_and_text(client, engine, model, wav, reference):
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav))
    assert result.text == reference.text and result.text and result.logprobs is None
    text = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), response_format="text")
    assert text.strip() == reference.text
    # include[]=logprobs: each text token's bytes and logprob, as the engine gives them for the same audio (to
    # f32 rounding: the upload is fed in other pieces).
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), include=["logprobs"])
    # (This SDK model types `bytes` as floats.)
    assert bytes(int(b) for lp in result.logprobs for b in lp.bytes).decode().removeprefix(" ") == reference.text
    np.testing.assert_allclose([lp.logprob for lp in result.logprobs], expected_logprobs(engine, reference),
                               atol=2e-3)


def test_sdk_verbose_json_with_words_and_subtitles(client, model, wav, reference):
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav),
                                                response_format="verbose_json",
                                                timestamp_granularities=["word", "segment"])
    assert result.text == reference.text and result.duration == pytest.approx(reference.usage.audio_seconds)
    assert [w.word for w in result.words] == [w.word for w in reference.words]
    assert all(0 <= w.start <= w.end <= result.duration for w in result.words)
    assert " ".join(s.text for s in result.segments) == " ".join(w.word for w in reference.words)
    srt = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), response_format="srt")
    assert srt.startswith("1\n00:00:0") and " --> " in srt and "," in srt.splitlines()[1]
    vtt = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:0") and "." in vtt.splitlines()[2]


def test_sdk_stream(client, engine, model, wav, reference):
    events = list(client.audio.transcriptions.create(model=model, file=("sample.wav", wav), stream=True,
                                                     include=["logprobs"]))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == reference.text
    assert "".join(e.delta for e in events[:-1]) == reference.text
    assert done.usage.output_tokens == reference.usage.output_tokens
    assert [lp.model_dump() for e in events[:-1] for lp in e.logprobs] == [lp.model_dump() for lp in done.logprobs]
    np.testing.assert_allclose([lp.logprob for lp in done.logprobs], expected_logprobs(engine, reference), atol=2e-3)


@pytest.mark.parametrize("kwargs, error, code", [
    ({"model": "no-such-model"}, openai.NotFoundError, "model_not_found"),
    ({"response_format": "xml"}, openai.BadRequestError, "invalid_request"),
    ({"response_format": "srt", "stream": True}, openai.BadRequestError, "invalid_request"),
    ({"include": ["words"]}, openai.BadRequestError, "invalid_request"),
    ({"include": ["logprobs"], "response_format": "verbose_json"}, openai.BadRequestError, "invalid_request"),
    ({"file": ("noise.wav", b"RIFF not really audio")}, openai.BadRequestError, "invalid_audio"),
])
def test_sdk_errors_in_openai_shape(client, model, wav, kwargs, error, code):
    kwargs = {"model": model, "file": ("sample.wav", wav), **kwargs}
    with pytest.raises(error) as raised:
        client.audio.transcriptions.create(**kwargs)
    assert raised.value.body["code"] == code and raised.value.body["message"]


async def test_an_empty_stream_field_is_false(server, model, wav, reference):
    """OpenAI documents `stream` as boolean or null, and a form field has no null: empty is false, as absent
    (it was a 400)."""
    form = aiohttp.FormData()
    form.add_field("file", wav, filename="sample.wav")
    form.add_field("model", model)
    form.add_field("stream", "")
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
            assert response.status == 200 and (await response.json())["text"] == reference.text


def _header_only_wav() -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(0, np.int16), 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.mark.parametrize("upload, words", [
    (("empty.wav", b""), ["'empty.wav' is empty (0 bytes)"]),
    (("zero.wav", _header_only_wav()), ["'zero.wav' holds no samples"]),
    # libsndfile reads no MP4: the upload is named, the formats it reads listed, and how to convert.
    (("talk.m4a", b"\0\0\0\x20ftypM4A not really"), ["Cannot decode audio 'talk.m4a': Format not recognised",
                                                     "WAV, FLAC, OGG", "M4A", "ffmpeg"]),
], ids=["empty", "header only", "m4a"])
def test_an_unusable_upload_is_invalid_audio_naming_the_file(client, model, upload, words):
    """An empty file was "Missing required parameter: 'file'" (it is there, and empty); an undecodable one was
    "cannot decode audio <audio bytes>", without its name or what would have been read."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(model=model, file=upload)
    body = raised.value.body
    assert (body["code"], body["param"]) == ("invalid_audio", "file") and "<audio bytes>" not in body["message"]
    assert all(word in body["message"] for word in words), body["message"]


async def test_a_missing_file_is_still_a_missing_parameter(server, model):
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("model", model)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
            error = (await response.json())["error"]
    assert (response.status, error["code"], error["param"]) == (400, "invalid_request", "file")


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": "abc"}, "temperature"), ({"temperature": 1.5}, "temperature"),
    ({"temperature": "nan"}, "temperature"), ({"language": "xx"}, "language"),
    ({"language": "en-US"}, "language"), ({"languages": ["en", "klingon"]}, "languages[]"),
    ({"chunking_strategy": "sometimes"}, "chunking_strategy"),
    ({"chunking_strategy": {"type": "semantic_vad"}}, "chunking_strategy"),
    ({"chunking_strategy": {"type": "server_vad", "threshold": 2}}, "chunking_strategy"),
    ({"chunking_strategy": {"type": "server_vad", "silence_duration_ms": 0.5}}, "chunking_strategy"),
    ({"chunking_strategy": {"type": "server_vad", "frob": 1}}, "chunking_strategy"),
])
def test_a_typed_field_that_does_not_parse_is_a_400(client, model, wav, kwargs, param):
    """OpenAI answers 400 for a form field it cannot parse as its type; these were accepted and ignored."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(model=model, file=("sample.wav", wav), **kwargs)
    assert (raised.value.body["code"], raised.value.body["param"]) == ("invalid_request", param)


def test_typed_fields_that_parse_are_accepted_and_verbose_json_names_its_language(client, model, wav, reference):
    """verbose_json's `language` is OpenAI's name of the language (`english`, where it said ""): the request's,
    else English, what the models served here transcribe by default. The fields the model does not use are
    accepted when well-formed, the transcript unchanged."""
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), response_format="verbose_json")
    assert (result.language, result.text) == ("english", reference.text)
    result = client.audio.transcriptions.create(
        model=model, file=("sample.wav", wav), response_format="verbose_json", language="FR", temperature=0.2,
        languages=["fr", "en"], chunking_strategy={"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500})
    assert (result.language, result.text) == ("french", reference.text)
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), chunking_strategy="auto",
                                                temperature="", language="english")
    assert result.text == reference.text


def test_api_key_is_required(engine, wav):
    server = ServerThread(engine, ServerConfig(api_keys=("secret",)))
    try:
        base = server.url("/v1", "http")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).audio.transcriptions.create(
                model=server.state.model_id, file=("sample.wav", wav))
        good = openai.OpenAI(base_url=base, api_key="secret", max_retries=0)
        assert good.audio.transcriptions.create(model=server.state.model_id, file=("sample.wav", wav)).text
    finally:
        server.close()


def _raw_post(server, path: str, content_type: str, length: int, body: bytes, reset: bool = False):
    """A POST over a plain socket announcing `length` bytes and sending `body`: the status line, the JSON answer
    and the headers (lower-case names), or None when `reset` (the client then resets the connection)."""
    host, port = server.url("", "http").removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode() + body)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return None
        sock.settimeout(30)
        answer = b""
        while (b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}")) and (data := sock.recv(4096)):
            answer += data
        head, payload = answer.split(b"\r\n\r\n", 1)
        status, *fields = head.decode().split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, value in (field.split(":", 1) for field in fields)}
        return status, json.loads(payload), headers


def test_bodies_that_break_off_or_stall_get_an_answer_and_no_server_error(engine, wav, caplog):
    """An upload whose multipart body ends inside a part is a 400 (it was aiohttp's plain-text 500); a body
    that stops coming is a 408 after the idle timeout (it held its connection forever), which closes the
    connection on every route (RFC 9110 15.5.9; only the uploads' did); a client that resets mid-body is no
    server error in the log (it was a traceback from aiohttp's handler)."""
    server = ServerThread(engine, ServerConfig(limits=Limits(idle_timeout_s=1.0)))
    form = "multipart/form-data; boundary=XyZ"
    upload = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
              b"Content-Type: audio/wav\r\n\r\n" + wav + b"\r\n--XyZ--\r\n")
    try:
        with caplog.at_level("ERROR"):
            status, answer, _ = _raw_post(server, "/v1/audio/transcriptions", form, 300, upload[:300])
            assert status.endswith("400 Bad Request") and answer["error"]["code"] == "invalid_request", answer
            for path, kind, body in (("/v1/audio/transcriptions", form, upload[:300]),
                                     (SESSIONS, "application/json", b'{"model": '),
                                     # Read before the model is checked: this speech model's server answers it.
                                     ("/v1/completions", "application/json", b'{"model": '),
                                     # Mode A, its first line stalled or cut: before any SSE, a plain answer.
                                     ("/v1/audio/transcriptions", "application/x-multipart-streaming",
                                      b'{"model": ')):
                status, answer, headers = _raw_post(server, path, kind, len(body) + 100, body)
                assert status.endswith("408 Request Timeout") and answer["error"]["code"] == "idle_timeout"
                assert headers.get("connection", "").lower() == "close", (path, headers)
                _raw_post(server, path, kind, len(body) + 100, body, reset=True)
            server.call(asyncio.sleep(0.5))
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        server.close()


def _form(*parts: tuple[bytes, bytes, bytes]) -> bytes:
    """A multipart body (boundary XyZ) of (name, extra part headers, value) parts."""
    return b"".join(b'--XyZ\r\nContent-Disposition: form-data; name="%s"\r\n%s\r\n%s\r\n' % part
                    for part in parts) + b"--XyZ--\r\n"


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data", _form((b"model", b"", b"m"))),
    ("multipart/form-data; boundary=" + "b" * 71, b"--" + b"b" * 71 + b"--\r\n"),  # longer than RFC 2046's 70
    ("multipart/form-data; boundary=XyZ", _form(  # a part that is itself multipart: aiohttp's nested reader
        (b"model", b"", b"m"), (b"extra", b"Content-Type: multipart/mixed; boundary=AbC\r\n", b"--AbC--"))),
    ("multipart/form-data; boundary=XyZ", _form((b"model", b"Bogus\r\n", b"m"))),
    ("multipart/form-data; boundary=XyZ", _form((b"model", b"X-A: " + b"a" * (65 << 10) + b"\r\n", b"m"))),
    ("multipart/form-data; boundary=XyZ", _form((b"_charset_", b"", b"x" * 40), (b"model", b"", b"m"))),
], ids=["no boundary", "long boundary", "nested multipart", "header without colon", "long header", "long charset"])
def test_malformed_multipart_is_a_400_in_openai_shape(server, content_type, body, caplog):
    """aiohttp's multipart reader refuses these with exceptions the route let through: aiohttp's plain-text
    500 and a traceback in the log."""
    with caplog.at_level("ERROR"):
        status, answer, _ = _raw_post(server, "/v1/audio/transcriptions", content_type, len(body), body)
    assert status.endswith("400 Bad Request"), (status, answer)
    assert answer["error"]["code"] == "invalid_request" and answer["error"]["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_a_form_is_bounded_in_parts_and_bytes(server, model, monkeypatch):
    """Every form field was kept, however many: 387 MB of small fields was read whole, and a 1.2 MB gzip body
    inflating to them took 650 MB. The parts and the bytes of a form are capped (413)."""
    many = _form((b"model", b"", model.encode()), *[(b"f%d" % i, b"", b"v" * 100) for i in range(100)])
    gzip = zlib.compressobj(wbits=31)
    monkeypatch.setattr(http_transcriptions, "_FORM_BYTES", 64 << 10)
    files = _form(*[(b'file"; filename="a.wav', b"", b"\0" * (40 << 10))] * 2)  # each under the file cap
    url = server.url("/v1/audio/transcriptions", "http")
    async with aiohttp.ClientSession() as http:
        for body, headers in ((many, {}), (gzip.compress(many) + gzip.flush(), {"Content-Encoding": "gzip"}),
                              (files, {})):
            async with http.post(url, data=body, headers={
                    "Content-Type": "multipart/form-data; boundary=XyZ", **headers}) as response:
                answer = await response.json()
                assert response.status == 413 and answer["error"]["code"] == "request_too_large", answer


def _flac(seconds: float, rate: int = 8000) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(seconds * rate), np.float32), rate, format="FLAC")
    return buffer.getvalue()


def test_a_long_upload_is_refused_without_decoding_it_whole(engine, monkeypatch, soundfile_reads):
    """A compressed file of hours of silence is small, its samples gigabytes: a 2.7 MB FLAC of 2 h of 96 kHz
    stereo was decoded whole (12 GB) before its length was checked. Its declared length is checked first; a
    file that declares none (libsndfile's unknown-length count) is decoded a block at a time and refused
    past the limit. Both are the 400 audio_too_long of a long file."""
    flac, requested = _flac(60), soundfile_reads
    server = ServerThread(engine, ServerConfig(limits=Limits(max_audio_seconds=10)))
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    try:
        for declared in (True, False):
            if not declared:
                monkeypatch.setattr(soundfile.SoundFile, "frames", property(lambda self: 2**63 - 1))
            with pytest.raises(openai.BadRequestError) as raised:
                client.audio.transcriptions.create(model=server.state.model_id, file=("long.flac", flac))
            assert raised.value.body["code"] == "audio_too_long" and raised.value.body["param"] == "file"
            assert ("60 s" in raised.value.body["message"]) == declared
            assert requested == [] if declared else 0 < sum(requested) < 60 * 8000
    finally:
        server.close()


def test_an_upload_is_admitted_before_it_is_decoded(engine, wav, monkeypatch):
    """Uploads were decoded before they were admitted: the connection limit did not bound the decodes
    running at once. Now a decoding upload holds its slot, and one more is refused (429)."""
    decoding, release = threading.Event(), threading.Event()
    load_audio = http_transcriptions.load_audio

    def slow_load_audio(*args, **kwargs):
        decoding.set()
        release.wait(30)
        return load_audio(*args, **kwargs)

    monkeypatch.setattr(http_transcriptions, "load_audio", slow_load_audio)
    server = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=10)
    upload = {"model": server.state.model_id, "file": ("sample.wav", wav)}
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.audio.transcriptions.create, **upload)
            assert decoding.wait(30)
            with pytest.raises(openai.RateLimitError) as raised:
                client.audio.transcriptions.create(**upload)
            assert raised.value.body["code"] == "capacity"
            release.set()
            assert first.result(60).text
    finally:
        release.set()
        server.close()


def test_curl_stream_headers_ids_and_done(server, model, wav, tmp_path, reference):
    path = tmp_path / "sample.wav"
    path.write_bytes(wav)
    out = subprocess.run(["curl", "-sS", "-N", "-i", server.url("/v1/audio/transcriptions", "http"),
                          "-F", f"file=@{path}", "-F", f"model={model}", "-F", "stream=true"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    headers = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in head.splitlines()[1:]}
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in headers
    events = parse_sse(body)
    assert [i for i, _ in events] == list(range(1, len(events) + 1))  # an id on every event, in order
    assert events[-1][1] == "[DONE]" and events[-2][1]["text"] == reference.text


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
