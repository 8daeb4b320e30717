"""OpenAI-compatible `/v1/completions` and text streaming input over HTTP (specs/realtime_protocols.md §7,
§8), against a server over a text LM (the tiny Llama fixture with a word-level tokenizer: "w5 w17" is the
ids 5 and 17). The oracle is the engine API itself: `AsyncEngine.generate` with the same prompt, or with
the same chunks as `StreamingInput`s (the cumulative-prompt rule makes the tokens independent of when the
chunks arrive). Driven by the official `openai` SDK, aiohttp and `curl -N`."""
import asyncio
import base64
import json
import shutil
import subprocess

import aiohttp
import numpy as np
import openai
import pytest
import websockets

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StreamingInput
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from test_engine_text_model import LLAMA, word_level_tokenizer
from test_serve_http import call, parse_sse, read_sse

pytestmark = pytest.mark.slow

SESSIONS = "/v1/streaming_input/sessions"
CHUNKS = ["w5 w17 w40", " w9", " w33 w4 w71", " w12"]
MAX_TOKENS = 3


def text_engine(directory) -> AsyncEngine:
    """An engine over the tiny Llama in `directory` (with the tokenizer found there, if any)."""
    return AsyncEngine.from_pretrained(directory, config=EngineConfig(
        max_sessions=4, page_size=16, batch_buckets=(4,), prefill_buckets=((4, 8),), max_num_batched_tokens=64))


def text_engine_with_tokenizer(tmp_path_factory) -> AsyncEngine:
    directory = tmp_path_factory.mktemp("llama") / "llama"
    shutil.copytree(LLAMA, directory)
    word_level_tokenizer(directory / "tokenizer.json", 256)
    return text_engine(directory)


# A chat template in the word-level vocabulary: each message's content, then "w9" as the assistant's header.
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer (a module fixture: other modules import it)."""
    engine = text_engine_with_tokenizer(tmp_path_factory)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_server(engine):
    """A server over `engine` that renders chats with TEMPLATE (modules import it as their `server`)."""
    server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    yield server
    server.close()


def greedy(max_tokens=MAX_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


async def engine_run(engine, prompt, params=None, *, chunks: bool = False) -> tuple[list[int], list[int], str]:
    """The engine API's own (prompt_token_ids, tokens, text) for `prompt`, or for the list of chunks `prompt`
    streamed in as StreamingInputs when `chunks`."""
    if chunks:
        async def inputs(pieces):
            for piece in pieces:
                yield StreamingInput(piece, params or greedy())
        prompt = inputs(prompt)
    prompt_ids, tokens, text = [], [], ""
    async for out in engine.generate(prompt, params or greedy()):
        prompt_ids = out.prompt_token_ids
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
    return prompt_ids, tokens, text


async def engine_tokens(engine, prompt, params=None, *, chunks: bool = False) -> tuple[list[int], str]:
    """The engine API's own tokens and text (see engine_run)."""
    _, tokens, text = await engine_run(engine, prompt, params, chunks=chunks)
    return tokens, text


@pytest.fixture(scope="module")
def streamed(engine):
    """The engine's tokens and text for CHUNKS as streaming input."""
    return asyncio.run(engine_tokens(engine, CHUNKS, chunks=True))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def ndjson_lines(model: str, chunks: list[str], **params) -> list[bytes]:
    head = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **params}
    lines = [head] + [{"modality": "text", "payload": b64(c), "end_of_input": i == len(chunks) - 1}
                      for i, c in enumerate(chunks)]
    return [json.dumps(line).encode() + b"\n" for line in lines]


