"""The sampling defaults a checkpoint's generation_config.json declares, applied as vLLM's `--generation-config auto`
applies them: read as the file's diff against transformers' defaults (`declared_sampling_defaults`), kept
by `convert`, exposed as `AsyncEngine.default_sampling_params()`, and taken by completions that omit (or null)
temperature, top_p or top_k, while a value the request gives wins. The oracle is the generation_config.json each
test writes, vLLM's rule, and the engine API sampling with the same values given explicitly (same seed, same
tokens)."""
import asyncio
import base64
import json
import logging
import shutil
from pathlib import Path

import aiohttp
import openai
import pytest

from jaxstream import cli
from jaxstream.commands import serve
from jaxstream.engine import builders
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StreamingInput
from jaxstream.errors import UserError
from jaxstream.models import loading
from jaxstream.models.checkpoint_metadata import ORBAX_METADATA, declared_sampling_defaults
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from test_engine_text_model import LLAMA, word_level_tokenizer
from test_serve_http import parse_sse

ENGINE_CFG = EngineConfig(max_sessions=4, page_size=16, batch_buckets=(4,), prefill_buckets=((4, 8),),
                          max_num_batched_tokens=64)
# Llama 3 Instruct's sampling values, a top_k of Qwen's kind, and a max_new_tokens that /v1/completions ignores.
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 8, "max_new_tokens": 5}
PROMPT = [5, 17, 40]


def checkpoint(directory: Path, **generation) -> Path:
    """The tiny Llama fixture copied to `directory`, its generation_config.json updated with `generation`."""
    shutil.copytree(LLAMA, directory)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return directory


def declared(tmp_path, **generation) -> dict:
    return declared_sampling_defaults(checkpoint(tmp_path / "model", **generation))


# -- what the loader reads ----------------------------------------------------------------------------------------
def test_the_defaults_are_the_files_diff_against_transformers_defaults(tmp_path):
    assert declared_sampling_defaults(LLAMA) == {}  # the fixture declares only BOS / EOS
    assert declared(tmp_path, **SAMPLING) == {"temperature": 0.6, "top_p": 0.9, "top_k": 8, "max_tokens": 5}


@pytest.mark.parametrize("generation, expected", [
    # transformers 4.x's defaults are left out of `to_diff_dict`: vLLM never applies them (top_k 50 included,
    # though vLLM's own top_k is 0); null is unset. What is left is taken, under vLLM's names.
    ({"temperature": 1.0, "top_p": 1, "top_k": 50, "repetition_penalty": 1.0, "min_p": None, "max_new_tokens": None},
     {}),
    ({"temperature": 0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1, "max_length": 4096},
     {"temperature": 0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1}),
])
def test_values_at_transformers_defaults_are_not_declared(tmp_path, generation, expected):
    assert declared(tmp_path, **generation) == expected


