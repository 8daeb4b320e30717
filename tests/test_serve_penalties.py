"""`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_p` and `logit_bias` on the text routes:
`/v1/completions` and `/v1/chat/completions` through the official `openai` SDK, and Mode A streaming input. They
were refused (400 `unsupported_parameter`); now they are served with vLLM's meanings, and out-of-range values are
OpenAI-shaped 400s naming the field. The oracle is the engine API with the same SamplingParams (whose penalties
tests/test_engine_penalties.py checks against transformers and numpy). A server over the tiny Llama with a
word-level tokenizer ("w5 w17" is the ids 5 and 17)."""
import asyncio

import aiohttp
import openai
import pytest

from jaxstream.engine.requests import SamplingParams
from jaxstream.serving.completion_fields import sampling_params
from serve_fixtures import client, engine_returns_to_baseline, model  # noqa: F401 - pytest fixtures
from test_serve_http import read_sse
from test_serve_http_completions import CHUNKS, engine, engine_run, ndjson_lines  # noqa: F401 - fixture
from test_serve_http_completions import chat_server as server  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

PROMPT = "w9 w9 w30"  # its greedy tokens repeat: every field changes them
MAX_TOKENS = 12


def engine_ids(engine, prompt, **fields) -> list[int]:
    """The engine API's tokens for `prompt` (text, or ids) under `fields`, greedy unless they say otherwise."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **fields})
    return asyncio.run(engine_run(engine, prompt, params))[1]


# Each field as the SDK sends it (its own arguments, or vLLM's extras in the body) and as the engine takes it.
FIELDS = {
    "presence_penalty": ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    "frequency_penalty": ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
    "repetition_penalty": ({"extra_body": {"repetition_penalty": 2.0}}, {"repetition_penalty": 2.0}),
    "min_p": ({"temperature": 2.0, "seed": 11, "extra_body": {"min_p": 0.3}},
              {"temperature": 2.0, "seed": 11, "min_p": 0.3}),
    "logit_bias": ({"logit_bias": {"75": -100, "88": 8}}, {"logit_bias": {75: -100, 88: 8}}),
}
WITHOUT = {"min_p": {"temperature": 2.0, "seed": 11}}  # what each field is compared with unset


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_through_the_sdk_samples_as_the_engine_does(engine, client, model, name):
    sdk, fields = FIELDS[name]
    expected = engine_ids(engine, PROMPT, **fields)
    assert expected != engine_ids(engine, PROMPT, **WITHOUT.get(name, {})), "the field must change these tokens"
    sdk = {"temperature": 0, **sdk, "extra_body": {**sdk.get("extra_body", {}), "return_token_ids": True}}
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, **sdk)
    assert result.choices[0].model_extra["token_ids"] == expected
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, **sdk)
    assert [t for chunk in streamed for t in chunk.choices[0].model_extra["token_ids"]] == expected


def test_chat_takes_them_too(engine, client, model):
    fields = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"88": 6}}
    result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=MAX_TOKENS, temperature=0, **fields,
                                            extra_body={"repetition_penalty": 1.5, "return_token_ids": True})
    prompt = result.model_extra["prompt_token_ids"]
    expected = engine_ids(engine, prompt, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={88: 6},
                          repetition_penalty=1.5)
    assert result.choices[0].model_extra["token_ids"] == expected != engine_ids(engine, prompt)


async def test_mode_a_streaming_input_takes_them_over_the_cumulative_prompt(engine, server, model):
    fields = {"repetition_penalty": 2.0, "frequency_penalty": 1.0}
    params = SamplingParams(temperature=0.0, max_tokens=3, **fields)
    _, expected, _ = await engine_run(engine, CHUNKS, params, chunks=True)
    _, plain, _ = await engine_run(engine, CHUNKS, SamplingParams(temperature=0.0, max_tokens=3), chunks=True)
    assert expected != plain
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(ndjson_lines(model, CHUNKS, return_token_ids=True, **fields))) as response:
            events, _ = await read_sse(response)
    assert [t for _, event in events[:-1] for t in event["choices"][0]["token_ids"]] == expected


async def test_streaming_input_refuses_an_id_outside_the_vocabulary_naming_the_field(server, model):
    """Mode A's first line and a Mode B session's params check logit_bias ids against the vocabulary as the one-shot
    routes do (the engine refused the session later, with no `param`)."""
    bias = {"logit_bias": {"256": 1}}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/streaming_input/sessions", "http"), json={
                "model": model, "modality": "text", "params": {"max_tokens": 3, **bias}}) as response:
            answer = await response.json()
        assert (response.status, answer["error"]["param"]) == (422, "params.logit_bias"), answer
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(ndjson_lines(model, CHUNKS, **bias))) as response:
            answer = await response.json()
        assert (response.status, answer["error"]["param"]) == (400, "logit_bias"), answer


@pytest.mark.parametrize("extra, param, words", [
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
    ({"repetition_penalty": "x"}, "repetition_penalty", "repetition_penalty must be a number"),
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"w5": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"5.0": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"256": 1}}, "logit_bias", "outside the vocabulary [0, 256): [256]"),
    ({"logit_bias": [5]}, "logit_bias", "logit_bias must map token ids to biases"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "logit_bias takes at most 300 token ids"),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_out_of_range_values_are_400s_naming_the_field(client, model, route, extra, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5"}], max_tokens=2,
                                           extra_body=extra)
        else:
            client.completions.create(model=model, prompt="w5", max_tokens=2, extra_body=extra)
    body = raised.value.body
    assert (body["code"], body["param"]) == ("invalid_request", param) and words in body["message"], body


def test_neutral_values_and_nulls_are_served(client, model, engine):
    neutral = {"presence_penalty": 0, "frequency_penalty": None, "repetition_penalty": 1, "min_p": 0,
               "logit_bias": {}, "return_token_ids": True}
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=neutral)
    assert result.choices[0].model_extra["token_ids"] == engine_ids(engine, PROMPT)


def test_min_p_and_repetition_penalty_left_out_take_the_checkpoints_defaults():
    """vLLM's `get_diff_sampling_param`: the generation config's repetition_penalty and min_p, as its temperature,
    top_p and top_k, are what a request that leaves them out (or sends null) samples with."""
    defaults = SamplingParams(temperature=0.6, repetition_penalty=1.1, min_p=0.05)
    taken = sampling_params({"repetition_penalty": None}, defaults)
    assert (taken.temperature, taken.repetition_penalty, taken.min_p) == (0.6, 1.1, 0.05)
    given = sampling_params({"repetition_penalty": 1.0, "min_p": 0}, defaults)
    assert (given.repetition_penalty, given.min_p) == (1.0, 0.0)
