"""Tool calls and reasoning on /v1/chat/completions, as vLLM serves them (serving/chat_parsing.py, tool_parsers.py,
reasoning_parsers.py, json_stream.py).

Oracles: vLLM's parser tests (tests/tool_parsers/test_hermes_tool_parser.py, test_llama3_json_tool_parser.py,
test_mistral_tool_parser.py): their model outputs and the content and calls they expect; Python's json for the
streamed arguments (they add up to `json.dumps(json.loads(...))`); transformers' `apply_chat_template(tools=...)`
for the prompts (tests/make_chat_fixtures.py wrote tests/fixtures/chat/tool_cases.json); and the openai SDK, the
client whose models (and stream helper, which assembles tool-call deltas) read every answer. The tiny model's output is
random, so the route is driven with scripted engine output (the engine's `generate` replaced), and once with the
real engine, whose output no parser may change when it holds no call."""
import asyncio
import contextlib
import json
import logging
import re
import shutil

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstream.engine.requests import CompletionOutput, RequestOutput, SamplingParams
from jaxstream.models.tokenizers import load_tokenizer
from jaxstream.serving.chat_parsing import parse_tools
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_chat import render_chat
from jaxstream.serving.json_stream import JsonReader, normal_text
from jaxstream.serving.testing import ServerThread
from jaxstream.serving.tool_parsers import TOOL_PARSERS
from make_chat_fixtures import FIXTURES, checkpoint
from serve_fixtures import captured_server_configs
from test_chat_completions import engine_returns_to_baseline  # noqa: F401 - autouse: engine tests leave it idle
from test_engine_text_model import LLAMA
from test_serve_http_completions import engine_run, text_engine

TOOL_CASES = json.loads((FIXTURES / "tool_cases.json").read_text())["cases"]
WEATHER = TOOL_CASES[0]["tools"][0]
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
HERMES = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


# -- streamed arguments: json.dumps of the value, whatever the model's spacing and escapes -----------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(json_values, st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " : ")]), st.booleans(),
       st.integers(1, 9))
def test_streamed_json_is_json_dumps_of_the_value(value, separators, ascii_escapes, size):
    text = json.dumps(value, separators=separators, ensure_ascii=ascii_escapes)
    reader, events, end = JsonReader(), [], None
    for start in range(0, len(text) + 1, size):
        piece = text[start:start + size] if start < len(text) else " and after"
        new, end = reader.feed(piece)
        events += new
        if end is not None:
            break
    else:
        events += reader.finish()
    assert "".join(map(normal_text, events)) == json.dumps(json.loads(text), ensure_ascii=False)


