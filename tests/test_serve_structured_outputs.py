"""Structured outputs and forced tool calls on the OpenAI routes, as vLLM serves them
(serving/structured_output_fields.py, forced_tool_calls.py).

The request fields are checked against the engine's `StructuredOutputsParams` they give; end to end, a random-weight
Llama of the byte-level BPE vocabulary (tests/fixtures/byte_bpe, with <think> and </think> added for the reasoning
parser) is driven with the openai SDK and aiohttp. Oracles: the constraint itself (the choice list, `re.fullmatch`,
`jsonschema` over the answer or a tool call's arguments), Python's json for arguments (`json.dumps(json.loads(...))`),
and the non-streamed answer for the streamed one (greedy). A random model writes whitespace and strings without end
where a grammar lets it: schemas here close their objects and bound their strings, JSON is compact
(`disable_any_whitespace`), and `json_object` is steered by `logit_bias`. A constrained stream opens before the
engine's first output (held back by the test), as an unconstrained one."""
import asyncio
import json
import re
import threading

import aiohttp
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from engine_fixtures import BYTE_BPE, byte_bpe_engine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import StructuredOutputsParams
from jaxstream.models.tokenizers import load_tokenizer
from jaxstream.serving import forced_tool_calls, sse
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.structured_output_fields import requested
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import client  # noqa: F401 - the openai SDK over this module's server
from test_serve_http import call
from test_serve_http_completions import SESSIONS, b64

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PERSON = {"type": "object", "properties": {"name": {"enum": ["alice", "bob", "carol"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
COMPACT = {"disable_any_whitespace": True, "disable_additional_properties": True}
ASK = [{"role": "user", "content": "the weather in paris?"}]
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
HANG_GUARD_S = 60  # how long a test waits for an answer the server may never give (not a measure of its speed)


# -- the request fields -> the engine's StructuredOutputsParams ----------------------------------------------------
@pytest.mark.parametrize("body, expected, param", [
    ({"structured_outputs": {"regex": "[a-z]{3}", "disable_any_whitespace": True, "backend": "x"}},
     StructuredOutputsParams(regex="[a-z]{3}", disable_any_whitespace=True), "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"], "json": None}}, StructuredOutputsParams(choice=("a", "b")),
     "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutputsParams(grammar='start: "x"'),
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     StructuredOutputsParams(json=PERSON), "response_format"),
    ({"response_format": {"type": "text"}}, None, None),
    # response_format replaces a constraint of its kind and keeps the object's options (vLLM's `replace`).
    ({"structured_outputs": {"json": TIME, "disable_additional_properties": True},
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     StructuredOutputsParams(json=PERSON, disable_additional_properties=True), "response_format"),
    ({"structured_outputs": {"disable_any_whitespace": True}, "response_format": {"type": "json_object"}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True), "response_format"),
    # vLLM < 0.12's fields are the structured_outputs fields they became.
    ({"guided_json": json.dumps(PERSON), "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(json=PERSON),
     "guided_json"),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"], "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(choice=("yes", "no"), disable_any_whitespace=True), "guided_choice"),
    ({"guided_grammar": 'start: "y"'}, StructuredOutputsParams(grammar='start: "y"'), "guided_grammar"),
    ({}, None, None),
])
def test_fields_give_the_engines_params(body, expected, param):
    asked = requested(body)
    assert (asked.params(), asked.param) == (expected, param)


@pytest.mark.parametrize("body, code, param, message", [
    ({"structured_outputs": "json"}, "invalid_request", "structured_outputs", "must be an object"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "unsupported_parameter",
     "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "unsupported_parameter", "structured_outputs.structural_tag",
     "not supported"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "unsupported_parameter", "guided_whitespace_pattern",
     "not supported"),
    ({"guided_json": {}, "guided_regex": "a"}, "invalid_request", "guided_regex", "one kind of guided decoding"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "invalid_request", "guided_regex", "old name"),
    ({"response_format": "json_object"}, "invalid_request", "response_format", "text, json_object, json_schema"),
    ({"response_format": {"type": "xml"}}, "invalid_request", "response_format", "text, json_object, json_schema"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "unsupported_parameter", "response_format",
     "structural_tag"),
    ({"response_format": {"type": "json_schema"}}, "invalid_request", "response_format",
     "When response_format type is 'json_schema', the 'json_schema' field must be provided."),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "invalid_request",
     "response_format.json_schema", "`name`"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "invalid_request",
     "response_format.json_schema.schema", "a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}}, "invalid_request",
     "response_format.json_schema.schema", "a JSON schema"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "invalid_request",
     "response_format", "one kind of structured outputs constraint"),
    # The engine's own checks, naming the field the constraint came in.
    ({"structured_outputs": {"disable_any_whitespace": True}}, "invalid_request", "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "invalid_request", "structured_outputs",
     "exactly one of"),
    ({"guided_choice": []}, "invalid_request", "guided_choice", "non-empty list of strings"),
    ({"guided_json": "{not json"}, "invalid_request", "guided_json", "not a JSON schema"),
    ({"structured_outputs": {"json_object": False}}, "invalid_request", "structured_outputs", "must be true"),
])
def test_bad_fields_are_400s_naming_the_field(body, code, param, message):
    with pytest.raises(RequestError) as refused:
        requested(body).params()
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)
    assert message in str(refused.value)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["structured_outputs", "response_format", "guided_json", "guided_choice",
                                        "guided_regex", "guided_whitespace_pattern"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                        st.sampled_from(["type", "json", "regex", "choice", "json_object",
                                                         "json_schema", "name", "schema", "text"]), inner,
                                        max_size=3), max_leaves=8), max_size=3))
