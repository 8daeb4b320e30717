"""vLLM's `allowed_token_ids` and `bad_words` on /v1/completions and /v1/chat/completions (extra_body of the openai
SDK), over a random-weight Llama of the byte-level BPE vocabulary (tests/fixtures/byte_bpe), whose greedy text repeats
"llo". Oracles: the engine API's own answer for the same prompt ids and parameters (the engine's tests check it against
an offline forward), the allowed set and the banned text; refusals are 400s naming the field, in vLLM's words."""
import asyncio

import aiohttp
import openai
import pytest

from engine_fixtures import BYTE_BPE, byte_bpe_engine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams
from jaxstream.models.tokenizers import load_tokenizer
from jaxstream.serving.completion_fields import sampling_params
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import client  # noqa: F401 - the openai SDK over this module's server
from test_serve_http import read_sse
from test_serve_http_completions import TEMPLATE, engine_run, ndjson_lines

ALLOWED = [67, 88, 129, 165, 222, 262, 266, 288, 307]  # "a", "v", ..., " n", "tr", "llo", "dog"
VOCAB = 320
PROMPT = "the weather is"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BYTE_BPE)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = byte_bpe_engine(EngineConfig(max_sessions=4, page_size=16, batch_buckets=(4,), prefill_buckets=((4, 32),),
                                          max_num_batched_tokens=64, max_model_len=192), tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    yield server
    server.close()


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_id


@pytest.fixture(autouse=True)
def engine_returns_to_baseline(request):
    yield
    if "engine" in request.fixturenames:
        asyncio.run(wait_engine_baseline(request.getfixturevalue("engine")))


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **fields)


@pytest.mark.parametrize("extra", [{"allowed_token_ids": ALLOWED}, {"bad_words": ["llollo", "dog"]},
                                   {"allowed_token_ids": ALLOWED, "bad_words": ["llollo"]}])
def test_completions_answer_as_the_engine_under_the_fields(engine, client, model, extra):  # noqa: F811
    prompt_ids, tokens, text = asyncio.run(engine_run(engine, PROMPT, greedy(**extra)))
    request = dict(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    body = {**extra, "ignore_eos": True, "return_token_ids": True}
    choice = client.completions.create(**request, extra_body=body).choices[0]
    assert (choice.prompt_token_ids, choice.token_ids, choice.text) == (prompt_ids, tokens, text)
    assert "allowed_token_ids" not in extra or set(tokens) <= set(ALLOWED)
    assert "bad_words" not in extra or "llollo" not in text
    chunks = list(client.completions.create(**request, stream=True, extra_body=body))
    assert [t for c in chunks for t in c.choices[0].token_ids] == tokens
    # The same request without them writes what they keep out.
    free = client.completions.create(**request, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert not set(free.token_ids) <= set(ALLOWED) and "llollo" in free.text


def test_chat_completions_answer_as_the_engine_under_the_fields(engine, client, model):  # noqa: F811
    extra = {"allowed_token_ids": ALLOWED, "bad_words": ["llollo"]}
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=20,
                                            temperature=0, extra_body={**extra, "ignore_eos": True,
                                                                       "return_token_ids": True})
    prompt_ids, choice = answer.model_extra["prompt_token_ids"], answer.choices[0]
    _, tokens, text = asyncio.run(engine_run(engine, prompt_ids, greedy(**extra)))
    assert (choice.model_extra["token_ids"], choice.message.content) == (tokens, text)
    assert set(tokens) <= set(ALLOWED) and "llollo" not in text


async def test_streaming_input_takes_the_fields(engine, server, model):
    """Mode A (X-Streaming-Input on /v1/completions): every chunk of the session samples under them."""
    chunks = ["the weather", " is"]
    _, tokens, _ = await engine_run(engine, chunks, greedy(allowed_token_ids=ALLOWED), chunks=True)
    lines = ndjson_lines(model, chunks, allowed_token_ids=ALLOWED, ignore_eos=True, max_tokens=20,
                         return_token_ids=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(lines)) as response:
            events, _ = await read_sse(response)
    assert events[-1][1] == "[DONE]"
    streamed = [t for _, event in events[:-1] for t in event["choices"][0]["token_ids"]]
    assert streamed == tokens and set(streamed) <= set(ALLOWED)


@pytest.mark.parametrize("extra, param, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is not None and empty!"),
    ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!"),
    ({"allowed_token_ids": "1"}, "allowed_token_ids", "must be a list of token ids"),
    ({"bad_words": ["dog", ""]}, "bad_words", "bad_words cannot contain an empty string"),
    ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words", "Too many bad words after tokenization: 129."),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_invalid_fields_are_400s_naming_the_field(client, model, extra, param, message, route):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=extra)
        else:
            client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=extra)
    body = raised.value.body
    assert (body["code"], body["param"]) == ("invalid_request", param) and message in body["message"], body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_words_the_tokenizer_refuses_are_400s_before_any_stream(client, model, route, stream):  # noqa: F811
    """Refused by the server with the model's tokenizer, as vLLM's front end does: a 400 naming the field, streamed
    or not (the engine's own refusal came as an error event in a 200 stream)."""
    extra = {"bad_words": ["  "]}
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           stream=stream, extra_body=extra)
        else:
            client.completions.create(model=model, prompt="hi", max_tokens=2, stream=stream, extra_body=extra)
    body = raised.value.body
    assert (body["param"], body["message"]) == ("bad_words", "bad_words entries must tokenize to at least one token.")


@pytest.mark.parametrize("words, message", [
    (["  "], "bad_words entries must tokenize to at least one token."),
    (["\x01" * 600, "\x02" * 600], "Too many total bad word tokens: 1200. The max is 1024."),
])
def test_with_the_tokenizer_the_fields_refuse_what_the_engine_would(tokenizer, words, message):
    with pytest.raises(RequestError) as raised:
        sampling_params({"bad_words": words}, SamplingParams(), streaming=False, vocab_size=VOCAB,
                        tokenizer=tokenizer)
    assert (raised.value.status, raised.value.param, str(raised.value)) == (400, "bad_words", message)