# -- the parsers on text: vLLM's cases -------------------------------------------------------------------------------
HERMES_CALL = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
# (output, content, [(name, arguments)])
WHOLE = {
    "hermes": [
        ("This is not a tool call.", "This is not a tool call.", []),
        (HERMES_CALL, None, [("final_answer", '{"trigger": true}')]),
        (HERMES_CALL.removesuffix("\n</tool_call>"), None, [("final_answer", '{"trigger": true}')]),
        ("Sure, let me check the weather." '<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}'
         "</tool_call>", "Sure, let me check the weather.", [("get_weather", '{"city": "NYC"}')]),
        ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
         '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>', None,
         [("search", '{"q": "cats"}'), ("search", '{"q": "dogs"}')]),
        ('<tool_call>{"name": "get_current_temperature",\n"arguments": {"location":\n"San Francisco, California", '
         '"unit": "celsius"}}</tool_call>', None,
         [("get_current_temperature", '{"location": "San Francisco, California", "unit": "celsius"}')]),
        # Arguments the model serialized (Granite 4) are the object; another string is a JSON string.
        ('<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
         None, [("get_db_config", '{"param": "max_connections"}')]),
        ('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>', None, [("do_thing", '"hello"')]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1} tail text"}</tool_call>', None,
         [("f", '"{\\"a\\": 1} tail text"')]),
    ],
    "llama3_json": [
        ('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
         [("searchTool", '{"query": "test query", "limit": 10}')]),
        ("This is just some text without any tool calls", "This is just some text without any tool calls", []),
        ('{"name": "searchTool", "arguments": {"query": "test"}}', None, [("searchTool", '{"query": "test"}')]),
        ('{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", "parameters": {}}'
         '; {"name": "searchTool", "parameters": {"query": "test2"}}', None,
         [("searchTool", '{"query": "test1"}'), ("getOpenIncidentsTool", "{}"), ("searchTool", '{"query": "test2"}')]),
        ('{"name": "searchTool", "parameters": {"query": "test1"}}\n{"name": "getOpenIncidentsTool", "parameters": {}}',
         None, [("searchTool", '{"query": "test1"}'), ("getOpenIncidentsTool", "{}")]),
        ('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}', None,
         [("parserTool", '{"text": "He said \\"Hello {world}\\""}')]),
        ('{"parameters": {}}', None, None),
        ('{"name": "toolWithoutParams"}', None, None),
        ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.', None,
         [("searchTool", '{"query": "test"}')]),
    ],
    "mistral": [
        ("This is a test", "This is a test", []),
        ('[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', None, [("add", '{"a": 3.5, "b": 4}')]),
        ('[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None,
         [("get_age", '{"name": "John Doe"}')]),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
         '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', None,
         [("add", '{"a": 3.5, "b": 4}'),
          ("get_current_weather", '{"city": "San Francisco", "state": "CA", "unit": "celsius"}')]),
        ('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", '{"a": 1, "b": 2}')]),
    ],
}
# vLLM's whole-text answers that its streaming does not give (nor ours, in the same way).
WHOLE_ONLY = [
    ("mistral", '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail', None,
     [("add", '{"a": 1, "b": 2}')]),
    ("mistral", "[TOOL_CALLS] not json at all", "not json at all", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas"}}]\nextra trailing data',
     None, [("get_current_weather", '{"city": "Dallas"}')]),
    # Streamed, an output that starts with text is content throughout.
    ("llama3_json", 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know '
     'more?', None, [("getOpenIncidentsTool", "{}")]),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}', None, None),  # streamed, the name went out
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}', None, None),  # cut short
    ("mistral", "Let me check.[TOOL_CALLS] oops", "Let me check. oops", []),  # the text before the marker too
]
MISTRAL_V11 = [
    ('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', None, [("add_this_and_that", '{"a": 3.5, "b": 4}')]),
    ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
     [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')]),
    ('bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "bla", [("add_this_and_that", '{"a": 3.5, "b": 4}')]),
    # Arguments as written, JSON or not (vLLM keeps a broken call so that the model sees it tried one).
    ('hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')', "hi{hi",
     [("bash", '{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')')]),
    ("[TOOL_CALLS]toolname_no_args", None, []),
]
# A start tag inside an argument's string is the argument's text (vLLM's regions end at the first end tag).
WHOLE["hermes"].append(('<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_call>', None,
                        [("f", '{"a": "<tool_call>"}')]))
CASES = [(name, *case) for name, cases in WHOLE.items() for case in cases]


def parser(name: str, v11: bool = False):
    return TOOL_PARSERS[name](v11)


def whole(tool_parser, output: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = tool_parser.extract(output)
    id_form = MISTRAL_ID if tool_parser.markers == ("[TOOL_CALLS]",) else ID
    assert all(id_form.fullmatch(call.id) for call in calls) and len({call.id for call in calls}) == len(calls)
    return content, [(call.name, call.arguments) for call in calls]


def streamed(tool_parser, output: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    """The output fed `size` characters at a time: the content and calls the deltas add up to, each call's first delta
    carrying its index, id, type and whole name, and no later one repeating them."""
    content, calls = "", {}
    pieces = [tool_parser.feed(output[start:start + size]) for start in range(0, len(output), size)]
    for text, deltas in [*pieces, tool_parser.finish()]:
        content += text
        for delta in deltas:
            if delta["index"] not in calls:
                assert delta["index"] == len(calls) and delta["type"] == "function" and delta["id"]
                calls[delta["index"]] = [delta["id"], delta["function"]["name"], ""]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]][2] += delta["function"].get("arguments", "")
    assert tool_parser.called == bool(calls)
    return content or None, [(name, arguments) for _, name, arguments in calls.values()]


@pytest.mark.parametrize("name, output, content, calls", CASES)
def test_tool_parsers_give_vllms_answers_whole_and_streamed(name, output, content, calls):
    """vLLM's cases, whole; streamed in pieces of any size, the same content and calls (a broken first call: the
    whole output as content). The arguments are json.dumps' text of the model's, streamed as they complete."""
    expected = (output, []) if calls is None else (content, calls)
    assert whole(parser(name), output) == expected
    for size in (1, 2, 3, 5, 8, 1000):
        assert streamed(parser(name), output, size) == expected, size


@pytest.mark.parametrize("name, output, content, calls", WHOLE_ONLY)
def test_whole_text_answers_of_vllm_that_streaming_does_not_give(name, output, content, calls):
    assert whole(parser(name), output) == ((output, []) if calls is None else (content, calls))


def test_streamed_answers_of_vllm():
    """vLLM's streamed Mistral list keeps the text after the list as content; llama3_json reads calls only from an
    output that starts with one; a stream's first broken call gives back the text it held, as content."""
    assert streamed(parser("mistral"), WHOLE_ONLY[2][1], 4) == (
        "\nextra trailing data", [("get_current_weather", '{"city": "Dallas"}')])
    assert streamed(parser("llama3_json"), WHOLE_ONLY[3][1], 4) == (WHOLE_ONLY[3][1], [])
    broken = '<tool_call>{"name": "f" "arguments": {}}</tool_call> after'
    assert streamed(parser("hermes"), broken, 3) == (broken, [])
    answer = '{"answer": 42} is JSON, no call'
    assert streamed(parser("llama3_json"), answer, 5) == (answer, [])
    # A call cut short after its arguments: streamed before the end showed it (vLLM's streaming sends it too).
    assert streamed(parser("hermes"), WHOLE_ONLY[5][1], 4) == (None, [("final_answer", '{"trigger": true}')])


@pytest.mark.parametrize("output, content, calls", MISTRAL_V11)
def test_mistral_v11_calls_are_name_then_arguments(output, content, calls):
    """Tekken tokenizers from v11 write `[TOOL_CALLS]name{arguments}` for each call (vLLM's v11 cases)."""
    assert whole(parser("mistral", v11=True), output) == (content, calls)
    for size in (1, 3, 1000):
        assert streamed(parser("mistral", v11=True), output, size) == (content, calls)


def test_held_text_is_released_when_it_is_no_tag():
    tool_parser = parser("hermes")
    assert tool_parser.feed("a <tool_") == ("a ", [])
    assert tool_parser.feed("box> b") == ("<tool_box> b", [])
    assert tool_parser.finish() == ("", [])


# -- prompts: tools, tool calls, tool results and reasoning reach the template as vLLM gives them ----------------------
@pytest.mark.parametrize("case", TOOL_CASES, ids=[case["name"] for case in TOOL_CASES])
def test_tools_reach_the_template_as_transformers_renders_them_for_vllm(tmp_path, case):
    """The request as a client sends it (tools, JSON-string arguments, reasoning_content) renders as transformers
    renders what vLLM gives the template: Qwen3's, Llama 3.1's and Mistral v0.3's templates."""
    tokenizer = load_tokenizer(checkpoint(tmp_path / case["name"], case))
    state = type("State", (), {"engine": type("Engine", (), {"tokenizer": tokenizer}), "config": ServerConfig(),
                               "model_id": "m"})
    body = {"messages": case["messages"], "chat_template_kwargs": case["kwargs"],
            **({"tools": case["tools"]} if case["tools"] else {})}
    assert render_chat(body, state, add_special_tokens=False).text == case["text"]


def test_mistral_common_encodes_the_tools():
    """A tekken tokenizer's chats: mistral-common's encoding of the request's tools (vLLM passes them to it)."""
    from importlib.resources import files

    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    path = files("mistral_common") / "data" / "tekken_240911.json"
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    expected = MistralTokenizer.from_file(str(path)).encode_chat_completion(
        ChatCompletionRequest.from_openai(messages, tools=[WEATHER])).tokens
    assert load_tokenizer(path).chat_template.encode(messages, variables={"tools": [WEATHER]}).token_ids == expected


# -- the route ---------------------------------------------------------------------------------------------------------
route = pytest.mark.slow  # a server over a text engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny Llama with the chat fixtures' tokenizer ([TOOL_CALLS] one of its special tokens) and Qwen3's
    template."""
    directory = tmp_path_factory.mktemp("tools") / "llama"
    shutil.copytree(LLAMA, directory)
    tokenizer = checkpoint(tmp_path_factory.mktemp("tokenizer") / "qwen3", TOOL_CASES[0])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    engine = text_engine(directory)
    yield engine
    engine.close()


@contextlib.contextmanager
def serving(engine, **config):
    server = ServerThread(engine, ServerConfig(**config))
    try:
        yield server, openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    finally:
        server.close()


def script(monkeypatch, engine, *choices, finish_reason="stop"):
    """The engine's `generate` replaced by one that streams each choice's pieces `(text, token_ids)` (choice i of a
    request with n > 1 is the i-th script), each token's logprob -1 with one likely token, when asked for."""
    async def generate(prompt, params: SamplingParams, request_id=None):
        steps = [(index, step, piece) for step in range(max(map(len, choices)))
                 for index, pieces in enumerate(choices[:params.n]) for piece in pieces[step:step + 1]]
        for k, (index, step, (text, ids)) in enumerate(steps):
            last = step == len(choices[index]) - 1
            logprobs = None if params.logprobs is None else [-1.0] * len(ids)
            yield RequestOutput(request_id, list(prompt), [CompletionOutput(
                index, text, list(ids), None, logprobs, finish_reason if last else None,
                top_logprobs=None if logprobs is None else [{i: -1.0} for i in ids])], k == len(steps) - 1)
            await asyncio.sleep(0)

    monkeypatch.setattr(engine, "generate", generate)


def pieces(*texts: str) -> list[tuple[str, list[int]]]:
    return [(text, [100 + i]) for i, text in enumerate(texts)]


ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_PIECES = pieces("Sure.", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}',
                     "\n</tool_call>")


def chunks_of(client, **request) -> list[dict]:
    return [chunk.to_dict() for chunk in client.chat.completions.create(**request, stream=True)]


@route
def test_tool_calls_come_as_openai_tool_calls(engine, monkeypatch):
    """A hermes call: `message.tool_calls` and finish reason "tool_calls", whole; streamed, a delta for the call's
    id, type and name, then its arguments as they complete, assembled by the SDK's stream helper into the same call."""
    script(monkeypatch, engine, CALL_PIECES)
    with serving(engine, **HERMES) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER]}
        [choice] = client.chat.completions.create(**request).choices
        [call] = choice.message.tool_calls
        assert (choice.message.content, choice.finish_reason) == ("Sure.", "tool_calls")
        assert ID.fullmatch(call.id) and (call.type, call.function.name) == ("function", "get_weather")
        assert call.function.arguments == '{"city": "Paris"}'
        with client.chat.completions.stream(**request) as stream:
            final = stream.get_final_completion()
        [streamed_choice] = final.choices
        assert streamed_choice.message.content == "Sure." and streamed_choice.finish_reason == "tool_calls"
        [streamed_call] = streamed_choice.message.tool_calls
        assert (streamed_call.function.name, streamed_call.function.arguments) == ("get_weather", '{"city": "Paris"}')
        chunks = chunks_of(client, **request)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city"'}}
    assert calls[1:] == [{"index": 0, "function": {"arguments": ': "Paris"}'}}]
    # The tag and the call's JSON before its name make no chunk; the finish chunk (nothing left to say) comes last.
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Sure."}, {"tool_calls": [calls[0]]},
                      {"tool_calls": [calls[1]]}, {}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 4 + ["tool_calls"]