def test_any_json_is_params_or_a_400(body):
    """Whatever JSON the fields hold, the answer is the engine's params or a 400, never another exception."""
    try:
        requested(body).params()
    except RequestError as exc:
        assert exc.status == 400 and exc.param


# -- forced tool calls: the schema and the output's reader ------------------------------------------------------------
def test_forced_schemas_are_vllms():
    """Named: the function's parameters (an empty object without); "required": an array of {name, parameters}, one
    object schema a tool, the tools' $defs at the top (without changing the request's tools); parallel_tool_calls
    false allows one call."""
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
    with_defs = {**ref, "$defs": {"P": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": with_defs}},
             {"type": "function", "function": {"name": "g", "parameters": None}}]
    assert forced_tool_calls.schema({"function": {"name": "f"}}, tools, parallel_tool_calls=True) == \
        tools[0]["function"]["parameters"]
    assert forced_tool_calls.schema({"function": {"name": "g"}}, tools, parallel_tool_calls=True) == \
        {"type": "object", "properties": {}}
    required = forced_tool_calls.schema("required", tools, parallel_tool_calls=True)
    assert required == {"type": "array", "minItems": 1, "$defs": {"P": {"type": "integer"}}, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["f"]}, "parameters": ref},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["g"]}, "parameters": {"type": "object",
                                                                                      "properties": {}}},
             "required": ["name", "parameters"]}]}}
    assert "$defs" in tools[0]["function"]["parameters"]
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}, {"name": "g", "parameters": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], required)
    assert forced_tool_calls.schema("required", tools, parallel_tool_calls=False)["maxItems"] == 1
    clash = [*tools, {"type": "function", "function": {"name": "h", "parameters": {"$defs": {"P": {}}}}}]
    with pytest.raises(RequestError, match="Tool definition 'P' has multiple schemas"):
        forced_tool_calls.schema("required", clash, parallel_tool_calls=True)


REQUIRED_OUTPUT = '[ {"name":"get_weather" , "parameters": {"city":"rome","unit" :"f"}},{"name":"get_time",' \
                  '"parameters":{"zone": "c\\u00e9t"}}]'


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("tool_choice, output, calls", [
    ("required", REQUIRED_OUTPUT, [("get_weather", {"city": "rome", "unit": "f"}), ("get_time", {"zone": "cét"})]),
    ({"function": {"name": "get_time"}}, ' {"zone" :\n"utc"}', [("get_time", {"zone": "utc"})]),
    ({"function": {"name": "get_time"}}, "", [("get_time", None)]),  # an empty output is a call, as in vLLM
    ({"function": {"name": "get_time"}}, '{"zone": "ut', [("get_time", None)]),  # cut short: what was read
    ("required", '[{"name":"get_time","parameters":{"zo', [("get_time", None)]),
    ("required", "not a list", []),  # not a call: the text is the content
])
def test_forced_outputs_whole_and_streamed(tool_choice, output, calls, size):
    """The calls a forced output holds, whole and streamed in pieces of `size` characters: the same names, and
    arguments that are json.dumps of the value (the deltas add up to the whole answer's)."""
    content, whole = forced_tool_calls.parser(tool_choice).extract(output)
    assert [call.name for call in whole] == [name for name, _ in calls]
    assert content == ("" if calls else output)
    for found, (_, arguments) in zip(whole, calls):
        assert ID.fullmatch(found.id)
        if arguments is not None:
            assert found.arguments == json.dumps(arguments, ensure_ascii=False)
    streaming, streamed = forced_tool_calls.parser(tool_choice), {}
    pieces = [streaming.feed(output[start:start + size]) for start in range(0, len(output), size)]
    for _, deltas in [*pieces, streaming.finish()]:
        for delta in deltas:
            if "id" in delta:
                assert delta["type"] == "function" and delta["index"] == len(streamed)
                streamed[delta["index"]] = [delta["function"]["name"], ""]
            streamed[delta["index"]][1] += delta["function"].get("arguments", "")
    assert list(streamed.values()) == [[found.name, found.arguments] for found in whole]


