"""OpenAI's `/v1/audio/transcriptions` in `jaxstream serve`, driven over loopback by the official `openai` SDK,
`curl -N` and raw sockets: the response formats, logprobs and streaming, OpenAI-shaped errors for fields and uploads
it cannot use, API keys, bodies that break off, stall or are malformed, and the bounds on a form and on an upload's
decoding. The oracle is engine.transcribe of the same PCM16 audio (test_serve_http.py's `reference`)."""
import asyncio
import functools
import io
import json
import socket
import subprocess
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import openai
import pytest
import soundfile

from jaxstream.serving import http_transcriptions
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread
from serve_fixtures import audio, engine, engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from test_serve_http import SESSIONS, expected_logprobs, parse_sse
from test_serve_http import reference, wav  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=120)


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


@pytest.mark.parametrize("kwargs", [{}, {"response_format": "json"}, {"response_format": "text"},
                                    {"response_format": "srt"}, {"response_format": "vtt"},
                                    {"response_format": "json", "stream": True}],
                         ids=["default", "json", "text", "srt", "vtt", "stream"])
def test_timestamp_granularities_need_verbose_json(client, model, wav, kwargs):
    """OpenAI refuses timestamp granularities with a response_format other than verbose_json, the one that carries
    them (and vLLM documents the same rule). They were ignored: a 200 without the word timings asked for."""
    granularities = ["segment"] if kwargs.get("stream") else ["word"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(model=model, file=("sample.wav", wav), timestamp_granularities=granularities,
                                           **kwargs)
    body = raised.value.body
    assert (body["code"], body["param"]) == ("invalid_request", "timestamp_granularities[]")
    assert body["message"] == "`response_format` must be `verbose_json` if `timestamp_granularities[]` is provided"


def test_a_long_prompt_is_taken_and_the_other_fields_stay_bounded(client, model, wav, reference):
    """A prompt over 4 KiB was a 413 `field_too_large`. OpenAI takes a long prompt (its model reads the end of it),
    vLLM any form part up to Starlette's 1 MiB, and its Voxtral ignores the prompt, as the models served here do: the
    transcript is the prompt-free one. Past 1 MiB the prompt, and past 4 KiB any other field, is still a 413."""
    result = client.audio.transcriptions.create(model=model, file=("sample.wav", wav), prompt="Lorem ipsum. " * 5000)
    assert result.text == reference.text
    for kwargs, param in (({"prompt": "x" * ((1 << 20) + 1)}, "prompt"), ({"language": "e" * 5000}, "language")):
        with pytest.raises(openai.APIStatusError) as raised:
            client.audio.transcriptions.create(model=model, file=("sample.wav", wav), **kwargs)
        body = raised.value.body
        assert (raised.value.status_code, body["code"], body["param"]) == (413, "field_too_large", param), body


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
    running at once. Now a decoding upload holds its slot, and one more waits its turn undecoded (it was refused with
    429 until the server queued one-shot requests)."""
    decoding, release, decodes = threading.Event(), threading.Event(), []
    load_audio = http_transcriptions.load_audio

    def slow_load_audio(*args, **kwargs):
        decodes.append(None)
        decoding.set()
        release.wait(30)
        return load_audio(*args, **kwargs)

    monkeypatch.setattr(http_transcriptions, "load_audio", slow_load_audio)
    server = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    upload = {"model": server.state.model_id, "file": ("sample.wav", wav)}
    waiting = functools.partial(server.state.metrics.registry.get_sample_value, "jaxstream_http_requests_waiting")
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.audio.transcriptions.create, **upload)
            assert decoding.wait(30)
            second = pool.submit(client.audio.transcriptions.create, **upload)
            deadline = time.monotonic() + 30
            while waiting() != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waiting() == 1 and len(decodes) == 1
            release.set()
            assert first.result(60).text == second.result(60).text and len(decodes) == 2
    finally:
        release.set()
        server.close()


@pytest.mark.parametrize("queue_s, refusals, answered", [(60.0, 3, 200), (0.3, 10**6, 503)], ids=["waits", "gives_up"])
def test_an_upload_waits_for_an_engine_session(engine, wav, reference, monkeypatch, queue_s, refusals, answered):
    """An upload that finds the engine at its max_sessions waits for a session (vLLM queues requests beyond
    max_num_seqs), up to `request_queue_s`, then answers 503 `capacity`: 36 of 100 uploads at once were refused
    at once, and an openai client transcribing a folder lost files."""
    from jaxstream.errors import CapacityError

    real_start, tries = engine.start_transcription, []

    async def start_transcription(*args, **kwargs):
        tries.append(None)
        if len(tries) <= refusals:
            raise CapacityError("the engine holds 64 sessions, its limit; try again later")
        return await real_start(*args, **kwargs)

    monkeypatch.setattr(engine, "start_transcription", start_transcription)
    server = ServerThread(engine, ServerConfig(limits=Limits(request_queue_s=queue_s)))
    try:
        client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
        upload = {"model": server.state.model_id, "file": ("sample.wav", wav)}
        if answered == 200:
            assert client.audio.transcriptions.create(**upload).text == reference.text
            assert len(tries) == refusals + 1
        else:
            with pytest.raises(openai.InternalServerError) as raised:
                client.audio.transcriptions.create(**upload)
            assert raised.value.status_code == 503 and raised.value.body["code"] == "capacity" and len(tries) > 2
    finally:
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

