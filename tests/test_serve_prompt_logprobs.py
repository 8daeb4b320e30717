"""Prompt logprobs over HTTP and `AsyncEngine.generate`: OpenAI's `echo` with `logprobs` on /v1/completions (the
prompt's tokens in the legacy `logprobs`, plain and streamed) and vLLM's `prompt_logprobs` field on completions and
chat, as vLLM's OpenAI server answers them. The server runs the tiny Llama with a word-level tokenizer
(test_serve_http_completions); prompts are the fixture's `input_ids`, so transformers' committed logits are the
oracle (test_engine_prompt_logprobs.reference). Driven by the `openai` SDK and aiohttp."""
import asyncio
import time

import aiohttp
import openai
import pytest

from jaxstream.engine.requests import RequestOutputKind, SamplingParams, StreamingInput
from jaxstream.errors import InvalidRequestError
from serve_fixtures import client, engine_returns_to_baseline, model  # noqa: F401 - pytest fixtures
from test_engine_prompt_logprobs import reference
from test_engine_text_model import LLAMA
from test_serve_http import call
from test_serve_http_completions import SESSIONS, engine, ndjson_lines  # noqa: F401 - a fixture
from test_serve_http_completions import chat_server as server  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow
IDS, ORACLE = reference(LLAMA)


def check_prompt_part(logprobs: dict, tokenizer, num: int) -> None:
    """The legacy `logprobs` of the echoed IDS: their strings, null for the first token, then each token's
    transformers logprob and its position's likeliest tokens (the token first), offsets counting the strings."""
    tokens = [tokenizer.token_string(token_id) for token_id in IDS]
    assert logprobs["tokens"][:len(IDS)] == tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [sum(map(len, tokens[:i])) for i in range(len(IDS))]
    assert logprobs["text_offset"][:len(IDS)] == offsets
    for position in range(1, len(IDS)):
        expected, token = ORACLE[position - 1], tokens[position]
        assert abs(logprobs["token_logprobs"][position] - expected[IDS[position]]) < 1e-4
        top = logprobs["top_logprobs"][position]
        assert next(iter(top)) == token and len(top) in (num, num + 1) and top[token] == logprobs["token_logprobs"][
            position]


def assert_close(ours: dict, theirs: dict) -> None:
    """Legacy `logprobs` bodies alike: the same tokens and offsets, logprobs within float32 rounding (a prompt whose
    KV came from the prefix cache was computed in other chunks)."""
    assert ours["tokens"] == theirs["tokens"] and ours.get("text_offset") == theirs.get("text_offset")
    assert [value is None for value in ours["token_logprobs"]] == [value is None for value in theirs["token_logprobs"]]
    for mine, other in zip(ours["token_logprobs"], theirs["token_logprobs"]):
        assert mine is None or abs(mine - other) < 1e-5
    for mine, other in zip(ours["top_logprobs"], theirs["top_logprobs"]):
        assert (mine is None) == (other is None)
        assert mine is None or (mine.keys() == other.keys() and all(abs(mine[k] - other[k]) < 1e-5 for k in mine))


def test_echo_with_logprobs_puts_the_prompts_before_the_completions(engine, client, model):
    """Was a 400: `echo` with `logprobs` gives the prompt's tokens first (vLLM's), then the completion's as a request
    without echo gets them, its offsets after the prompt's strings; `n` choices share the prompt's. Streamed, the echo's
    chunk carries the prompt's, and the chunks add up to the plain answer."""
    fields = dict(model=model, prompt=IDS, max_tokens=4, temperature=0, logprobs=2)
    alone = client.completions.create(**fields).choices[0]
    result = client.completions.create(**fields, echo=True, n=2)
    for choice in result.choices:
        logprobs = choice.logprobs.model_dump()
        check_prompt_part(logprobs, engine.tokenizer, 2)
        assert choice.text == engine.tokenizer.decode(IDS) + alone.text
        completion = {name: values[len(IDS):] for name, values in logprobs.items()}
        shift = sum(map(len, logprobs["tokens"][:len(IDS)]))
        assert_close(completion, {**alone.logprobs.model_dump(),
                                  "text_offset": [offset + shift for offset in alone.logprobs.text_offset]})
        assert choice.prompt_logprobs == result.choices[0].prompt_logprobs  # vLLM's field too: echo asked them
    chunks = list(client.completions.create(**fields, echo=True, stream=True))
    assert chunks[0].choices[0].text == engine.tokenizer.decode(IDS)
    assert chunks[0].choices[0].logprobs.tokens == logprobs["tokens"][:len(IDS)]
    streamed = {name: [value for chunk in chunks if chunk.choices[0].logprobs
                       for value in getattr(chunk.choices[0].logprobs, name)]
                for name in ("tokens", "token_logprobs", "top_logprobs")}
    assert_close(streamed, {name: value for name, value in result.choices[0].logprobs.model_dump().items()
                            if name in streamed})


