"""Fuzzed requests on the speech server's HTTP routes: multipart uploads whose fields (any of the route's, repeated,
as text, lone surrogates or bytes that are no UTF-8) and file (a WAV, junk, empty, none) vary, and Mode B sessions
created with fuzzed JSON bodies, then finished. Whatever the request, the answer is a 200/201 or a 4xx, never a 5xx,
and the engine ends at its baseline (serve_fixtures' check after every test)."""
import base64
import http.client
import io
import json
import uuid

import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_fixtures import engine, engine_returns_to_baseline, fuzz_text, model, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
FORM_FIELDS = ("model", "language", "temperature", "response_format", "timestamp_granularities[]", "include[]",
               "stream", "chunking_strategy", "prompt", "chunking_strategy[type]", "chunking_strategy[threshold]",
               "file")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | fuzz_text(12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(fuzz_text(8), inner, max_size=3), max_leaves=6)


def wav_bytes() -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(8000, np.float32), 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def multipart(fields: list[tuple[str, str | bytes]], file: bytes | None) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields:
        data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + data + b"\r\n")
    if file is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                     'Content-Type: audio/wav\r\n\r\n'.encode() + file + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.fixture
def connection(server):
    host, port = server.url("", "http").removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    yield connection
    connection.close()


def post(connection, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    connection.request("POST", path, body, {"Content-Type": content_type})
    response = connection.getresponse()
    return response.status, response.read()


def test_fuzzed_uploads_get_a_200_or_a_4xx(connection, model):
    values = (st.sampled_from(["json", "text", "srt", "vtt", "verbose_json", "true", "false", "en", "fr", "0.5", "-1",
                               "word", "segment", "logprobs", "auto", "server_vad", model, ""])
              | fuzz_text(10) | st.binary(max_size=10))

    @SETTINGS
    @given(fields=st.lists(st.tuples(st.sampled_from(FORM_FIELDS), values), max_size=6),
           file=st.sampled_from([wav_bytes(), b"RIFF\x10\x00\x00\x00WAVEjunk", b"", None]))
    def check(fields, file):
        status, answer = post(connection, "/v1/audio/transcriptions", *multipart(fields, file))
        assert status == 200 or 400 <= status < 500, (status, fields, file and file[:16], answer[:300])

    check()


def test_fuzzed_session_bodies_get_a_201_or_a_4xx(connection, model):
    fields = {"model": st.just(model) | json_values, "modality": st.sampled_from(["audio", "text"]) | json_values,
              "stream": st.booleans() | json_values,
              "params": st.dictionaries(st.sampled_from(["language", "delay_ms", "temperature", "max_tokens",
                                                         "start_policy", "streaming_input", "prompt"]),
                                        json_values, max_size=3) | json_values,
              "sequence_id": st.integers(-1, 3) | json_values,
              "payload": st.just(base64.b64encode(bytes(640)).decode()) | json_values,
              "end_of_input": st.booleans() | json_values}

    @SETTINGS
    @given(body=st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names})))
    def check(body):
        status, answer = post(connection, "/v1/streaming_input/sessions", json.dumps(body).encode(), "application/json")
        assert status == 201 or 400 <= status < 500, (status, body, answer[:300])
        if status == 201:
            session = json.loads(answer)["session_id"]
            status, answer = post(connection, f"/v1/streaming_input/sessions/{session}/finish", b"", "application/json")
            assert status < 500, (status, body, answer[:300])

    check()
