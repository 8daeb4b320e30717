"""Fuzzed JSON bodies on a text LM's HTTP routes (/v1/completions, /v1/chat/completions, /tokenize, /detokenize):
every field the routes read, with values of every JSON type (lone surrogates, NaN and huge numbers included) beside
plausible ones. Whatever the body, the answer is a 200 or a 4xx in OpenAI's error shape, never a 5xx, and a stream
ends with `[DONE]`; the server keeps serving (a plain completion after the fuzz still equals the engine's)."""
import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_fixtures import fuzz_text
from test_serve_http_completions import chat_server as server, engine  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | fuzz_text(12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(fuzz_text(8), inner, max_size=3), max_leaves=6)
words = st.lists(st.sampled_from(["w5", "w17", "w40", "w9", "Hello", "?"]), min_size=1, max_size=6).map(" ".join)
ids = st.lists(st.integers(-2, 300), min_size=0, max_size=6)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | json_values},
    optional={"content": words | fuzz_text(12) | json_values | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | json_values, "text": words | json_values}), max_size=2),
        "name": words | json_values}), min_size=0, max_size=3)
small = st.integers(-1, 8) | json_values
FIELDS = {
    "model": st.sampled_from(["", "other"]) | json_values, "prompt": words | ids | fuzz_text(12) | json_values,
    "messages": messages | json_values, "tokens": ids | json_values, "max_tokens": small,
    "max_completion_tokens": small, "min_tokens": small, "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values, "top_k": small, "seed": st.integers(-2**64, 2**65) | json_values,
    "stop": words | st.lists(words, max_size=2) | json_values, "stop_token_ids": ids | json_values,
    "logprobs": small, "top_logprobs": small, "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "n": small, "echo": st.booleans() | json_values, "ignore_eos": st.booleans() | json_values,
    "include_stop_str_in_output": st.booleans() | json_values, "return_token_ids": st.booleans() | json_values,
    "skip_special_tokens": st.booleans() | json_values, "add_generation_prompt": st.booleans() | json_values,
    "continue_final_message": st.booleans() | json_values, "add_special_tokens": st.booleans() | json_values,
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["add_generation_prompt", "messages", "x", "bos_token"]),
                                            json_values, max_size=2) | json_values,
    "documents": st.lists(st.dictionaries(fuzz_text(6), words, max_size=2), max_size=2) | json_values,
    "tools": json_values, "response_format": json_values, "return_token_strs": st.booleans() | json_values,
    "presence_penalty": small, "frequency_penalty": small, "repetition_penalty": small, "min_p": small,
    "logit_bias": st.dictionaries(st.sampled_from(["5", "17", "300", "-1", "x"]), small, max_size=2) | json_values,
}
# A few fields a body: with many, one is nearly always refused first and the rest go untried.
bodies = st.tuples(st.sampled_from(ROUTES), st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names})))


def post(connection: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, str, bytes]:
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.getheader("Content-Type", ""), response.read()


def test_fuzzed_text_bodies_get_a_200_or_an_openai_shaped_4xx(server):
    host, port = server.url("", "http").removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies)
    def check(body):
        path, fields = body
        # allow_nan: Python's json (the server's) reads NaN and Infinity, as many clients write them.
        status, content_type, answer = post(connection, path, json.dumps(fields).encode())
        assert status == 200 or 400 <= status < 500, (status, fields, answer[:300])
        if status != 200:
            error = json.loads(answer)["error"]
            assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str), error
        elif content_type.startswith("text/event-stream"):
            data = [line[6:] for line in answer.decode().split("\n") if line.startswith("data: ")]
            assert data[-1] == "[DONE]", (fields, answer[-300:])
            for event in map(json.loads, data[:-1]):  # an error event is the client's, as a 4xx would be
                assert "error" not in event or event["error"]["type"] != "server_error", (fields, event)
        else:
            json.loads(answer)

    try:
        check()
        status, _, answer = post(connection, "/v1/completions", json.dumps(
            {"prompt": "w5 w17", "max_tokens": 4, "temperature": 0, "return_token_ids": True}).encode())
        assert status == 200 and len(json.loads(answer)["choices"][0]["token_ids"]) <= 4
    finally:
        connection.close()