@route
def test_n_logprobs_and_usage_with_tool_calls(engine, monkeypatch):
    """n = 2, one choice calling a tool, the other answering: each choice's own finish reason; with logprobs, every
    token's logprob goes out, those of pieces the parser held back in chunks without content; usage counts all."""
    answer = pieces("It is", " sunny.")
    script(monkeypatch, engine, CALL_PIECES, answer)
    with serving(engine, **HERMES) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER], "n": 2, "logprobs": True,
                   "top_logprobs": 1}
        result = client.chat.completions.create(**request)
        assert [choice.finish_reason for choice in result.choices] == ["tool_calls", "stop"]
        assert result.choices[1].message.content == "It is sunny." and not result.choices[1].message.tool_calls
        assert [len(choice.logprobs.content) for choice in result.choices] == [6, 2]
        assert result.usage.completion_tokens == 8
        chunks = chunks_of(client, **request, stream_options={"include_usage": True})
    by_choice = {0: [], 1: []}
    for chunk in chunks[:-1]:
        by_choice[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    assert [sum(len(c["logprobs"]["content"]) for c in choices if c["logprobs"]) for choices in by_choice.values()] \
        == [6, 2]
    assert [choices[-1]["finish_reason"] for choices in by_choice.values()] == ["tool_calls", "stop"]
    assert "".join(c["delta"].get("content") or "" for c in by_choice[1]) == "It is sunny."
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


@route
def test_parallel_tool_calls_false_keeps_the_first_call(engine, monkeypatch):
    script(monkeypatch, engine, pieces('<tool_call>{"name": "a", "arguments": {}}</tool_call>',
                                       '<tool_call>{"name": "b", "arguments": {}}</tool_call>'))
    with serving(engine, **HERMES) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER]}
        assert len(client.chat.completions.create(**request).choices[0].message.tool_calls) == 2
        single = client.chat.completions.create(**request, parallel_tool_calls=False).choices[0].message.tool_calls
        streamed_calls = [call for chunk in chunks_of(client, **request, parallel_tool_calls=False)
                          for call in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [call.function.name for call in single] == ["a"] and {call["index"] for call in streamed_calls} == {0}


@route
def test_mistral_calls_follow_its_control_token(engine, monkeypatch):
    """[TOOL_CALLS] is a special token: decoding skips it (no text), and the parser reads it where its id came, here
    after the words the same delta decodes to (after the prompt, the word-level decoder puts a space before each);
    the calls' ids are Mistral's."""
    vocabulary = engine.tokenizer.encode
    tool_calls_id = next(i for i in range(engine.tokenizer.vocab_size) if engine.tokenizer.token_string(i)
                         == "[TOOL_CALLS]")
    script(monkeypatch, engine, [(" Hi there", [*vocabulary("Hi there"), tool_calls_id]),
                                 (' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', [100])])
    with serving(engine, enable_auto_tool_choice=True, tool_call_parser="mistral") as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER]}
        message = client.chat.completions.create(**request).choices[0].message
        with client.chat.completions.stream(**request) as stream:
            streamed_message = stream.get_final_completion().choices[0].message
    for answer in (message, streamed_message):
        assert answer.content == " Hi there" and MISTRAL_ID.fullmatch(answer.tool_calls[0].id)
        assert answer.tool_calls[0].function.arguments == '{"city": "Paris"}'


