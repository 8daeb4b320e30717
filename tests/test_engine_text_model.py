"""The engine over a real TextLM (the tiny Mistral fixture, sliding window 8): a plain request equals
transformers' greedy `generate`; a streamed session equals one offline forward over its final interleaved
context (conformance 24); tensor parallelism over 4 fake CPU devices gives the same tokens."""
import asyncio
import json
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
ENGINE_CFG = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=64)


def tiny_mistral():
    cfg = config_from_hf(json.loads((FIXTURE / "config.json").read_text()))
    model = TextLM(cfg, rngs=nnx.Rngs(0))
    load_hf_weights(model, load_file(FIXTURE / "model.safetensors"))
    return model


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
