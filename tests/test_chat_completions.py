"""Chat templates (models/chat_templates.py) and OpenAI's `/v1/chat/completions` (serving/http_chat.py).

The oracle for templates is transformers' `apply_chat_template`: tests/make_chat_fixtures.py rendered and tokenized
real templates (Llama 3, Llama 3.1, Mistral v0.3, a list of named ones, a chat_template.jinja file) with it into
tests/fixtures/chat/cases.json, and jaxstream must give the same text and ids from a checkpoint laid out the same
way. A tekken tokenizer's chats are mistral-common's own encoding. The route is driven with the openai SDK and raw
aiohttp against the tiny Llama with the fixtures' tokenizer and the Llama 3.1 template: its greedy answer is the
one `/v1/completions` gives for the rendered prompt's ids, which are transformers' ids (no second BOS)."""
import asyncio
import datetime
import json
import logging
import shutil
from types import SimpleNamespace

import aiohttp
import numpy as np
import openai
import pytest

from jaxstream.engine.requests import SamplingParams
from jaxstream.errors import UserError
from jaxstream.models.chat_templates import ChatTemplateError, JinjaChatTemplate, load_chat_template
from jaxstream.models.tokenizers import load_tokenizer
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import ServerThread, shared_engine, wait_engine_baseline
from make_chat_fixtures import FIXTURES, TEMPLATES, checkpoint
from serve_fixtures import captured_server_configs, client, server  # noqa: F401 - pytest fixtures
from test_engine_text_model import LLAMA
from test_serve_http import call, read_sse
from test_serve_http_completions import engine_run, text_engine

CASES = json.loads((FIXTURES / "cases.json").read_text())["cases"]
BY_NAME = {case["name"]: case for case in CASES}
VOXTRAL_TEKKEN = FIXTURES.parent / "voxtral_tiny" / "tekken.json"
CHAT = "/v1/chat/completions"
FIXTURE_TEMPLATES = sorted(path.name for path in TEMPLATES.glob("*.jinja"))


def encode(tokenizer, case):
    return tokenizer.chat_template.encode(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                          continue_final_message=case["continue_final_message"],
                                          variables=case["kwargs"])


# -- templates: found and rendered as transformers does ---------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_templates_render_and_tokenize_as_transformers(tmp_path, case):
    tokenizer = load_tokenizer(checkpoint(tmp_path / "tokenizer", case))
    if "error" in case:  # the template's raise_exception, with its message
        with pytest.raises(ChatTemplateError) as raised:
            encode(tokenizer, case)
        assert str(raised.value) == case["error"]
    else:
        prompt = encode(tokenizer, case)
        assert (prompt.text, prompt.token_ids) == (case["text"], case["ids"])


def test_a_tokenizer_without_a_usable_template_has_none(tmp_path):
    """No template at all, or a list of named templates without a "default" (transformers then refuses to pick one
    and vLLM finds no template)."""
    directory = checkpoint(tmp_path / "named", BY_NAME["named_default"])
    assert load_tokenizer(directory).chat_template is not None
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [entry for entry in config["chat_template"] if entry["name"] != "default"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory).chat_template is None
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory).chat_template is None


def test_transformers_globals_and_sandbox():
    """strftime_now, a tojson that keeps HTML characters, the {% generation %} block, and the sandbox: a namespace
    takes no underscore-prefixed attribute, and a template cannot reach Python internals. A template that does not
    compile fails its chats, not the tokenizer's loading."""
    template = JinjaChatTemplate("{{ strftime_now('%Y-%m-%d') }}|{{ messages | tojson }}|{% generation %}"
                                 "{{ bos_token }}{% endgeneration %}", {"bos_token": "<s>"}, str.split)
    before = datetime.date.today().isoformat()
    text = template.render([{"role": "user", "content": "<b>&"}])
    day, rest = text.split("|", 1)
    assert day in (before, datetime.date.today().isoformat())
    assert rest == '[{"role": "user", "content": "<b>&"}]|<s>'
    for source in ("{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.__class__.__mro__ }}", "{% if %}"):
        with pytest.raises(ChatTemplateError):
            JinjaChatTemplate(source, {}, str.split).render([{"role": "user", "content": "x"}])