@route
def test_tool_choice_none_and_a_server_without_tool_parsing(engine, monkeypatch):
    """tool_choice "none": the text is content, calls and all. Without --enable-auto-tool-choice, tools (whose
    tool_choice defaults to "auto") are vLLM's 400; with "none" they still reach the template."""
    script(monkeypatch, engine, CALL_PIECES)
    text = "".join(text for text, _ in CALL_PIECES)
    with serving(engine, **HERMES) as (server, client):
        [choice] = client.chat.completions.create(model=server.state.model_id, messages=ASK, tools=[WEATHER],
                                                  tool_choice="none").choices
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    with serving(engine) as (server, client):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=server.state.model_id, messages=ASK, tools=[WEATHER])
        assert refused.value.body["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                 "--tool-call-parser to be set")
        plain = client.chat.completions.create(model=server.state.model_id, messages=ASK, tools=[WEATHER],
                                               tool_choice="none", extra_body={"return_token_ids": True})
    expected = engine.tokenizer.chat_template.encode(ASK, variables={"tools": parse_tools({"tools": [WEATHER]})})
    assert plain.model_extra["prompt_token_ids"] == expected.token_ids and "<tools>" in expected.text
    assert plain.choices[0].message.content == text


@route
@pytest.mark.parametrize("fields, code, param, message", [
    ({"tools": []}, "invalid_request", "tools", "`tools` must not be an empty array."),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "invalid_request", "tools[0]",
     "must be"),
    ({"tools": [{"type": "retrieval"}]}, "invalid_request", "tools[0]", "must be"),
    ({"tool_choice": "auto"}, "invalid_request", "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": [WEATHER], "tool_choice": "any"}, "invalid_request", "tool_choice",
     'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or "required" are supported.'),
    # A forced call (structured outputs: test_serve_structured_outputs.py) with a constraint of the body's own.
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "invalid_request",
     "tool_choice", "You can only either use constraints for structured outputs or tools, not both."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "extra_body": {"structured_outputs": {"regex": "x"}}}, "invalid_request", "tool_choice", "not both"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "invalid_request",
     "tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
     "invalid_request", "tool_choice", "does not match any of the specified `tools`"),  # was a 500
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "invalid_request", "tool_choice.function",
     "Invalid value for `function`"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "invalid_request", "parallel_tool_calls", "true, false"),
])
def test_bad_tool_requests_are_400s(engine, fields, code, param, message):
    with serving(engine, **HERMES) as (server, client):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=server.state.model_id, messages=ASK, **fields)
    error = refused.value.body
    assert (error["code"], error["param"]) == (code, param) and message in error["message"], error