# -- /v1/completions with the openai SDK ----------------------------------------------------------------------
def test_sdk_completion_plain_and_streamed(engine, server, model):
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    tokens, text = asyncio.run(engine_tokens(engine, "w5 w17", greedy(6)))
    result = client.completions.create(model=model, prompt="w5 w17", max_tokens=6, temperature=0)
    assert result.choices[0].text == text and text
    assert result.usage.completion_tokens == len(tokens) and result.usage.prompt_tokens == 3  # BOS w5 w17
    assert result.choices[0].finish_reason == ("length" if len(tokens) == 6 else "stop")
    chunks = list(client.completions.create(model=model, prompt=[5, 17], max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == asyncio.run(
        engine_tokens(engine, [5, 17], greedy(6)))[1]
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_n_completions_are_the_engines_children(engine, server, model):
    """`n` (was refused): n choices, choice i the engine's completion with seed + i (vLLM's children), plain and
    streamed (each chunk one choice, by its index; each choice's own finish chunk), usage counting the prompt once."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    fields = {"prompt": "w5 w17", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    expected = [asyncio.run(engine_tokens(engine, "w5 w17", SamplingParams(temperature=1.0, seed=7 + i,
                                                                           max_tokens=6)))[1] for i in range(3)]
    assert len(set(expected)) > 1
    result = client.completions.create(model=model, **fields)
    assert [c.index for c in result.choices] == [0, 1, 2] and [c.text for c in result.choices] == expected
    assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == sum(
        len(asyncio.run(engine_tokens(engine, "w5 w17", SamplingParams(temperature=1.0, seed=7 + i,
                                                                       max_tokens=6)))[0]) for i in range(3))
    chunks = list(client.completions.create(model=model, **fields, stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], [0, 0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
    assert texts == expected and finished == [1, 1, 1] and chunks[-1].usage == result.usage


def test_echo_puts_the_prompt_before_the_completion(engine, server, model):
    """OpenAI's `echo` was refused: the choice's text is the prompt's then the completion's, plain and streamed (the
    prompt in a chunk of its own, first), a prompt of ids decoded (vLLM's)."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    _, text = asyncio.run(engine_tokens(engine, "w5 w17", greedy(6)))
    result = client.completions.create(model=model, prompt="w5 w17", max_tokens=6, temperature=0, echo=True)
    assert result.choices[0].text == "w5 w17" + text and result.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model=model, prompt="w5 w17", max_tokens=6, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == "w5 w17" and "".join(c.choices[0].text for c in chunks) == "w5 w17" + text
    by_ids = client.completions.create(model=model, prompt=[5, 17], max_tokens=6, temperature=0, echo=True)
    _, ids_text = asyncio.run(engine_tokens(engine, [5, 17], greedy(6)))
    assert by_ids.choices[0].text == engine.tokenizer.decode([5, 17]) + ids_text
    with pytest.raises(openai.BadRequestError) as raised:  # chat's echo (the last message's) is another thing
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert raised.value.body["param"] == "echo"


@pytest.mark.parametrize("kwargs, error, code", [
    ({"model": "other"}, openai.NotFoundError, "model_not_found"),
    ({"stop": ["w9", ""]}, openai.BadRequestError, "invalid_request"),  # vLLM refuses an empty stop string
    ({"n": 129}, openai.BadRequestError, "invalid_request"),  # OpenAI's bound
    ({"prompt": [5, 999]}, openai.BadRequestError, "invalid_request"),
])
def test_sdk_errors_in_openai_shape(server, model, kwargs, error, code):
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    with pytest.raises(error) as raised:
        client.completions.create(**{"model": model, "prompt": "w5", "max_tokens": 2, **kwargs})
    assert raised.value.body["code"] == code and raised.value.body["message"]


@pytest.mark.parametrize("extra, code, param", [
    ({"min_p": 1.5}, "invalid_request", "min_p"),
    ({"repetition_penalty": 0}, "invalid_request", "repetition_penalty"),
    ({"add_special_tokens": False}, "unsupported_parameter", "add_special_tokens"),
    ({"truncate_prompt_tokens": 3}, "unsupported_parameter", "truncate_prompt_tokens"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "unsupported_parameter", "response_format"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "unsupported_parameter", "stream_options"),
    ({"temperature": -1}, "invalid_request", "temperature"),
    ({"top_p": 0}, "invalid_request", "top_p"),
    ({"max_tokens": 0}, "invalid_request", "max_tokens"),
    ({"n": 0}, "invalid_request", "n"),
    ({"prompt": ""}, "invalid_request", "prompt"),
])
def test_fields_it_cannot_honour_and_bad_values_are_400s_naming_the_field(server, model, extra, code, param):
    """vLLM's sampling extras it does not serve (truncate_prompt_tokens, structural tags, ...) were taken and
    ignored: a 200 with other output than asked for. They are refused as OpenAI's unsupported fields are; a bad
    value names its field (`param` was null), and an empty prompt is refused as vLLM refuses it (it was a BOS-only
    completion)."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt="w5", max_tokens=2, extra_body=extra)
    assert (raised.value.body["code"], raised.value.body["param"]) == (code, param), raised.value.body


def test_neutral_extras_are_taken_and_a_null_max_tokens_is_the_default(engine, server, model):
    """The extras at their "not used" values are served; `max_tokens: null` (the SDK's None) is OpenAI's default
    of 16, as in vLLM: it generated up to the end of the context."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    neutral = {"min_p": 0, "repetition_penalty": 1, "add_special_tokens": True, "bad_words": [],
               "response_format": {"type": "text"},
               "skip_special_tokens": True, "ignore_eos": True}
    result = client.completions.create(model=model, prompt="w5", max_tokens=None, temperature=0, extra_body=neutral)
    assert result.usage.completion_tokens == 16 and result.choices[0].finish_reason == "length"


def test_sdk_context_length_exceeded(engine, server, model):
    """vLLM answers 400 when a one-shot prompt, or prompt + max_tokens, is over max_model_len (it was a 200
    with empty text and finish_reason 'length'); a request that just fits is served."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    limit = engine.core.max_model_len
    for prompt, max_tokens in (([5] * (limit + 3), 4), ([5] * limit, 4), ([5] * limit, None),
                               ([5] * (limit - 3), 4), (" ".join(["w5"] * (limit - 1)), 1)):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert raised.value.body["code"] == "context_length_exceeded"
        assert raised.value.body["message"].startswith(f"This model's maximum context length is {limit} tokens.")
    result = client.completions.create(model=model, prompt=[5] * (limit - 4), max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 4 and result.choices[0].finish_reason == "length"


def test_sdk_null_stream_flags_are_false(engine, server, model):
    """OpenAI documents `stream` and `stream_options.include_usage` as boolean or null, and the SDK sends
    null for None: a plain completion, a stream without usage (they were refused with 400)."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    text = asyncio.run(engine_tokens(engine, "w5 w17", greedy(4)))[1]
    result = client.completions.create(model=model, prompt="w5 w17", max_tokens=4, temperature=0, stream=None,
                                       stream_options=None)
    assert result.choices[0].text == text
    chunks = list(client.completions.create(model=model, prompt="w5 w17", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": None}))
    assert "".join(c.choices[0].text for c in chunks) == text and all(c.choices for c in chunks)


def test_sdk_stream_options_need_a_stream(engine, server, model):
    """vLLM's CompletionRequest refuses `stream_options` unless `stream` is true (its `validate_stream_options`:
    options that are not null or empty, with a stream that is not true): 400, with its message. They were
    accepted and ignored."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    for stream in (None, False):
        for options in ({"include_usage": True}, {"include_usage": False}, {"include_usage": None}):
            with pytest.raises(openai.BadRequestError) as raised:
                client.completions.create(model=model, prompt="w5", max_tokens=2, stream=stream,
                                          stream_options=options)
            body = raised.value.body
            assert body["message"] == "Stream options can only be defined when `stream=True`.", body
            assert body["param"] == "stream_options" and body["type"] == "invalid_request_error"
        result = client.completions.create(model=model, prompt="w5", max_tokens=2, temperature=0, stream=stream,
                                           extra_body={"stream_options": {}})  # empty: none defined
        assert result.object == "text_completion" and result.usage.completion_tokens > 0


def test_sdk_return_token_ids_are_the_engines(engine, server, model):
    """vLLM's `return_token_ids`: the choice carries the engine's `prompt_token_ids` (BOS included) and
    `token_ids`; streamed, the prompt's ids come in the first chunk (null in the others) and each chunk has its
    own ids, which add up to the plain answer's. Without it the choice keeps OpenAI's shape."""
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    prompt_ids, tokens, text = asyncio.run(engine_run(engine, "w5 w17", greedy(6, ignore_eos=True)))
    assert prompt_ids[1:] == [5, 17] and len(tokens) == 6
    request = {"model": model, "prompt": "w5 w17", "max_tokens": 6, "temperature": 0}
    extra = {"return_token_ids": True, "ignore_eos": True}
    choice = client.completions.create(**request, extra_body=extra).choices[0]
    assert (choice.prompt_token_ids, choice.token_ids, choice.text) == (prompt_ids, tokens, text)
    chunks = list(client.completions.create(**request, stream=True, extra_body=extra))
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == tokens
    assert "".join(c.choices[0].text for c in chunks) == text
    for answer in (client.completions.create(**request, extra_body={"ignore_eos": True}),
                   *client.completions.create(**request, stream=True, extra_body={"return_token_ids": None})):
        assert not {"prompt_token_ids", "token_ids"} & set(answer.choices[0].model_extra)


async def test_mode_a_return_token_ids_add_up_to_the_engines(engine, server, model):
    """With streaming input the engine's prompt grows by each input: a chunk carries the prompt ids no chunk
    carried before it, so that they add up to the engine's prompt_token_ids, as its token_ids to its tokens."""
    prompt_ids, tokens, _ = await engine_run(engine, CHUNKS, chunks=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(ndjson_lines(model, CHUNKS, return_token_ids=True))) as response:
            events, _ = await read_sse(response)
    choices = [e["choices"][0] for _, e in events[:-1]]
    assert events[-1][1] == "[DONE]" and choices[0]["prompt_token_ids"]
    assert [t for c in choices for t in c["prompt_token_ids"] or []] == prompt_ids
    assert [t for c in choices for t in c["token_ids"]] == tokens


@pytest.fixture(scope="module")
def tokenizerless_engine():
    engine = text_engine(LLAMA)  # the fixture checkpoint has no tokenizer
    assert engine.tokenizer is None
    yield engine
    engine.close()


def test_a_model_without_a_tokenizer_returns_its_ids(tokenizerless_engine):
    """Its text is empty: `return_token_ids` is how a client gets its output (it got empty text and no ids;
    streamed, one empty chunk)."""
    server = ServerThread(tokenizerless_engine)
    try:
        client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
        prompt_ids, tokens, text = asyncio.run(engine_run(tokenizerless_engine, [5, 17],
                                                          greedy(5, ignore_eos=True)))
        assert prompt_ids == [5, 17] and len(tokens) == 5 and text == ""
        request = {"model": server.state.model_id, "prompt": [5, 17], "max_tokens": 5, "temperature": 0,
                   "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        choice = client.completions.create(**request).choices[0]
        assert (choice.prompt_token_ids, choice.token_ids, choice.text) == (prompt_ids, tokens, "")
        chunks = list(client.completions.create(**request, stream=True))
        assert [t for c in chunks for t in c.choices[0].token_ids] == tokens
        assert [c.choices[0].prompt_token_ids for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
        asyncio.run(wait_engine_baseline(tokenizerless_engine))
    finally:
        server.close()


async def test_deeply_nested_json_is_invalid_json(engine, server, model, caplog):
    """json's decoder recurses per nesting level: `[` * 100000, a small body, raised RecursionError, a 500
    with a traceback (a server_error event on a later Mode A line). It is invalid JSON like any other."""
    deep = b"[" * 100_000 + b"\n"
    mode_a = {"X-Streaming-Input": "true"}
    with caplog.at_level("ERROR"):
        async with aiohttp.ClientSession() as http:
            # A plain body: 400, as OpenAI and vLLM answer invalid JSON; a streaming-input chunk: 422 (the spec's).
            for path, headers, status in (("/v1/completions", {}, 400), (SESSIONS, {}, 422),
                                          ("/v1/completions", mode_a, 422)):
                async with http.post(server.url(path, "http"), data=deep, headers={
                        "Content-Type": "application/json", **headers}) as response:
                    answer = await response.json()
                    assert response.status == status and answer["error"]["code"] == "invalid_json", answer
            lines = ndjson_lines(model, CHUNKS)
            async with http.post(server.url("/v1/completions", "http"), data=lines[0] + lines[1] + deep,
                                 headers=mode_a) as response:
                events, _ = await read_sse(response)
            assert events[-2][1]["error"]["code"] == "invalid_json" and events[-1][1] == "[DONE]"
        await wait_engine_baseline(engine)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_an_omitted_or_null_model_is_the_served_one(engine, server, model):
    """vLLM serves a request without `model` (or with null) with its model; it was a 400 here. A wrong or empty name
    is still refused."""
    expected = (await engine_tokens(engine, "w5 w17", greedy(2)))[0]
    async with aiohttp.ClientSession() as http:
        for extra in ({}, {"model": None}):
            status, body = await call(http, server, "POST", "/v1/completions", json={
                "prompt": "w5 w17", "max_tokens": 2, "temperature": 0, "return_token_ids": True, **extra})
            assert status == 200 and body["model"] == model and body["choices"][0]["token_ids"] == expected, body
        # "" is the served model too, as vLLM's HTTP routes take it; another name or type is not.
        for wrong, status in (("", 200), ("other", 404), (5, 400)):
            answer = await call(http, server, "POST", "/v1/completions", json={"model": wrong, "prompt": "w5"})
            assert answer[0] == status, answer


async def test_speech_routes_refuse_a_text_model(server, model):
    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData()
        form.add_field("file", b"RIFF", filename="a.wav")
        form.add_field("model", model)
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "unsupported_model"
        async with http.post(server.url(SESSIONS, "http"), json={"modality": "audio"}) as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "unsupported_model"
    # The WebSocket routes all stream speech: refused at once (they took session.update and failed at the commit).
    async with websockets.connect(server.url("/v1/realtime")) as ws:
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert event["type"] == "error" and event["code"] == "unsupported_model" and "text" in event["error"], event
        assert model not in event["error"]  # a path on the server, told to a client whose key /ws checks later
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 30)
        assert ws.close_code == 1008


# -- Mode B text sessions ---------------------------------------------------------------------------------------
async def test_text_session_refuses_a_prompt_in_its_params(server, model):
    """A Mode B text session's `params.prompt` was taken and ignored (Mode A's line refuses it): the prompt comes
    as chunks."""
    async with aiohttp.ClientSession() as http:
        status, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "params": {"prompt": "w5 w17", "max_tokens": MAX_TOKENS}})
    assert (status, created["error"]["code"], created["error"]["param"]) == (422, "invalid_request", "params.prompt")


async def test_text_session_gives_the_engine_streaming_input_tokens(server, model, streamed):
    chunks = [{"sequence_id": n, "modality": "text", "payload": b64(c), "end_of_input": n == len(CHUNKS) - 1}
              for n, c in enumerate(CHUNKS)]
    async with aiohttp.ClientSession() as http:
        status, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "stream": True, "params": {"max_tokens": MAX_TOKENS, "temperature": 0}})
        assert status == 201
        base = f"{SESSIONS}/{created['session_id']}"
        async with http.get(server.url(base + "/events", "http")) as response:
            for n in (1, 0, 2, 2, 3):  # 1 waits for 0; 2 twice
                status, answer = await call(http, server, "POST", base + "/chunks", json=chunks[n])
                assert status in (200, 202)
            events, _ = await read_sse(response)
        status, result = await call(http, server, "GET", base + "/result")
    assert status == 200 and result["token_ids"] == streamed[0] and result["text"] == streamed[1]
    assert events[-1][1] == "[DONE]" and "".join(e["choices"][0]["text"] for _, e in events[:-1]) == streamed[1]
    assert [i for i, _ in events] == list(range(1, len(events) + 1))


async def test_text_session_return_token_ids_add_up_to_the_engines(engine, server, model):
    """A Mode B text session takes `return_token_ids` among its params, as Mode A takes it in its first line
    (it was ignored): the events' ids add up to the engine's own for the same streamed chunks."""
    prompt_ids, tokens, _ = await engine_run(engine, CHUNKS, chunks=True)
    chunks = [{"sequence_id": n, "modality": "text", "payload": b64(c), "end_of_input": n == len(CHUNKS) - 1}
              for n, c in enumerate(CHUNKS)]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "stream": True,
            "params": {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}})
        base = f"{SESSIONS}/{created['session_id']}"
        async with http.get(server.url(base + "/events", "http")) as response:
            for chunk in chunks:
                assert (await call(http, server, "POST", base + "/chunks", json=chunk))[0] in (200, 202)
            events, _ = await read_sse(response)
    choices = [e["choices"][0] for _, e in events[:-1]]
    assert [t for c in choices for t in c["prompt_token_ids"] or []] == prompt_ids
    assert [t for c in choices for t in c["token_ids"]] == tokens


