"""The engine over a real TextLM (the tiny Mistral fixture, sliding window 8): a plain request equals
transformers' greedy `generate`; a streamed session equals one offline forward over its final interleaved
context (conformance 24); tensor parallelism over 4 fake CPU devices gives the same tokens. The tiny Llama
(full attention over 256 positions) serves with a `max_model_len` below its window, and from a Hugging
Face directory whose only tokenizer is a tokenizer.json, stopping at the EOS ids its config declares."""
import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StreamingInput
from jaxstream.models import TextLM, config_from_hf, contiguous_page_table, init_kv_cache, load_hf_weights

FIXTURE = Path(__file__).parent / "fixtures" / "mistral_tiny"
LLAMA = FIXTURE.parent / "llama_tiny"
ENGINE_CFG = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=64)


def tiny_lm(directory=FIXTURE):
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    model = TextLM(cfg, rngs=nnx.Rngs(0))
    load_hf_weights(model, load_file(directory / "model.safetensors"))
    return model


def tiny_mistral():
    return tiny_lm(FIXTURE)


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURE.parent / "mistral_tiny_reference.npz"))


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(tiny_mistral(), config=ENGINE_CFG)
    yield engine
    engine.close()


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)


def random_chunks(seed, vocab):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, int(rng.integers(1, 12))).tolist(), int(rng.integers(1, 7)))
            for _ in range(int(rng.integers(4, 7)))]


async def stream_session(engine, chunks, request_id):
    """Runs a session whose chunks arrive whenever the previous one ended (and sometimes early)."""
    ended = asyncio.Queue()

    async def inputs():
        for i, (prompt, budget) in enumerate(chunks):
            if i and i % 2:
                await ended.get()
            yield StreamingInput(prompt, greedy(budget))

    per_chunk, current = [], ([], [])
    async for out in engine.generate(inputs(), request_id=request_id):
        current[0].extend(out.outputs[0].token_ids)
        current[1].extend(out.outputs[0].logprobs)
        if out.outputs[0].finish_reason:
            per_chunk.append(current)
            current = ([], [])
            ended.put_nowait(None)
    return per_chunk


async def test_plain_request_equals_transformers_generate(engine, reference):
    prompt = reference["prompt_ids"][0].tolist()
    expected = reference["generate"][0, len(prompt):].tolist()
    outputs = [out async for out in engine.generate(prompt, greedy(len(expected)), request_id="plain")]
    tokens = [t for out in outputs for t in out.outputs[0].token_ids]
    logprobs = np.array([lp for out in outputs for lp in out.outputs[0].logprobs])
    assert tokens == expected
    hf = reference["generate_logits"].astype(np.float64)
    hf_logprobs = hf - np.log(np.exp(hf - hf.max(-1, keepdims=True)).sum(-1, keepdims=True)) - hf.max(-1, keepdims=True)
    np.testing.assert_allclose(logprobs, hf_logprobs[np.arange(len(expected)), expected], atol=1e-4)


async def test_streamed_sessions_equal_offline_forward_over_final_context(engine):
    model_cfg = engine.model_config
    sessions = {f"s{i}": random_chunks(i, model_cfg.vocab_size) for i in range(3)}
    results = await asyncio.gather(*(stream_session(engine, chunks, rid) for rid, chunks in sessions.items()))

    model = tiny_mistral()
    for chunks, per_chunk in zip(sessions.values(), results):
        context, predicted = [], {}  # position -> (token, logprob) sampled from its logits
        for (prompt, budget), (tokens, logprobs) in zip(chunks, per_chunk):
            assert len(tokens) == budget
            context += prompt
            for j, (token, logprob) in enumerate(zip(tokens, logprobs)):
                predicted[len(context) - 1] = (token, logprob)
                if j < len(tokens) - 1:
                    context.append(token)
        window = model_cfg.attention_window
        table, num_pages = contiguous_page_table(1, window, window)
        cache = init_kv_cache(model_cfg.num_layers, num_pages, model_cfg.num_kv_heads, window, model_cfg.head_dim)
        logits, _ = model(jnp.asarray([context], jnp.int32), cache, jnp.asarray(table), jnp.zeros(1, jnp.int32),
                          jnp.asarray([len(context)], jnp.int32))
        log_softmax = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
        for position, (token, logprob) in predicted.items():
            assert int(np.argmax(log_softmax[position])) == token
            assert abs(log_softmax[position, token] - logprob) < 1e-4
    await engine.wait_until_idle()
    assert engine.core.at_baseline()


