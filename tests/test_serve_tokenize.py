"""vLLM's `/tokenize` and `/detokenize`, and `max_model_len` in `/v1/models`, on a server over the tiny Llama with
a word-level tokenizer.json. The oracle is the `tokenizers` library reading the same file, and a completion's
`return_token_ids`."""
from pathlib import Path

import aiohttp
import openai
import pytest
from tokenizers import Tokenizer

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import ServerThread
from test_serve_http import call
from serve_fixtures import server  # noqa: F401 - a pytest fixture over this module's engine
from test_serve_http_completions import TEMPLATE, engine  # noqa: F401 - a pytest fixture

pytestmark = pytest.mark.slow
PROMPT = "w5 w17 w40 w9"


@pytest.fixture(scope="module")
def reference(engine):
    """The checkpoint's tokenizer.json, read by Hugging Face's `tokenizers`."""
    return Tokenizer.from_file(str(Path(engine.model_name) / "tokenizer.json"))


async def test_tokenize_counts_the_prompt_a_completion_takes(engine, server, reference):
    model = server.state.model_id
    bos = reference.token_to_id("<s>")
    async with aiohttp.ClientSession() as http:
        status, body = await call(http, server, "POST", "/tokenize", json={"model": model, "prompt": PROMPT})
        assert status == 200
        assert body == {"count": 5, "max_model_len": engine.max_model_len,
                        "tokens": [bos, *reference.encode(PROMPT).ids], "token_strs": None}
        status, plain = await call(http, server, "POST", "/tokenize", json={
            "prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
        assert status == 200 and plain["tokens"] == reference.encode(PROMPT).ids
        assert plain["token_strs"] == ["w5", "w17", "w40", "w9"]
        status, special = await call(http, server, "POST", "/tokenize",
                                     json={"prompt": "w5", "return_token_strs": True})
        assert status == 200 and special["token_strs"] == ["<s>", "w5"]  # a special token by its name, as vLLM's
        status, text = await call(http, server, "POST", "/detokenize", json={"model": model, "tokens": body["tokens"]})
        assert status == 200 and text == {"prompt": reference.decode(body["tokens"])}
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == body["tokens"]
    assert completion.usage.prompt_tokens == body["count"]


MESSAGES = [{"role": "system", "content": "w5 w17"}, {"role": "user", "content": [{"type": "text", "text": "w40"}]}]


async def test_tokenize_messages_counts_the_prompt_a_chat_takes(engine, server, reference):
    """vLLM's TokenizeChatRequest: the messages rendered with the served chat template and tokenized without a BOS
    (`add_special_tokens` false by default), as /v1/chat/completions gives them to the engine."""
    chat_server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    try:
        model = chat_server.state.model_id
        async with aiohttp.ClientSession() as http:
            status, body = await call(http, chat_server, "POST", "/tokenize", json={"model": model,
                                                                                    "messages": MESSAGES})
            assert status == 200 and body["tokens"] == reference.encode("w5 w17 w40 w9").ids
            assert body["count"] == 4 and body["max_model_len"] == engine.max_model_len
            status, plain = await call(http, chat_server, "POST", "/tokenize", json={
                "messages": MESSAGES, "add_generation_prompt": False, "add_special_tokens": True})
            assert plain["tokens"] == [reference.token_to_id("<s>"), *reference.encode("w5 w17 w40").ids]
            status, refused = await call(http, server, "POST", "/tokenize", json={"messages": MESSAGES})
            assert status == 400 and "must provide a chat template" in refused["error"]["message"]
            status, refused = await call(http, chat_server, "POST", "/tokenize", json={
                "messages": MESSAGES, "continue_final_message": True})
            assert (status, refused["error"]["param"]) == (400, "continue_final_message")
        client = openai.OpenAI(base_url=chat_server.url("/v1", "http"), api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                              extra_body={"return_token_ids": True})
        assert chat.model_extra["prompt_token_ids"] == body["tokens"] and chat.usage.prompt_tokens == body["count"]
    finally:
        chat_server.close()


async def test_a_lone_surrogate_in_a_chat_is_a_400(engine):
    """The chat template renders it, then the tokenizer refused it with a TypeError: a 500 on both routes."""
    chat_server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    messages = [{"role": "user", "content": "w5 \ud800"}]
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/tokenize", "/v1/chat/completions"):
                status, answer = await call(http, chat_server, "POST", path, json={"messages": messages})
                assert status == 400 and "lone UTF-16 surrogate (U+D800)" in answer["error"]["message"], answer
    finally:
        chat_server.close()


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "w5", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "w5", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [5, 256]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": "w5"}, 400, "tokens"),
    # A lone surrogate (JSON's "\ud800"): no Unicode character, which the tokenizer refused with a TypeError, a 500.
    ("/tokenize", {"prompt": "w5 \ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w5 \ud800", "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w5 \ud800", "max_tokens": 2, "stream": True}, 400, "prompt"),
])
async def test_bad_bodies_are_openai_shaped_errors(server, path, body, status, param):
    async with aiohttp.ClientSession() as http:
        got, answer = await call(http, server, "POST", path, json=body)
    assert got == status and answer["error"]["param"] == param, answer


def test_models_lists_max_model_len(engine, server):
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    [listed] = client.models.list().data
    assert listed.id == server.state.model_id and listed.max_model_len == engine.max_model_len > 0
    assert client.models.retrieve(listed.id).max_model_len == engine.max_model_len