async def test_text_session_result_carries_the_logprobs_it_asked_for(engine, server, model):
    """A Mode B text session took `logprobs` in its params, and its /result dropped them: now they are the completion
    route's legacy `logprobs`, one entry per token, equal to the engine's own for the same streamed chunks."""
    params = greedy(logprobs=2)
    outputs = [out.outputs[0] async for out in engine.generate(
        (StreamingInput(chunk, params) async for chunk in _aiter(CHUNKS)), params)]
    tokens = [t for out in outputs for t in out.token_ids]
    logprobs = [lp for out in outputs for lp in out.logprobs]
    chunks = [{"sequence_id": n, "modality": "text", "payload": b64(c), "end_of_input": n == len(CHUNKS) - 1}
              for n, c in enumerate(CHUNKS)]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "params": {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}})
        base = f"{SESSIONS}/{created['session_id']}"
        for chunk in chunks:
            assert (await call(http, server, "POST", base + "/chunks", json=chunk))[0] in (200, 202)
        status, result = await call(http, server, "GET", base + "/result")
    assert status == 200 and result["token_ids"] == tokens
    body = result["logprobs"]
    assert len(body["tokens"]) == len(body["top_logprobs"]) == len(tokens)
    np.testing.assert_allclose(body["token_logprobs"], logprobs, rtol=1e-6)
    assert all(2 <= len(top) <= 3 for top in body["top_logprobs"])