@route
def test_without_calls_a_choice_is_the_engines_output(engine):
    """With tools and the parser on, an output that holds no call is the engine's own: n choices, logprobs, a stop
    string (the real engine, whose words hold no tag)."""
    with serving(engine, **HERMES) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER], "max_tokens": 6,
                   "temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        first = client.chat.completions.create(**request)
        prompt = first.model_extra["prompt_token_ids"]
        words = [asyncio.run(engine_run(engine, prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6,
                                                                         ignore_eos=True)))[2] for i in range(2)]
        stop = words[0].split()[2]
        cut = words[0][:words[0].index(stop)]
        assert first.choices[0].message.content == words[0] and first.choices[0].finish_reason == "length"
        result = client.chat.completions.create(**request, n=2, logprobs=True)
        assert [choice.message.content for choice in result.choices] == words
        assert all(len(choice.logprobs.content) == 6 for choice in result.choices)
        stopped = client.chat.completions.create(**request, stop=[stop])
        assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (cut, "stop")
        assert stopped.choices[0].model_extra["stop_reason"] == stop
        streamed = chunks_of(client, **request, n=2)
    assert ["".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"][0]["index"] == i)
            for i in range(2)] == words


# -- reasoning through the route -------------------------------------------------------------------------------------
THINKING = pieces("<think>", "\nParis is in", " France.\n", "</think>", "\n\nIt is sunny.")
QWEN3 = {"reasoning_parser": "qwen3"}