def test_prompt_logprobs_field_on_completions_and_chat(engine, client, model):
    """vLLM's `prompt_logprobs: N` (was a 400): each choice's `prompt_logprobs` (null, then {id: {logprob, rank,
    decoded_token}} a prompt token, transformers' logprobs), the same on every choice; chat's on its body."""
    result = client.completions.create(model=model, prompt=IDS, max_tokens=2, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 3})
    field = result.choices[0].prompt_logprobs
    assert result.choices[1].prompt_logprobs == field and result.choices[0].logprobs is None
    assert len(field) == len(IDS) and field[0] is None
    for position in range(1, len(IDS)):
        entry = field[position][str(IDS[position])]
        assert abs(entry["logprob"] - ORACLE[position - 1][IDS[position]]) < 1e-4
        assert entry["decoded_token"] == engine.tokenizer.token_string(IDS[position]) and entry["rank"] >= 1
        assert len(field[position]) in (3, 4)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5 w17 w40"}],
                                          max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    prompt = chat.prompt_token_ids
    same = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1}).choices[0].prompt_logprobs
    assert len(chat.prompt_logprobs) == len(prompt) and chat.prompt_logprobs[0] is None
    for ours, theirs in zip(chat.prompt_logprobs[1:], same[1:]):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[key]["logprob"] - theirs[key]["logprob"]) < 1e-5 for key in ours)


@pytest.mark.parametrize("route, extra, status", [
    ("completions", {"prompt_logprobs": 2, "stream": True}, 400),  # vLLM's: a stream has no such field
    ("chat", {"prompt_logprobs": 2, "stream": True}, 400),
    ("completions", {"prompt_logprobs": 21}, 400),
    ("chat", {"prompt_logprobs": -1}, 400),  # vLLM's -1 (every id) is over max_logprobs
    ("completions", {"prompt_logprobs": 0, "stream": True}, 200),  # vLLM takes 0 with a stream
])
def test_what_vllm_refuses_is_refused(client, model, route, extra, status):
    create = (client.completions.create if route == "completions" else client.chat.completions.create)
    prompt = {"prompt": "w5 w17"} if route == "completions" else {"messages": [{"role": "user", "content": "w5"}]}
    if status == 200:
        assert list(create(model=model, **prompt, max_tokens=2, extra_body=extra))
        return
    with pytest.raises(openai.BadRequestError) as raised:
        create(model=model, **prompt, max_tokens=2, extra_body=extra)
    assert (raised.value.body["code"], raised.value.body["param"]) == ("invalid_request", "prompt_logprobs")


async def test_streaming_input_refuses_them(engine, server, model):
    """Mode A and Mode B (streaming input, as the engine's): a 4xx naming the field, before any stream."""
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(ndjson_lines(model, ["w5"], prompt_logprobs=1))) as response:
            error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "prompt_logprobs"
        status, created = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "params": {"max_tokens": 2, "prompt_logprobs": 1}})
    assert (status, created["error"]["param"]) == (422, "params.prompt_logprobs")

    async def inputs():
        yield StreamingInput([5, 17])

    with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported with streaming input"):
        async for _ in engine.generate(inputs(), SamplingParams(max_tokens=2, prompt_logprobs=1)):
            pass


async def test_generate_names_tokens_and_a_slow_consumer_keeps_them(engine):
    """`generate` names the tokens with the engine's tokenizer; a consumer that reads late gets its queued DELTA outputs
    merged into one, and that one keeps the prompt logprobs (the later outputs' empty lists must not hide them)."""
    stream = engine.generate(IDS, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1))
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the request is sent
    time.sleep(2)  # the loop is blocked: the engine finishes it, its outputs wait for the loop
    out = await first
    assert len(out.outputs[0].token_ids) > 1  # merged
    entries = out.prompt_logprobs[1]
    assert entries[IDS[1]].decoded_token == engine.tokenizer.token_string(IDS[1])
    assert abs(entries[IDS[1]].logprob - ORACLE[0][IDS[1]]) < 1e-4
    await stream.aclose()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
async def test_n_children_share_the_first_childs(engine, kind):
    """With n > 1 one child computes the prompt's logprobs and the others take the prompt's KV from the prefix cache
    (so their tokens come first); the parent's first output carries them (DELTA: the later ones an empty list), as
    n = 1's does."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=2, output_kind=kind, n=3)
    [_ async for _ in engine.generate(IDS, SamplingParams(max_tokens=1))]  # cached: the others' first tokens come first
    hits = engine.core.prefix_cache_counts[1]
    outputs = [out async for out in engine.generate(IDS, params)]
    assert engine.core.prefix_cache_counts[1] > hits
    assert len(outputs[0].prompt_logprobs) == len(IDS) and outputs[0].prompt_logprobs[1].keys() >= {IDS[1]}
    assert abs(outputs[0].prompt_logprobs[1][IDS[1]].logprob - ORACLE[0][IDS[1]]) < 1e-4
    assert [out.prompt_logprobs for out in outputs[1:]] == [[]] * (len(outputs) - 1)
    assert sorted(c.index for out in outputs for c in out.outputs if c.finish_reason) == [0, 1, 2]