async def test_tensor_parallel_over_four_devices_gives_identical_tokens(engine):
    assert jax.device_count() >= 4
    mesh = jax.make_mesh((2, 2), ("data", "tp"))
    sharded = AsyncEngine(tiny_mistral(), config=EngineConfig(**{**ENGINE_CFG.__dict__, "mesh": mesh}))
    try:
        layer = sharded.core.programs.params["model"]["layers"][0]
        assert layer["self_attn"]["q_proj"]["kernel"][...].sharding.spec == P(None, "tp")
        assert layer["mlp"]["down_proj"]["kernel"][...].sharding.spec == P("tp", None)
        kv = sharded.core.cache.state["stacks"]["text"][0][0]
        assert kv.sharding.spec[1] == "tp"  # KV heads split over the tensor-parallel axis
        chunks = {f"t{i}": random_chunks(10 + i, engine.model_config.vocab_size) for i in range(3)}
        single = await asyncio.gather(*(stream_session(engine, c, rid) for rid, c in chunks.items()))
        multi = await asyncio.gather(*(stream_session(sharded, c, rid) for rid, c in chunks.items()))
    finally:
        await sharded.shutdown()
    assert [[tokens for tokens, _ in s] for s in single] == [[tokens for tokens, _ in s] for s in multi]


# -- the tiny Llama: max_model_len below the window; a tokenizer.json-only checkpoint ----------------------

LLAMA_CFG = EngineConfig(max_sessions=1, page_size=16, batch_buckets=(1,), prefill_buckets=((1, 8),),
                         max_num_batched_tokens=64)


async def greedy_tokens(engine, prompt, max_tokens, request_id):
    outputs = [out async for out in engine.generate(prompt, greedy(max_tokens), request_id=request_id)]
    return [t for out in outputs for t in out.outputs[0].token_ids], outputs


async def test_max_model_len_below_the_window_equals_transformers_generate():
    reference = dict(np.load(LLAMA.parent / "llama_tiny_reference.npz"))
    prompt = reference["prompt_ids"][0].tolist()
    expected = reference["generate"][0, len(prompt):].tolist()
    # 40 positions need 3 pages of 16 (a 48-position ring) where the model's window is 256.
    config = dataclasses.replace(LLAMA_CFG, max_model_len=40)
    window = config_from_hf(json.loads((LLAMA / "config.json").read_text())).attention_window
    assert len(prompt) + len(expected) < config.max_model_len < window
    async with AsyncEngine(tiny_lm(LLAMA), config=config) as engine:
        assert engine.core.cache.specs["text"].pages_per_window == 3
        tokens, _ = await greedy_tokens(engine, prompt, len(expected), "short")
    assert tokens == expected


def word_level_tokenizer(path: Path, vocab_size: int):
    """A tokenizer.json with one word per id ("w<id>"): ids 0, 1, 2 are the special <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))


# vLLM's SamplingParams.update_from_generation_config: the tokenizer's EOS (tokenizer_config.json's `eos_token`;
# without one, the first declared id) is the model's own and ends a request with stop_reason None; every other id
# generation_config.json declares becomes a stop token id, reported as stop_reason (Llama 3.1 instruct: tokenizer
# EOS 128009, declared [128001, 128008, 128009], a request ended at 128001 reports 128001).
@pytest.mark.parametrize("order, named, reported", [
    ("eos_then_stop", None, "stop"),  # the first declared id (2) is the model's own: `stop` is a secondary EOS
    ("stop_then_eos", None, None),  # `stop` declared first is the model's own
    # Llama 3.1: tokenizer_config.json names another EOS than the first declared id, and it is the model's own.
    ("eos_then_stop", "stop", None),
    ("stop_then_eos", "</s>", "stop"),
    # BLIP-2: the tokenizer's EOS is not among the declared ids, and vLLM stops at it all the same.
    ("eos_only", "stop", None),
], ids=["secondary", "first-declared", "tokenizer-named", "tokenizer-named-secondary", "tokenizer-named-undeclared"])
async def test_tokenizer_json_checkpoint_stops_at_the_declared_eos_ids(tmp_path, order, named, reported):
    from jaxstream.models.tokenizers import HFTokenizer

    reference = dict(np.load(LLAMA.parent / "llama_tiny_reference.npz"))
    prompt = reference["prompt_ids"][0].tolist()
    greedy_run = reference["generate"][0, len(prompt):].tolist()
    directory = tmp_path / "llama"
    shutil.copytree(LLAMA, directory)
    word_level_tokenizer(directory / "tokenizer.json", 256)
    # A list, as Llama 3 declares it, naming the run's third token; config.json names only 2.
    stop = greedy_run[2]
    assert 2 not in greedy_run[:3] and stop not in greedy_run[:2]
    declared = {"eos_then_stop": [2, stop], "stop_then_eos": [stop, 2], "eos_only": [2]}[order]
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": declared}))
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == 2
    if named:
        eos_token = f"w{stop}" if named == "stop" else named
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))

    async with AsyncEngine.from_pretrained(directory, config=LLAMA_CFG) as engine:
        assert isinstance(engine.tokenizer, HFTokenizer)
        assert engine.tokenizer.eos_id == declared[0]  # the loader still gives it the first declared id
        assert engine.core.eos_token_ids == {2, stop}
        tokens, outputs = await greedy_tokens(engine, prompt, 20, "eos")
        assert tokens == greedy_run[:3]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
        assert outputs[-1].outputs[0].stop_reason == (stop if reported == "stop" else None)
        # The text continues the prompt's (vLLM's detokenizer is primed with it): " w<id>" each, but for the EOS
        # token's: vLLM's detokenizer leaves out the text of the token that stopped the request.
        assert "".join(out.outputs[0].text for out in outputs) == "".join(f" w{t}" for t in tokens[:-1])
        text_prompt = [out async for out in engine.generate("w5 w17", greedy(1), request_id="text")]
        assert text_prompt[-1].prompt_token_ids == [1, 5, 17]  # BOS from config.json, then the words


def metaspace_tokenizer(path: Path, vocab_size: int):
    """`word_level_tokenizer` as Llama-2 / Mistral spell it: Metaspace pieces ("\u2581w<id>") and a decoder whose
    Strip drops the space of a text's first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1, right=0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))