def test_a_tekken_tokenizer_encodes_chats_with_mistral_common():
    """As vLLM's --tokenizer-mode mistral: mistral-common's own encoding of the OpenAI messages, system prompt and
    continue_final_message (an assistant prefix) included; a jinja template given for it is not used."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    reference = MistralTokenizer.from_file(VOXTRAL_TEKKEN)
    tokenizer = load_tokenizer(VOXTRAL_TEKKEN)  # its vocabulary holds bytes 0..99: upper-case text
    chat = [{"role": "system", "content": "BE BRIEF."}, {"role": "user", "content": "HI 42"},
            {"role": "assistant", "content": "OK"}, {"role": "user", "content": "AGAIN?"}]
    for messages, continued in ((chat, False), (chat[:2] + [{"role": "assistant", "content": "OK "}], True)):
        expected = reference.encode_chat_completion(
            ChatCompletionRequest.from_openai(messages, continue_final_message=continued))
        prompt = tokenizer.chat_template.encode(messages, add_generation_prompt=not continued,
                                                continue_final_message=continued)
        assert prompt.token_ids == expected.tokens
        assert prompt.text == reference.decode(expected.tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    assert tokenizer.chat_template_for("{{ messages }}") is tokenizer.chat_template
    # Logprobs name a control token by its name, a text token by its text.
    assert [tokenizer.token_string(i) for i in (tokenizer.bos_id, *tokenizer.encode("B"))] == ["<s>", "B"]
    assert load_tokenizer(FIXTURES / "tokenizer.json").token_string(BY_NAME["llama3_user"]["ids"][0]) == \
        "<|begin_of_text|>"
    with pytest.raises(ChatTemplateError, match="start with a user message"):
        tokenizer.chat_template.encode([{"role": "assistant", "content": "OK"}])
    # mistral-common's tokenizer loads on the first chat (0.6 s for a full tekken file, on a server's event loop)
    # unless the server prepares the template first.
    fresh = load_tokenizer(VOXTRAL_TEKKEN).chat_template
    assert "_tokenizer" not in vars(fresh)
    fresh.prepare()
    assert "_tokenizer" in vars(fresh)
    # A lone surrogate (JSON's "\ud800"): tiktoken panicked, a BaseException past the template's error handling.
    with pytest.raises(ChatTemplateError, match=r"messages\[1\].content holds a lone UTF-16 surrogate \(U\+D800\)"):
        tokenizer.chat_template.encode([chat[0], {"role": "user", "content": "HI \ud800"}])


@pytest.mark.parametrize("source, content_format", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # Through a variable set from the messages, an attribute, a slice and a filter (Qwen2-VL's, Llama 3.2 Vision's).
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% if m.content is string %}{{ m.content }}"
     "{% else %}{% for p in m.content[1:] | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}"
     "{% endif %}{% endfor %}", "openai"),
    ("{% for p in content %}{{ p }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ("{% for %}", "string"),  # it does not parse: its chats fail with the syntax error
    *[((TEMPLATES / name).read_text(), "string") for name in FIXTURE_TEMPLATES],
], ids=["string", "parts", "set-slice-filter", "another-loop", "broken", *FIXTURE_TEMPLATES])
def test_a_template_that_loops_over_a_messages_content_takes_its_parts(source, content_format):
    """vLLM's `--chat-template-content-format auto`: the parts for a template that loops over a message's content,
    a string for any other (the fixtures' real templates)."""
    assert JinjaChatTemplate(source, {}, str.split).content_format == content_format


def test_chat_template_option_is_a_file_or_the_template(tmp_path):
    """vLLM's --chat-template: a path, else the template itself when it looks like one; a path that does not exist,
    or a template that does not compile, is a one-line mistake at start-up. The server TOML takes the key too."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ bos_token }}") == "{{ bos_token }}"
    with pytest.raises(UserError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    path.write_text("{% if %}")
    with pytest.raises(UserError, match="line 1"):
        load_chat_template(str(path))


@pytest.mark.parametrize("where", ["flag", "toml"])
def test_serve_reads_its_chat_template_at_start_up(monkeypatch, tmp_path, capsys, where):
    """`serve --chat-template PATH` or `[server] chat_template`: the server's config holds the file's template; a
    path that does not exist is a one-line mistake before anything loads."""
    from jaxstream.cli import main
    configs = captured_server_configs(monkeypatch)
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    toml = tmp_path / "s.toml"

    def serve(path) -> int:
        toml.write_text(f"[server]\nchat_template = {json.dumps(str(path))}\n" if where == "toml" else "")
        flags = ["--chat-template", str(path)] if where == "flag" else []
        return main(["serve", "--host", "127.0.0.1", "--port", "0", "--config", str(toml), *flags])

    level = logging.getLogger("jaxstream").level  # serve sets its own
    try:
        assert serve(template) == 2 and configs[0].chat_template == "{{ messages[0].content }}"
        capsys.readouterr()
        assert serve(tmp_path / "missing.jinja") == 2 and len(configs) == 1
    finally:
        logging.getLogger("jaxstream").setLevel(level)
    err = capsys.readouterr().err
    assert "looks like a file path, but there is no such file" in err and err.count("\n") == 1, err


def test_a_toml_chat_template_path_is_relative_to_the_toml(monkeypatch, tmp_path, capsys):
    """`[server] chat_template = "chat.jinja"` is the file beside the TOML (it was read from the working directory),
    `--chat-template chat.jinja` the one in the working directory, as vLLM's flag; a template given inline stays."""
    from jaxstream.cli import main
    configs = captured_server_configs(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "chat.jinja").write_text("{{ 'beside the toml' }}")
    (tmp_path / "chat.jinja").write_text("{{ 'in the working directory' }}")
    toml = tmp_path / "conf" / "s.toml"

    def served_template(value: str, *flags: str) -> str:
        toml.write_text(f"[server]\nchat_template = {json.dumps(value)}\n")
        assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--config", "conf/s.toml", *flags]) == 2
        return configs.pop().chat_template

    level = logging.getLogger("jaxstream").level  # serve sets its own
    try:
        assert served_template("chat.jinja") == "{{ 'beside the toml' }}"
        assert served_template("chat.jinja", "--chat-template", "chat.jinja") == "{{ 'in the working directory' }}"
        assert served_template("{{ messages }}") == "{{ messages }}"
        capsys.readouterr()
        assert main(["serve", "--port", "0", "--config", str(toml), "--chat-template", "missing.jinja"]) == 2
        toml.write_text('[server]\nchat_template = "missing.jinja"\n')
        assert main(["serve", "--port", "0", "--config", str(toml)]) == 2 and not configs
    finally:
        logging.getLogger("jaxstream").setLevel(level)
    err = capsys.readouterr().err.splitlines()
    assert "'missing.jinja' looks like a file path" in err[0] and str(tmp_path / "conf" / "missing.jinja") in err[1]


def test_a_chat_template_the_model_cannot_use_is_a_warning(caplog):
    """vLLM ignores --chat-template for a Mistral tokenizer with a warning that users missed; so does jaxstream, and
    for a model that serves no chat."""
    from jaxstream.commands.serve import log_chat_template

    config = ServerConfig(chat_template="{{ messages }}")
    engines = [SimpleNamespace(kind="text", tokenizer=load_tokenizer(VOXTRAL_TEKKEN), model_name="mistral"),
               SimpleNamespace(kind="realtime", tokenizer=None, model_name="tiny"),
               SimpleNamespace(kind="text", tokenizer=load_tokenizer(FIXTURES / "tokenizer.json"), model_name="llama")]
    with caplog.at_level(logging.WARNING, "jaxstream"):
        for engine in engines:
            log_chat_template(engine, config)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--chat-template is ignored"] * 2
    assert "mistral-common" in caplog.records[0].getMessage() and "tiny" in caplog.records[1].getMessage()


# -- the route ----------------------------------------------------------------------------------------------------
route = pytest.mark.slow  # a server over a text engine


@pytest.fixture(autouse=True)
async def engine_returns_to_baseline(request):
    """serve_fixtures' check, for the tests that use the engine (the template tests above build none)."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        await wait_engine_baseline(engine)
        assert engine.healthy


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny Llama with the fixtures' tokenizer and the Llama 3.1 template, its BOS the template's
    <|begin_of_text|> (so that a BOS the engine added would show as a second one)."""
    directory = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(LLAMA, directory)
    tokenizer = checkpoint(tmp_path_factory.mktemp("tokenizer") / "llama3_1", BY_NAME["llama3_1_user"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    bos = BY_NAME["llama3_1_user"]["ids"][0]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        (directory / name).write_text(json.dumps({**config, "bos_token_id": bos}))
    engine = text_engine(directory)
    assert engine.tokenizer.bos_id == bos
    yield engine
    engine.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@route
def test_sdk_chat_is_the_completion_of_the_rendered_prompt(engine, server, client):
    """The chat's prompt is transformers' ids for the conversation (one BOS: the template's), and its greedy answer
    is the engine's for those ids, plain and streamed (a role delta first, content deltas, the finish chunk, usage)."""
    case = BY_NAME["llama3_1_system"]
    prompt_ids, tokens, text = asyncio.run(engine_run(engine, case["ids"], greedy(6)))
    assert prompt_ids == case["ids"] and prompt_ids.count(engine.tokenizer.bos_id) == 1 and text
    request = {"model": server.state.model_id, "messages": case["messages"], "max_tokens": 6, "temperature": 0,
               "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    result = client.chat.completions.create(**request)
    [choice] = result.choices
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "length")
    assert result.model_extra["prompt_token_ids"] == case["ids"] and choice.model_extra["token_ids"] == tokens
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(case["ids"]), 6)
    completion = client.completions.create(model=server.state.model_id, prompt=case["ids"], max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == text
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[0].model_extra["prompt_token_ids"] == case["ids"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
    assert [t for c in chunks[:-1] for t in c.choices[0].model_extra.get("token_ids") or []] == tokens
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1


@route
async def test_streamed_chat_ends_with_done(server):
    body = {"model": server.state.model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
            "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url(CHAT, "http"), json=body) as response:
            events, _ = await read_sse(response)
    assert response.status == 200 and events[-1][1] == "[DONE]"
    assert events[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@route
@pytest.mark.parametrize("case_name, fields", [
    ("llama3_1_continue", {"add_generation_prompt": False, "continue_final_message": True}),
    ("llama3_1_date_kwarg", {"chat_template_kwargs": {"date_string": "01 Jan 2025"}}),
    ("llama3_1_developer", {}),
])
def test_prompt_options_reach_the_template(server, client, case_name, fields):
    case = BY_NAME[case_name]
    result = client.chat.completions.create(model=server.state.model_id, messages=case["messages"], max_tokens=1,
                                            extra_body={**fields, "return_token_ids": True})
    assert result.model_extra["prompt_token_ids"] == case["ids"]
    # vLLM's role: without a generation prompt the answer continues the last message, in its role.
    role = case["messages"][-1]["role"] if fields.get("add_generation_prompt") is False else "assistant"
    assert result.choices[0].message.role == role
    streamed = client.chat.completions.create(model=server.state.model_id, messages=case["messages"], max_tokens=1,
                                              extra_body=fields, stream=True)
    assert next(iter(streamed)).choices[0].delta.role == role


@route
def test_n_choices_are_the_engines_children(engine, server, client):
    """`n` (was refused): choice i is the engine's completion of the rendered prompt with seed + i; a stream opens
    each choice with its role delta and ends each with its finish chunk."""
    case = BY_NAME["llama3_1_user"]
    expected = [asyncio.run(engine_run(engine, case["ids"], SamplingParams(temperature=1.0, seed=3 + i, max_tokens=5,
                                                                           ignore_eos=True)))[2] for i in range(2)]
    request = {"model": server.state.model_id, "messages": case["messages"], "max_tokens": 5, "temperature": 1.0,
               "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    result = client.chat.completions.create(**request)
    assert [(c.index, c.message.role, c.message.content) for c in result.choices] == [
        (i, "assistant", text) for i, text in enumerate(expected)]
    assert result.usage.completion_tokens == 10 and result.usage.prompt_tokens == len(case["ids"])
    texts, roles, finished = ["", ""], [0, 0], [0, 0]
    for chunk in client.chat.completions.create(**request, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        finished[choice.index] += choice.finish_reason == "length"
    assert texts == expected and roles == [1, 1] and finished == [1, 1]


@route
def test_without_a_generation_prompt_the_answer_takes_the_last_messages_role(server, client):
    """vLLM's get_chat_request_role: the answer was always the assistant's, even continuing a user's message."""
    messages = BY_NAME["llama3_1_user"]["messages"]
    result = client.chat.completions.create(model=server.state.model_id, messages=messages, max_tokens=1,
                                            extra_body={"add_generation_prompt": False})
    assert messages[-1]["role"] == result.choices[0].message.role == "user"
    streamed = client.chat.completions.create(model=server.state.model_id, messages=messages, max_tokens=1,
                                              extra_body={"add_generation_prompt": False}, stream=True)
    assert next(iter(streamed)).choices[0].delta.role == "user"


@route
def test_text_parts_are_joined_and_add_special_tokens_puts_bos_first(engine, server, client):
    """vLLM joins a message's text parts with newlines; `add_special_tokens` (default false) adds the tokenizer's BOS
    before the template's."""
    def prompt(content, **extra):
        result = client.chat.completions.create(model=server.state.model_id, max_tokens=1, messages=[
            {"role": "user", "content": content}], extra_body={"return_token_ids": True, **extra})
        return result.model_extra["prompt_token_ids"]

    joined = prompt("w60\nw61")
    assert prompt([{"type": "text", "text": "w60"}, {"type": "text", "text": "w61"}]) == joined
    assert prompt("w60\nw61", add_special_tokens=True) == [engine.tokenizer.bos_id, *joined]


@route
def test_without_a_length_the_chat_may_run_to_the_end_of_the_context(engine, server, client):
    """vLLM's chat: no max_tokens and no max_completion_tokens is the rest of the context (completions' default is
    16); max_completion_tokens, OpenAI's newer name, wins over max_tokens."""
    case = BY_NAME["llama3_1_user"]
    request = {"model": server.state.model_id, "messages": case["messages"], "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    result = client.chat.completions.create(**request)
    assert result.usage.completion_tokens == engine.max_model_len - len(case["ids"])
    assert result.choices[0].finish_reason == "length"
    result = client.chat.completions.create(**request, max_tokens=5, max_completion_tokens=3)
    assert result.usage.completion_tokens == 3


@route
@pytest.mark.parametrize("case_name", ["named_default", "variables_documents"])
def test_a_server_chat_template_replaces_the_tokenizers(engine, case_name):
    """`serve --chat-template` (ServerConfig.chat_template): the server's template renders the chats, with vLLM's
    `documents` when the request gives them."""
    case = BY_NAME[case_name]
    server = ServerThread(engine, ServerConfig(chat_template=(TEMPLATES / f"{case['template']}.jinja").read_text()))
    try:
        client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
        result = client.chat.completions.create(model=server.state.model_id, messages=case["messages"], max_tokens=1,
                                                extra_body={"return_token_ids": True, **case["kwargs"]})
        assert result.model_extra["prompt_token_ids"] == case["ids"]
    finally:
        server.close()


# -- logprobs ------------------------------------------------------------------------------------------------------
def reference_logprobs():
    """transformers' greedy run of the tiny Llama (tests/make_reference_fixtures.py): prompt, generated ids, and the
    log-softmax of the logits of each generated step."""
    reference = np.load(LLAMA.parent / "llama_tiny_reference.npz")
    prompt = reference["prompt_ids"][0].tolist()
    logits = reference["generate_logits"].astype(np.float64)
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    return prompt, reference["generate"][0, len(prompt):].tolist(), logprobs


@route
def test_completion_logprobs_are_the_models(server, client):
    """`logprobs: N` on /v1/completions: OpenAI's legacy shape, each step's N most likely tokens being those of
    transformers' logits (the sampled one first, as vLLM), plain and streamed alike (each chunk its own tokens)."""
    prompt, expected, hf = reference_logprobs()
    request = {"model": server.state.model_id, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5,
               "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    logprobs = client.completions.create(**request).choices[0].logprobs
    assert [int(token.split(":")[1]) for token in logprobs.tokens] == expected[:4]
    np.testing.assert_allclose(logprobs.token_logprobs, hf[range(4), expected[:4]], atol=1e-4)
    for step, top in enumerate(logprobs.top_logprobs):
        order = np.argsort(-hf[step], kind="stable")[:5]
        assert [int(token.split(":")[1]) for token in top] == order.tolist()
        np.testing.assert_allclose(list(top.values()), hf[step, order], atol=1e-4)
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(4)]
    chunks = list(client.completions.create(**request, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [t for lp in streamed for t in lp.top_logprobs] == logprobs.top_logprobs


@route
def test_chat_logprobs_are_the_engines(engine, server, client):
    """`logprobs: true` + `top_logprobs: N` on chat: `logprobs.content`, each token's string (the tokenizer's),
    logprob and bytes and its step's N most likely tokens, as the engine API gives them; without top_logprobs, none
    of those (vLLM's default 0)."""
    case = BY_NAME["llama3_1_user"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    outputs = asyncio.run(_outputs(engine, case["ids"], params))
    tokens = [t for out in outputs for t in out.token_ids]
    sampled = [lp for out in outputs for lp in out.logprobs]
    tops = [top for out in outputs for top in out.top_logprobs]
    request = {"model": server.state.model_id, "messages": case["messages"], "max_tokens": 4, "temperature": 0,
               "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    content = client.chat.completions.create(**request).choices[0].logprobs.content
    tokenizer = engine.tokenizer
    assert [entry.token for entry in content] == [tokenizer.token_string(t) for t in tokens]
    assert [entry.bytes for entry in content] == [list(tokenizer.token_bytes(t)) for t in tokens]
    np.testing.assert_allclose([entry.logprob for entry in content], sampled, rtol=1e-6)
    for entry, top in zip(content, tops):
        assert [(e.token, e.logprob) for e in entry.top_logprobs] == [
            (tokenizer.token_string(i), pytest.approx(value)) for i, value in top.items()]
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].choices[0].logprobs is None  # the role's delta
    assert [e for c in chunks[1:] if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == content
    plain = client.chat.completions.create(**{**request, "top_logprobs": None}).choices[0].logprobs.content
    assert [e.token for e in plain] == [e.token for e in content] and all(e.top_logprobs == [] for e in plain)


async def _outputs(engine, prompt, params):
    return [out.outputs[0] async for out in engine.generate(prompt, params)]


@route
@pytest.mark.parametrize("path, fields, param, message", [
    ("/v1/completions", {"prompt": "w60", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "w60", "logprobs": True}, "logprobs", "integer"),
    (CHAT, {"messages": [{"role": "user", "content": "w60"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be an integer in [0, 20]"),
    (CHAT, {"messages": [{"role": "user", "content": "w60"}], "top_logprobs": 2}, "top_logprobs",
     "`logprobs` must be set to true"),
])
async def test_logprobs_beyond_twenty_are_400s_naming_the_field(server, path, fields, param, message):
    async with aiohttp.ClientSession() as http:
        status, answer = await call(http, server, "POST", path, json={"model": server.state.model_id, **fields})
    assert (status, answer["error"]["param"]) == (400, param) and message in answer["error"]["message"], answer


USER = [{"role": "user", "content": "Hello"}]


@route
@pytest.mark.parametrize("fields, code, param, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "invalid_request", "messages[0].content[0]", "Unsupported content part type 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]},
     "invalid_request", "messages[0].content[0]", "Unsupported content part type 'input_audio'"),
    ({"messages": []}, "invalid_request", "messages", "non-empty list"),
    ({"messages": [{"content": "x"}]}, "invalid_request", "messages[0]", "with a role"),
    ({"messages": USER, "continue_final_message": True}, "invalid_request", "continue_final_message",
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ({"messages": USER, "chat_template": "{{ messages }}"}, "invalid_request", "chat_template",
     "--trust-request-chat-template"),
    ({"messages": USER, "chat_template_kwargs": [1]}, "invalid_request", "chat_template_kwargs", "an object"),
    # Tools without --enable-auto-tool-choice: vLLM's words (tool_choice defaults to "auto" when tools are given).
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "invalid_request", "tool_choice",
     '"auto" tool choice requires'),
    ({"messages": USER, "tool_choice": "auto"}, "invalid_request", "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    ({"messages": USER, "response_format": {"type": "structural_tag", "format": {}}}, "unsupported_parameter",
     "response_format", ""),
    ({"messages": USER, "modalities": ["text", "audio"]}, "unsupported_parameter", "modalities", ""),
    ({"messages": USER, "max_completion_tokens": 0}, "invalid_request", "max_completion_tokens", "max_tokens"),
    ({"messages": USER, "n": 129}, "invalid_request", "n", "n must be in [1, 128]"),
    ({"messages": USER, "documents": [{"title": 1}]}, "invalid_request", "documents", "objects of strings"),
    ({"messages": [{"role": "user", "content": " ".join(["w60"] * 300)}]}, "context_length_exceeded", "messages",
     "maximum context length"),
])
async def test_bad_chats_are_openai_shaped_400s(server, fields, code, param, message):
    async with aiohttp.ClientSession() as http:
        status, answer = await call(http, server, "POST", CHAT, json={"model": server.state.model_id, **fields})
    error = answer["error"]
    assert (status, error["code"], error["param"], error["type"]) == (400, code, param, "invalid_request_error"), error
    assert message in error["message"]


@route
async def test_a_template_refusal_is_a_400_with_its_message(engine):
    """The Mistral template's raise_exception on a bad role order: vLLM's 400 with the template's message."""
    server = ServerThread(engine, ServerConfig(chat_template=(TEMPLATES / "mistral_v3.jinja").read_text()))
    try:
        async with aiohttp.ClientSession() as http:
            status, answer = await call(http, server, "POST", CHAT, json={
                "model": server.state.model_id, "messages": BY_NAME["mistral_bad_order"]["messages"]})
    finally:
        server.close()
    assert status == 400 and answer["error"]["message"] == BY_NAME["mistral_bad_order"]["error"]


@route
async def test_a_model_without_a_chat_template_answers_vllms_400(engine, server, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    async with aiohttp.ClientSession() as http:
        status, answer = await call(http, server, "POST", CHAT, json={"model": server.state.model_id,
                                                                      "messages": USER})
    assert status == 400 and answer["error"]["message"].startswith(
        "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template")
    assert "--chat-template" in answer["error"]["message"]


@route
async def test_streaming_input_is_refused_with_where_it_is_served(server):
    async with aiohttp.ClientSession() as http:
        status, answer = await call(http, server, "POST", CHAT, data=b'{"model": "x"}\n',
                                    headers={"X-Streaming-Input": "true"})
    assert status == 400 and "/v1/completions" in answer["error"]["message"]


@pytest.mark.slow
async def test_a_speech_model_refuses_chats_as_it_refuses_completions():
    server = ServerThread(shared_engine())
    try:
        async with aiohttp.ClientSession() as http:
            for path, body in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
                status, answer = await call(http, server, "POST", path, json={"model": server.state.model_id, **body})
                assert (status, answer["error"]["code"]) == (400, "unsupported_model"), answer
    finally:
        server.close()