def test_forced_calls_of_a_mistral_tokenizer_take_its_ids():
    """Mistral's templates check a call's id (9 letters and digits): vLLM's MistralToolCall ids."""
    for tool_choice in ("required", {"function": {"name": "get_weather"}}):
        _, calls = forced_tool_calls.parser(tool_choice, mistral_ids=True).extract(REQUIRED_OUTPUT)
        assert calls and all(re.fullmatch(r"[A-Za-z0-9]{9}", found.id) for found in calls)


# -- end to end: a byte-level BPE model with <think> and </think> ----------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte_bpe_think")
    tokenizer = Tokenizer.from_file(str(BYTE_BPE / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text((BYTE_BPE / "tokenizer_config.json").read_text())
    return directory


@pytest.fixture(scope="module")
def engine(tokenizer_dir):
    engine = byte_bpe_engine(EngineConfig(
        max_sessions=4, page_size=16, batch_buckets=(4,), prefill_buckets=((4, 32),), max_num_batched_tokens=64,
        max_model_len=192), load_tokenizer(tokenizer_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    yield server
    server.close()


@pytest.fixture(autouse=True)
def engine_returns_to_baseline(request):
    yield
    if "engine" in request.fixturenames:
        asyncio.run(wait_engine_baseline(request.getfixturevalue("engine")))


def token_id(engine, text: str) -> int:
    ids = engine.tokenizer.encode(text)
    assert len(ids) == 1, ids
    return ids[0]


def test_completions_follow_each_constraint(client, engine):
    """Each kind, in each field form, gives text its constraint accepts and ends there ("stop"); a stream's text is
    the whole answer's."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    cases = [({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
              lambda text: text in ("positive", "negative", "neutral")),
             ({"guided_regex": r"[a-z]{2,5}-[0-9]{2}"}, lambda text: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", text)),
             ({"response_format": person, "structured_outputs": {"disable_any_whitespace": True}},
              lambda text: jsonschema.validate(json.loads(text), PERSON) is None and " " not in text),
             # json_object: any object; the bias steers the random model to the shortest.
             ({"response_format": {"type": "json_object"}, "logit_bias": {
                 str(token_id(engine, "{")): 100, str(token_id(engine, "}")): 100}}, lambda text: text == "{}")]
    for fields, accepts in cases:
        request = dict(model=client.models.list().data[0].id, prompt="hello world", max_tokens=40, temperature=0,
                       extra_body=fields)
        answer = client.completions.create(**request).choices[0]
        assert answer.finish_reason == "stop" and accepts(answer.text), (fields, answer)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**request, stream=True))
        assert streamed == answer.text


def test_chat_json_schema_answer(client):
    """response_format's schema shapes the chat's content."""
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}}).choices[0]
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), PERSON)


@pytest.mark.parametrize("tool_choice, finish_reason", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_forced_tool_calls(client, tool_choice, finish_reason):
    """tool_choice "required" and a named function, on a server without --enable-auto-tool-choice: the answer is
    tool calls whose arguments parse and follow the tool's parameters, content "" and vLLM's finish reason; streamed,
    the deltas add up to the same calls."""
    request = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                   parallel_tool_calls=False, max_tokens=60, temperature=0, extra_body={"structured_outputs": COMPACT})
    answer = client.chat.completions.create(**request).choices[0]
    assert (answer.finish_reason, answer.message.content) == (finish_reason, "")
    [call] = answer.message.tool_calls
    assert ID.fullmatch(call.id) and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER if call.function.name == "get_weather" else TIME)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                calls[piece.index] = [piece.id, piece.function.name, ""]
            calls[piece.index][2] += piece.function.arguments or ""
        assert not delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert finish == finish_reason
    assert [(name, arguments) for _, name, arguments in calls.values()] == [(call.function.name,
                                                                              call.function.arguments)]


def test_grammars_start_after_the_reasoning(engine):
    """With --reasoning-parser the grammar applies once the reasoning ends (vLLM's rule), from the first token when
    the request turns thinking off. The bias makes the random model close its reasoning at once: a grammar that
    applied from the start would forbid that, and the JSON would be read as reasoning."""
    end = token_id(engine, "</think>")
    for parser, variables, reasoning in (("deepseek_r1", None, ""), ("qwen3", {"enable_thinking": False}, None)):
        server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE, reasoning_parser=parser))
        try:
            client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
            answer = client.chat.completions.create(
                model=server.state.model_id, messages=ASK, max_tokens=40, temperature=0, logit_bias={str(end): 100},
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                extra_body={"structured_outputs": {"disable_any_whitespace": True},
                            "chat_template_kwargs": variables}).choices[0]
        finally:
            server.close()
        assert answer.message.model_extra["reasoning"] == reasoning, (parser, answer)
        jsonschema.validate(json.loads(answer.message.content), PERSON)


async def test_grammars_the_engine_refuses_are_400s_streamed_or_not(server):
    """An invalid regex or schema (found when the engine compiles it) is a 400 naming the field, before any stream
    opens, as vLLM answers it; a forced tool call with a constraint of the body's own is vLLM's 400."""
    model = server.state.model_id
    cases = [("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "[a-"}}, "structured_outputs",
              "invalid structured outputs regex"),
             ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nothing"}}}}}},
              "response_format", "invalid structured outputs json"),
             ("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                       "guided_choice": ["a"]}, "tool_choice", "not both")]
    async with aiohttp.ClientSession() as http:
        for path, fields, param, message in cases:
            for stream in (False, True):
                status, answer = await call(http, server, "POST", path,
                                            json={"model": model, "max_tokens": 5, "stream": stream, **fields})
                error = answer["error"]
                assert (status, error["code"], error["param"]) == (400, "invalid_request", param), error
                assert message in error["message"]


async def test_a_constrained_stream_opens_before_the_first_output(server, engine, monkeypatch):
    """The engine checks the grammar before the request runs, so a stream with a valid constraint opens at once, as
    an unconstrained one: its 200 and SSE headers arrive while the engine's first output is held back (they came with
    the first output: the grammar was compiled in the run, and an invalid one had to be a 400, not a stream's error
    event). Released, the stream carries text of the grammar."""
    release, generate = threading.Event(), engine.generate

    async def held(*args, **kwargs):  # on the server's loop: each output waits for the test's release
        async for out in generate(*args, **kwargs):
            await asyncio.to_thread(release.wait)
            yield out

    monkeypatch.setattr(engine, "generate", held)
    # No first-event timeout opens the stream within the wait below: headers come only when the server sends them
    # before the output.
    monkeypatch.setattr(sse, "FIRST_EVENT_TIMEOUT_S", 10 * HANG_GUARD_S)
    body = {"model": server.state.model_id, "prompt": "hello", "max_tokens": 20, "temperature": 0, "stream": True,
            "structured_outputs": {"regex": "[a-z]{2}=[0-9]{2}"}}
    try:
        async with aiohttp.ClientSession() as http:
            response = await asyncio.wait_for(http.post(server.url("/v1/completions", "http"), json=body),
                                              HANG_GUARD_S)
            assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
            release.set()
            events = [line.removeprefix("data: ") for line in (await response.text()).splitlines()
                      if line.startswith("data: ")]
    finally:
        release.set()  # a failed test must not leave the server's worker thread waiting
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert re.fullmatch("[a-z]{2}=[0-9]{2}", "".join(chunk["text"] for chunk in chunks))
    assert chunks[-1]["finish_reason"] == "stop"


async def test_streaming_input_refuses_structured_outputs(server):
    """Mode A (X-Streaming-Input on /v1/completions) and Mode B sessions refuse structured outputs: a grammar cannot
    span chunks that each end anywhere in it. They were refused as unsupported fields; now with the engine's words."""
    model = server.state.model_id
    head = {"model": model, "max_tokens": 3, "guided_choice": ["a", "b"]}
    chunk = {"modality": "text", "payload": b64("hello"), "end_of_input": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=f"{json.dumps(head)}\n{json.dumps(chunk)}\n".encode()) as response:
            status, answer = response.status, await response.json()
        assert (status, answer["error"]["param"]) == (400, "guided_choice"), answer
        assert "not supported with streaming input" in answer["error"]["message"]
        status, answer = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "params": {"response_format": {"type": "json_object"}}})
        assert (status, answer["error"]["param"]) == (422, "params.response_format"), answer  # the sessions' status