@pytest.mark.parametrize("make_tokenizer", [metaspace_tokenizer, word_level_tokenizer], ids=["metaspace", "word"])
async def test_engine_text_continues_the_prompt(tmp_path, make_tokenizer):
    """vLLM's detokenizer starts after the prompt: prompt text + engine text == decode(prompt + outputs) (with a
    Metaspace + Strip decoder the first word lost its space). A later chunk leaves the detokenizer as it is, as
    in vLLM: a session's text continues its first prompt and every output, in order."""
    directory = tmp_path / "llama"
    shutil.copytree(LLAMA, directory)
    make_tokenizer(directory / "tokenizer.json", 256)
    async with AsyncEngine.from_pretrained(directory, config=LLAMA_CFG) as engine:
        tokenizer = engine.tokenizer
        for prompt in ("w5 w17", [1, 5, 17], [5]):
            outputs = [out async for out in engine.generate(prompt, greedy(5))]
            ids = outputs[-1].prompt_token_ids + [t for out in outputs for t in out.outputs[0].token_ids]
            text = "".join(out.outputs[0].text for out in outputs)
            assert tokenizer.decode(outputs[-1].prompt_token_ids) + text == tokenizer.decode(ids) and text[0] == " "

        async def chunks():
            for chunk in ([1, 5, 17], [9], [33, 4]):
                yield StreamingInput(chunk, greedy(3))

        outputs = [out async for out in engine.generate(chunks(), greedy(3))]
        generated = [t for out in outputs for t in out.outputs[0].token_ids]
        text = "".join(out.outputs[0].text for out in outputs)
        assert tokenizer.decode([1, 5, 17]) + text == tokenizer.decode([1, 5, 17] + generated)


async def test_top_logprobs_are_transformers_most_likely_tokens(engine, reference):
    """`logprobs=N` (vLLM's): each generated token comes with the N most likely ids of its step and their
    logprobs, most likely first, equal to those of transformers' logits; the sampled one's stays in `logprobs`."""
    prompt = reference["prompt_ids"][0].tolist()
    expected = reference["generate"][0, len(prompt):].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(expected), logprobs=5)
    outputs = [out async for out in engine.generate(prompt, params)]
    tops = [top for out in outputs for top in out.outputs[0].top_logprobs]
    hf = reference["generate_logits"].astype(np.float64)
    hf_logprobs = hf - hf.max(-1, keepdims=True)
    hf_logprobs -= np.log(np.exp(hf_logprobs).sum(-1, keepdims=True))
    assert len(tops) == len(expected)
    for step, top in enumerate(tops):
        order = np.argsort(-hf_logprobs[step], kind="stable")[:5]
        assert list(top) == order.tolist() and list(top)[0] == expected[step]
        np.testing.assert_allclose(list(top.values()), hf_logprobs[step, order], atol=1e-4)
    plain = [out async for out in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))]
    assert all(out.outputs[0].top_logprobs is None for out in plain)