async def _aiter(items):
    for item in items:
        yield item


@pytest.mark.parametrize("policy, first, started", [
    ({"start_policy": "on_end_only"}, len(CHUNKS), [False] * len(CHUNKS)),
    ({"streaming_input": {"start_policy": "on_min_length", "min_bytes": len("".join(CHUNKS[:2]))}}, 2,
     [False, True, True, True]),
])
async def test_text_start_policies(engine, server, model, policy, first, started):
    """The first `first` chunks are buffered and form the first prompt; each later chunk is its own
    StreamingInput."""
    chunks = [{"sequence_id": n, "payload": b64(c)} for n, c in enumerate(CHUNKS)]
    async with aiohttp.ClientSession() as http:
        _, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "params": {"max_tokens": MAX_TOKENS, "temperature": 0}, **policy})
        base = f"{SESSIONS}/{created['session_id']}"
        answers = [(await call(http, server, "POST", base + "/chunks", json=chunk))[1] for chunk in chunks]
        assert (await call(http, server, "POST", base + "/finish"))[1]["started"]
        status, result = await call(http, server, "GET", base + "/result")
    assert [answer["started"] for answer in answers] == started
    expected = await engine_tokens(engine, ["".join(CHUNKS[:first])] + CHUNKS[first:], chunks=True)
    assert status == 200 and result["token_ids"] == expected[0]