def reasoning_of(delta_or_message) -> str | None:
    extra = delta_or_message.model_extra
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's field, and its older name
    return extra.get("reasoning_content")


@route
def test_reasoning_comes_apart_from_the_content(engine, monkeypatch):
    """--reasoning-parser qwen3: `reasoning_content` (and `reasoning`) hold what the model thought, whole and streamed;
    include_reasoning false leaves it out, with the logprobs that would show it."""
    script(monkeypatch, engine, THINKING)
    with serving(engine, **QWEN3) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK}
        message = client.chat.completions.create(**request).choices[0].message
        assert (reasoning_of(message), message.content) == ("\nParis is in France.\n", "\n\nIt is sunny.")
        chunks = list(client.chat.completions.create(**request, stream=True))
        assert "".join(reasoning_of(c.choices[0].delta) or "" for c in chunks) == "\nParis is in France.\n"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "\n\nIt is sunny."
        hidden = client.chat.completions.create(**request, logprobs=True, extra_body={"include_reasoning": False})
        assert reasoning_of(hidden.choices[0].message) is None and hidden.choices[0].logprobs is None
        assert hidden.choices[0].message.content == "\n\nIt is sunny."


@route
def test_without_thinking_the_answer_is_content(engine, monkeypatch):
    """chat_template_kwargs {"enable_thinking": false}: Qwen3's template closes the reasoning in the prompt, and the
    whole output is content."""
    script(monkeypatch, engine, pieces("It is", " sunny."))
    with serving(engine, **QWEN3) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK}
        thinking = client.chat.completions.create(**request).choices[0].message
        assert (reasoning_of(thinking), thinking.content) == ("It is sunny.", None)  # no </think> yet: all reasoning
        message = client.chat.completions.create(
            **request, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (reasoning_of(message), message.content) == (None, "It is sunny.")


@route
def test_reasoning_then_a_tool_call(engine, monkeypatch):
    script(monkeypatch, engine, [*THINKING[:4], *CALL_PIECES[1:]])
    with serving(engine, **QWEN3, **HERMES) as (server, client):
        request = {"model": server.state.model_id, "messages": ASK, "tools": [WEATHER]}
        choices = [client.chat.completions.create(**request).choices[0]]
        with client.chat.completions.stream(**request) as stream:
            choices.append(stream.get_final_completion().choices[0])
        reasoning = "".join(reasoning_of(c.choices[0].delta) or "" for c in client.chat.completions.create(
            **request, stream=True) if c.choices)
    assert reasoning == "\nParis is in France.\n" == reasoning_of(choices[0].message)
    for choice in choices:  # (the stream helper's content is the role delta's "")
        assert (choice.message.content or None, choice.finish_reason) == (None, "tool_calls")
        assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris"}'


# -- flags ---------------------------------------------------------------------------------------------------------
def test_serve_takes_vllms_tool_and_reasoning_flags(monkeypatch, tmp_path, capsys):
    """--enable-auto-tool-choice, --tool-call-parser, --reasoning-parser and the same [server] keys; the flag without
    a parser is vLLM's one-line mistake."""
    from jaxstream.cli import main
    configs = captured_server_configs(monkeypatch)
    toml = tmp_path / "s.toml"
    toml.write_text('[server]\nreasoning_parser = "deepseek_r1"\n')
    level = logging.getLogger("jaxstream").level  # serve sets its own
    try:
        serve = ["serve", "--port", "0", "--config", str(toml)]
        assert main([*serve, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]) == 2
        assert main([*serve, "--enable-auto-tool-choice"]) == 2
    finally:
        logging.getLogger("jaxstream").setLevel(level)
    [config] = configs
    assert (config.enable_auto_tool_choice, config.tool_call_parser, config.reasoning_parser) == (
        True, "llama3_json", "deepseek_r1")
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
