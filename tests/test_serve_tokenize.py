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
        # vLLM's decode keeps special tokens (it was "w5 w17 w40 w9").
        eos = reference.token_to_id("</s>")
        status, text = await call(http, server, "POST", "/detokenize", json={"model": model,
                                                                            "tokens": [*body["tokens"], eos]})
        assert status == 200 and text == {"prompt": "<s> w5 w17 w40 w9 </s>"}
        assert text["prompt"] == reference.decode([*body["tokens"], eos], skip_special_tokens=False)
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == body["tokens"]
    assert completion.usage.prompt_tokens == body["count"]


async def test_every_text_route_starts_a_prompt_with_the_tokenizers_prompt_prefix(engine, server, reference,
                                                                                 monkeypatch):
    """A tokenizer whose post-processor adds no BOS (Qwen's) gets none on /tokenize, a completion or a chat with
    `add_special_tokens` (each put the checkpoint's declared BOS first)."""
    monkeypatch.setattr(engine.tokenizer, "_prompt_prefix", ())  # noqa: SLF001 - what a ByteLevel post-processor gives
    ids = reference.encode(PROMPT).ids
    chat_server = ServerThread(engine, ServerConfig(chat_template=TEMPLATE))
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await call(http, server, "POST", "/tokenize", json={"prompt": PROMPT})
            assert status == 200 and body["tokens"] == ids
            status, chat = await call(http, chat_server, "POST", "/tokenize", json={"messages": MESSAGES})
            status, special = await call(http, chat_server, "POST", "/tokenize",
                                         json={"messages": MESSAGES, "add_special_tokens": True})
            assert status == 200 and special["tokens"] == chat["tokens"]
    finally:
        chat_server.close()
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0)
    completion = client.completions.create(model=server.state.model_id, prompt=PROMPT, max_tokens=1, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == ids


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


# A template that loops over each message's content parts (vLLM's content format "openai").
PARTS_TEMPLATE = ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }} {% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}w9{% endif %}")


async def test_a_template_that_loops_over_the_content_gets_its_parts(engine, reference):
    """As vLLM gives it, a template that loops over a message's content takes the list of text parts (a string content
    is one part; a refusal part is text); it got the parts' texts joined into a string and rendered none of them.
    Chats and /tokenize render alike, `continue_final_message` continuing the last text part."""
    chat_server = ServerThread(engine, ServerConfig(chat_template=PARTS_TEMPLATE))
    answer = [{"type": "text", "text": "w41"}, {"type": "refusal", "refusal": "w42"}]
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await call(http, chat_server, "POST", "/tokenize", json={"messages": MESSAGES})
            assert status == 200 and body["tokens"] == reference.encode("w5 w17 w40 w9").ids
            status, continued = await call(http, chat_server, "POST", "/tokenize", json={
                "messages": [*MESSAGES, {"role": "assistant", "content": answer}], "add_generation_prompt": False,
                "continue_final_message": True})
            assert status == 200 and continued["tokens"] == reference.encode("w5 w17 w40 w41 w42").ids
            image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
            status, refused = await call(http, chat_server, "POST", "/tokenize", json={
                "messages": [{"role": "user", "content": [answer[0], image]}]})
            assert (status, refused["error"]["param"]) == (400, "messages[0].content[1]")
        client = openai.OpenAI(base_url=chat_server.url("/v1", "http"), api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=chat_server.state.model_id, messages=MESSAGES, max_tokens=1,
                                              extra_body={"return_token_ids": True})
        assert chat.model_extra["prompt_token_ids"] == body["tokens"]
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