# -- Mode A: one chunked request ----------------------------------------------------------------------------------
async def test_mode_a_streams_output_while_input_arrives(server, model, streamed):
    lines = ndjson_lines(model, CHUNKS)
    first_event = asyncio.Event()

    async def body():
        yield lines[0] + lines[1]
        await asyncio.wait_for(first_event.wait(), 30)  # output comes before the rest of the input is sent
        for line in lines[2:]:
            yield line

    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), data=body(),
                             headers={"X-Streaming-Input": "true"}) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            raw = ""
            async for line in response.content:
                raw += line.decode()
                first_event.set()
    events = parse_sse(raw)
    assert events[-1][1] == "[DONE]" and "".join(e["choices"][0]["text"] for _, e in events[:-1]) == streamed[1]


def test_curl_mode_a(server, model, streamed, tmp_path):
    path = tmp_path / "body.ndjson"
    path.write_bytes(b"".join(ndjson_lines(model, CHUNKS)))
    out = subprocess.run(["curl", "-sS", "-N", server.url("/v1/completions", "http"), "-H", "X-Streaming-Input: true",
                          "-H", "Transfer-Encoding: chunked", "-H", "Content-Type: application/x-ndjson",
                          "--data-binary", f"@{path}"], capture_output=True, text=True, timeout=60, check=True).stdout
    events = parse_sse(out)
    assert [i for i, _ in events] == list(range(1, len(events) + 1)) and events[-1][1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for _, e in events[:-1]) == streamed[1]