@pytest.mark.parametrize("key, value, message", [
    ("temperature", "0.6", "temperature must be a number >= 0, got '0.6'"),
    ("temperature", -0.5, "temperature must be a number >= 0, got -0.5"),
    ("top_p", 0, "top_p must be a number in (0, 1], got 0"),
    ("top_p", 1.5, "top_p must be a number in (0, 1], got 1.5"),
    ("top_k", 2.5, "top_k must be an integer in [-1, 2147483647], got 2.5"),
    ("top_k", True, "top_k must be an integer in [-1, 2147483647], got True"),
    ("min_p", 2, "min_p must be a number in [0, 1], got 2"),
    ("repetition_penalty", 0, "repetition_penalty must be a number > 0, got 0"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer in [1, 2147483647], got 0"),
])
def test_a_bad_value_is_a_one_line_error_naming_the_file_and_key(tmp_path, capsys, key, value, message):
    source = checkpoint(tmp_path / "model", **{key: value})
    with pytest.raises(UserError) as raised:
        declared_sampling_defaults(source)
    assert str(raised.value) == f"{source / 'generation_config.json'}: {message}"
    # `convert` reads the file before the weights, and says it in one line.
    assert cli.main(["convert", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_converted_checkpoint_keeps_them(tmp_path):
    source = checkpoint(tmp_path / "model", **SAMPLING, min_p=0.05)
    converted = tmp_path / "converted"
    assert cli.main(["convert", str(source), str(converted)]) == 0
    assert declared_sampling_defaults(converted) == declared_sampling_defaults(source) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 8, "min_p": 0.05, "max_tokens": 5}
    metadata_path = converted / ORBAX_METADATA
    metadata = json.loads(metadata_path.read_text())
    del metadata["sampling_defaults"]  # a checkpoint written before they were kept declares none
    metadata_path.write_text(json.dumps(metadata))
    assert declared_sampling_defaults(converted) == {}
    for damaged, message in (({"top_p": 2}, "sampling_defaults.top_p must be a number in (0, 1], got 2"),
                             ({"typical_p": 0.5}, "sampling_defaults must map some of")):
        metadata_path.write_text(json.dumps({**metadata, "sampling_defaults": damaged}))
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
            declared_sampling_defaults(converted)


# -- what the engine takes ----------------------------------------------------------------------------------------
def test_the_engines_defaults(tmp_path, caplog):
    """Every default vLLM takes from a checkpoint, min_p and repetition_penalty included (they were ignored with a
    warning before the engine sampled with them)."""
    source = checkpoint(tmp_path / "model", **SAMPLING, min_p=0.05, repetition_penalty=1.1)
    model = loading.load_model(source).model
    with caplog.at_level(logging.WARNING, logger="jaxstream.engine.builders"):
        params = builders.checkpoint_sampling_params(model, source)
    assert params == SamplingParams(temperature=0.6, top_p=0.9, top_k=8, max_tokens=5, min_p=0.05,
                                    repetition_penalty=1.1)
    assert not caplog.records
    # --generation-config vllm ignores the file.
    assert builders.checkpoint_sampling_params(model, source, "vllm") == SamplingParams()
    neutral = checkpoint(tmp_path / "neutral", temperature=0.7, min_p=0)
    assert builders.checkpoint_sampling_params(model, neutral) == SamplingParams(temperature=0.7)
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm"):
        builders.checkpoint_sampling_params(model, source, "path/to/dir")


# -- what completions take (a server over each of two engines: slow) ---------------------------------------------
def text_engine(directory) -> AsyncEngine:
    word_level_tokenizer(directory / "tokenizer.json", 256)
    return AsyncEngine.from_pretrained(directory, config=ENGINE_CFG)


@pytest.fixture(scope="module")
def sampling(tmp_path_factory):
    """A server over a checkpoint declaring SAMPLING."""
    engine = text_engine(checkpoint(tmp_path_factory.mktemp("sampling") / "model", **SAMPLING))
    server = ServerThread(engine)
    yield engine, server
    server.close()
    engine.close()


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """A server over a checkpoint declaring temperature 0: greedy unless a request says otherwise."""
    engine = text_engine(checkpoint(tmp_path_factory.mktemp("greedy") / "model", temperature=0.0))
    server = ServerThread(engine)
    yield engine, server
    server.close()
    engine.close()


async def engine_tokens(engine, prompt, params: SamplingParams) -> list[int]:
    """The engine API's tokens for `prompt` (a list of text chunks: streaming input, each chunk with `params`)."""
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        async def inputs(chunks):
            for chunk in chunks:
                yield StreamingInput(chunk, params)
        prompt = inputs(prompt)
    return [t async for out in engine.generate(prompt, params) for t in out.outputs[0].token_ids]


def completion_ids(server, **fields) -> list[int]:
    client = openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)
    extra = {"return_token_ids": True, "ignore_eos": True, **fields.pop("extra_body", {})}
    result = client.completions.create(model=server.state.model_id, prompt=PROMPT, extra_body=extra, **fields)
    return result.choices[0].token_ids


@pytest.mark.slow
def test_the_engine_exposes_the_checkpoints_defaults(sampling):
    engine, _ = sampling
    assert engine.default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, top_k=8, max_tokens=5)


@pytest.mark.slow
def test_omitted_or_null_fields_sample_as_the_declared_values_given(sampling):
    """A request that leaves temperature, top_p and top_k out (or sends null) samples as one giving the file's
    values: the engine API with them and the same seed gives the same tokens."""
    engine, server = sampling
    declared = SamplingParams(temperature=0.6, top_p=0.9, top_k=8, seed=7, max_tokens=8, ignore_eos=True)
    expected = asyncio.run(engine_tokens(engine, PROMPT, declared))
    assert completion_ids(server, max_tokens=8, seed=7) == expected
    assert completion_ids(server, max_tokens=8, seed=7, temperature=None, top_p=None,
                          extra_body={"top_k": None}) == expected
    asyncio.run(wait_engine_baseline(engine))