async def test_mode_a_refuses_stream_false(server, model, streamed):
    """Mode A answers with a stream whatever its parameters line says: `stream: false` was ignored (a 200 stream
    in place of the JSON asked for); it is refused as the audio route refuses it. `stream: true` is taken."""
    async with aiohttp.ClientSession() as http:
        for stream, status in ((False, 422), (True, 200)):
            async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                                 data=b"".join(ndjson_lines(model, CHUNKS, stream=stream))) as response:
                text = await response.text()
            assert response.status == status, text
            if stream:
                events = parse_sse(text)
                assert "".join(e["choices"][0]["text"] for _, e in events[:-1]) == streamed[1]
            else:
                error = json.loads(text)["error"]
                assert (error["code"], error["param"]) == ("invalid_request", "stream")
                assert "stream must be true or absent, got False" in error["message"]


async def test_mode_a_client_disconnect_frees_the_session(engine, server, model):
    """A session parked between chunks holds its pages; the client going away aborts it and frees them."""
    lines = ndjson_lines(model, CHUNKS)
    async with aiohttp.ClientSession() as http:
        response = await http.post(server.url("/v1/completions", "http"), data=_slow_body(lines[:2]),
                                   headers={"X-Streaming-Input": "true"})
        await read_sse(response, count=1)
        await engine.wait_until_idle()  # the session has parked: its chunk is done, the input still open
        for _ in range(100):  # the engine's metrics snapshot trails its state by up to a tick
            metrics = engine.metrics()
            if metrics.sessions:
                break
            await asyncio.sleep(0.02)
        assert metrics.sessions == 1 and any(metrics.pages_used.values())
        response.close()
    await wait_engine_baseline(engine, timeout=10)


async def _slow_body(lines):
    for line in lines:
        yield line
    await asyncio.sleep(60)  # the input stays open: the client leaves first


async def test_mode_a_utf8_character_split_across_chunks(engine, server, model):
    """Chunks are bytes cut anywhere: a character split between two is decoded whole (each payload was
    decoded on its own, an invalid_text error even under on_end_only). Invalid bytes, or an input ending
    inside a character, end the stream with an invalid_text error typed as the client's."""
    data = "w5 w17 \u00e9 w9".encode()
    cut = data.index(b"\xa9")  # between the two bytes of the \u00e9

    async def mode_a(pieces, **params):
        head = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **params}
        lines = [head] + [{"modality": "text", "payload": base64.b64encode(p).decode(),
                           "end_of_input": i == len(pieces) - 1} for i, p in enumerate(pieces)]
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                                 data=b"".join(json.dumps(line).encode() + b"\n" for line in lines)) as response:
                events, _ = await read_sse(response)
        assert events[-1][1] == "[DONE]"
        return events[:-1]

    events = await mode_a([data[:cut], data[cut:]], start_policy="on_end_only")
    expected = await engine_tokens(engine, [data.decode()], chunks=True)
    assert "".join(e["choices"][0]["text"] for _, e in events) == expected[1] and expected[1]
    events = await mode_a([data[:cut], data[cut:]])
    expected = await engine_tokens(engine, ["w5 w17 ", "\u00e9 w9"], chunks=True)
    assert "".join(e["choices"][0]["text"] for _, e in events) == expected[1]
    for pieces in ([data[:cut]], [data[:cut], b"a"], [b"w5 \xff w9"]):
        events = await mode_a(pieces, start_policy="on_end_only")
        error = events[-1][1]["error"]
        assert error["code"] == "invalid_text" and error["type"] == "invalid_request_error", pieces


async def test_mode_a_errors_end_the_stream(engine, server, model):
    """A bad chunk, or an input silent past the idle timeout, ends the stream with an error event and frees
    the engine session; a bad parameters line is refused before any stream."""
    lines = ndjson_lines(model, CHUNKS)
    idle_server = ServerThread(engine, ServerConfig(limits=Limits(idle_timeout_s=0.5)))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                                 data=lines[0] + lines[1] + b'{"payload": "%%"}\n') as response:
                events, _ = await read_sse(response)
            assert events[-2][1]["error"] == {**events[-2][1]["error"], "code": "invalid_chunk",
                                              "type": "invalid_request_error"} and events[-1][1] == "[DONE]"
            async with http.post(idle_server.url("/v1/completions", "http"), data=_slow_body(lines[:2]),
                                 headers={"X-Streaming-Input": "true"}) as response:
                events, _ = await read_sse(response)
            assert events[-2][1]["error"] == {**events[-2][1]["error"], "code": "idle_timeout",
                                              "type": "invalid_request_error"} and events[-1][1] == "[DONE]"
            async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                                 data=b'{"model": "other"}\n') as response:
                assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
        await wait_engine_baseline(engine)
    finally:
        idle_server.close()