@pytest.mark.slow
def test_a_value_the_request_gives_wins(sampling):
    engine, server = sampling
    greedy_tokens = asyncio.run(engine_tokens(engine, PROMPT, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True)))
    assert completion_ids(server, max_tokens=6, temperature=0) == greedy_tokens
    # top_k 0 given (no top-k), temperature and top_p the file's.
    given = SamplingParams(temperature=0.6, top_p=0.9, top_k=0, seed=3, max_tokens=8, ignore_eos=True)
    assert completion_ids(server, max_tokens=8, seed=3, extra_body={"top_k": 0}) == asyncio.run(
        engine_tokens(engine, PROMPT, given))
    asyncio.run(wait_engine_baseline(engine))


@pytest.mark.slow
def test_max_new_tokens_does_not_change_a_completions_default_of_16(sampling):
    """vLLM's CompletionRequest turns an omitted (or null) max_tokens into 16 before any default applies: the
    file's max_new_tokens (5) caps only `generate` callers that take `default_sampling_params()`."""
    engine, server = sampling
    assert len(completion_ids(server)) == 16
    asyncio.run(wait_engine_baseline(engine))


@pytest.mark.slow
def test_the_startup_line_names_the_defaults_applied(sampling, greedy, caplog):
    with caplog.at_level(logging.INFO, logger="jaxstream.commands.serve"):
        serve.log_sampling_defaults(sampling[0])
        serve.log_sampling_defaults(greedy[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxstream.commands.serve"]
    assert len(lines) == 2 and "temperature=0.6, top_p=0.9, top_k=8" in lines[0] and "max_tokens" not in lines[0]
    assert "temperature=0.0" in lines[1] and "top_p" not in lines[1]


@pytest.mark.slow
def test_generate_without_sampling_params_samples_with_the_checkpoints_defaults(greedy):
    """`AsyncEngine.generate(prompt)` takes `default_sampling_params()`, as vLLM's `LLM.generate` does: a
    checkpoint declaring temperature 0 is greedy there too (it sampled at 1.0)."""
    engine, _ = greedy

    async def tokens(params):
        return [t async for out in engine.generate(PROMPT, params) for t in out.outputs[0].token_ids]

    expected = asyncio.run(tokens(SamplingParams(temperature=0)))
    assert len(expected) > 8 and asyncio.run(tokens(None)) == expected
    asyncio.run(wait_engine_baseline(engine))


@pytest.mark.slow
def test_a_declared_temperature_of_0_is_greedy_on_every_text_route(greedy):
    """One-shot, Mode A (NDJSON body) and Mode B (sessions) completions without a temperature give the engine's
    greedy tokens."""
    engine, server = greedy
    greedy_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert completion_ids(server, max_tokens=6) == asyncio.run(engine_tokens(engine, PROMPT, greedy_params))
    chunks = ["w5 w17", " w40 w9"]
    streamed = asyncio.run(engine_tokens(engine, chunks, greedy_params))
    assert asyncio.run(_mode_a_ids(server, chunks)) == streamed
    assert asyncio.run(_mode_b_ids(server, chunks)) == streamed
    asyncio.run(wait_engine_baseline(engine))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def _mode_a_ids(server, chunks) -> list[int]:
    head = {"model": server.state.model_id, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    lines = [head] + [{"modality": "text", "payload": _b64(c), "end_of_input": i == len(chunks) - 1}
                      for i, c in enumerate(chunks)]
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=b"".join(json.dumps(line).encode() + b"\n" for line in lines)) as response:
            events = parse_sse(await response.text())
    return [t for _, event in events[:-1] for t in event["choices"][0]["token_ids"]]


async def _mode_b_ids(server, chunks) -> list[int]:
    sessions = server.url("/v1/streaming_input/sessions", "http")
    async with aiohttp.ClientSession() as http:
        async with http.post(sessions, json={"model": server.state.model_id, "modality": "text",
                                             "params": {"max_tokens": 6, "ignore_eos": True}}) as response:
            session = f"{sessions}/{(await response.json())['session_id']}"
        for n, chunk in enumerate(chunks):
            async with http.post(f"{session}/chunks", json={"sequence_id": n, "modality": "text",
                                                            "payload": _b64(chunk),
                                                            "end_of_input": n == len(chunks) - 1}) as response:
                assert response.status in (200, 202), await response.text()
        async with http.get(f"{session}/result") as response:
            return (await response.json())["token_ids"]
