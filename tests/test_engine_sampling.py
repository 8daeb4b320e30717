"""On-device sampling against a numpy statement of vLLM's filters (temperature, top-k then top-p); the
engine's seeded tokens against `sampling.sample` applied to logits of an offline forward pass; and the
validation that keeps one request's parameters from failing the batch it is dispatched with."""
import asyncio
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxstream.engine import sampling
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams
from jaxstream.errors import InvalidRequestError
from jaxstream.models import TextLM, config_from_hf, contiguous_page_table, init_kv_cache, load_hf_weights


def numpy_filter(logits, temperature, top_k, top_p):
    """The set of tokens vLLM may sample and their probabilities, in float64."""
    scaled = logits.astype(np.float64) / max(temperature, 1e-6)
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.shape, bool)
    k = scaled.size if top_k <= 0 else min(top_k, scaled.size)
    kept = order[:k]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep[kept[(mass_before < top_p) | (np.arange(k) == 0)]] = True
    out = np.where(keep, scaled, -np.inf)
    p = np.exp(out - out.max())
    return keep, p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.8), (2.0, 1, 1.0), (1.0, 50, 0.05),
])
def test_filtered_logits_match_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(top_k)
    logits = rng.standard_normal((3, 40)).astype(np.float32) * 3
    got = np.asarray(sampling.filtered_logits(logits, np.full(3, temperature, np.float32),
                                              np.full(3, top_k, np.int32), np.full(3, top_p, np.float32)))
    for row in range(3):
        keep, _ = numpy_filter(logits[row], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), keep)
        np.testing.assert_allclose(got[row][keep], logits[row][keep] / temperature, rtol=1e-6)


def test_top_p_one_keeps_the_tail_where_the_float32_cumsum_saturates():
    """A 32k-vocabulary row's float32 cumsum reaches 1.0 hundreds of tokens before its end; top_p = 1 must
    still keep every token (vLLM skips the top-p filter), with or without top-k."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 32000)) * 3).astype(np.float32)
    probs = -jnp.sort(-jax.nn.softmax(logits, axis=-1), axis=-1)
    assert int((jnp.cumsum(probs, axis=-1) - probs >= 1.0).sum()) > 2  # the premise: mass_before saturates
    got = np.asarray(sampling.filtered_logits(logits, np.ones(2, np.float32), np.array([0, 20000], np.int32),
                                              np.ones(2, np.float32)))
    assert np.isfinite(got[0]).all()
    assert np.isfinite(got[1]).sum() == 20000


def test_banned_ids_are_never_sampled_and_keep_the_raw_logprobs():
    """min_tokens' bans (-1 pads): greedy and sampled rows take the best remaining id; the logprob is the raw
    logits' (vLLM's logprobs come before its logits processors)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    top = np.argsort(-logits, axis=-1)
    banned = np.full((4, sampling.MAX_BANNED_IDS), -1, np.int32)
    banned[:, :2] = top[:, :2]
    temperature = np.array([0.0, 0.0, 1.0, 1.0], np.float32)
    tokens, logprobs = sampling.sample(logits, temperature, np.array([0, 0, 1, 1], np.int32), np.ones(4, np.float32),
                                       np.arange(4, dtype=np.uint32), np.zeros(4, np.int32), banned)
    np.testing.assert_array_equal(np.asarray(tokens), top[:, 2])
    log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(logprobs), log_softmax[np.arange(4), top[:, 2]], rtol=1e-5)


def test_sampling_frequencies_follow_the_filtered_distribution():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(12).astype(np.float32)
    draws = 20000
    rows = np.broadcast_to(logits, (draws, 12))
    tokens, logprobs = jax.jit(sampling.sample)(
        rows, np.full(draws, 0.8, np.float32), np.full(draws, 6, np.int32), np.full(draws, 0.9, np.float32),
        np.full(draws, 42, np.uint32), np.arange(draws, dtype=np.int32))
    tokens = np.asarray(tokens)
    keep, probs = numpy_filter(logits, 0.8, 6, 0.9)
    assert keep[tokens].all()
    counts = np.bincount(tokens, minlength=12) / draws
    sigma = np.sqrt(probs * (1 - probs) / draws)
    assert np.all(np.abs(counts - probs) <= 5 * sigma + 1e-9)
    log_softmax = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    np.testing.assert_allclose(np.asarray(logprobs), log_softmax[tokens], rtol=1e-5, atol=1e-5)


def test_rows_are_independent_and_seeded():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    temperature = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    args = (np.zeros(4, np.int32), np.ones(4, np.float32), np.array([5, 9, 9, 1], np.uint32),
            np.array([3, 7, 7, 2], np.int32))
    first, _ = sampling.sample(logits, temperature, *args)
    first = np.asarray(first)
    assert first[0] == logits[0].argmax() and first[3] == logits[3].argmax()
    # Row 1 alone, batched with other rows, gives the same token (same seed and position).
    alone, _ = sampling.sample(logits[1:2], temperature[1:2], *(a[1:2] for a in args))
    assert int(np.asarray(alone)[0]) == first[1]
    # Rows 1 and 2 differ only in their logits: each follows its own row.
    swapped, _ = sampling.sample(logits[[2, 1]], temperature[[1, 2]], *(a[[1, 2]] for a in args))
    assert list(np.asarray(swapped)) == [first[2], first[1]]


# -- the engine's sampled tokens against `sampling.sample` on reference logits --------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "mistral_tiny"
ENGINE_CFG = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=64)
MASK32 = 0xFFFFFFFF
MAX_TOKENS = 8
MAX_CONTEXT = 32
SAMPLE = jax.jit(sampling.sample)


def tiny_mistral():
    cfg = config_from_hf(json.loads((FIXTURE / "config.json").read_text()))
    model = TextLM(cfg, rngs=nnx.Rngs(0))
    load_hf_weights(model, load_file(FIXTURE / "model.safetensors"))
    return model


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(tiny_mistral(), config=ENGINE_CFG)
    yield engine
    engine.close()


def offline_logits(model, max_context: int):
    """context -> [len, V] logits of one offline forward of `model` over the whole context (no paging, no engine);
    one compiled shape: contexts are padded to `max_context`."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    table, num_pages = contiguous_page_table(1, cfg.attention_window, cfg.attention_window)

    @jax.jit
    def forward(state, ids, num_new):
        cache = init_kv_cache(cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.attention_window, cfg.head_dim)
        logits, _ = nnx.merge(graphdef, state)(ids, cache, jnp.asarray(table), jnp.zeros(1, jnp.int32), num_new)
        return logits[0]

    def logits(context):
        ids = np.zeros((1, max_context), np.int32)
        ids[0, :len(context)] = context
        return np.asarray(forward(state, ids, np.array([len(context)], np.int32)))[:len(context)]

    return logits


@pytest.fixture(scope="module")
def reference_logits():
    return offline_logits(tiny_mistral(), MAX_CONTEXT)


def expected_tokens(reference_logits, prompt, tokens, params):
    """What `sampling.sample` draws at each position of the run, given the run's own earlier tokens; the
    engine samples position p (the index the token takes) with seed & 0xFFFFFFFF and key position p."""
    logits = reference_logits(prompt + tokens[:-1])
    positions = np.arange(len(prompt), len(prompt) + len(tokens), dtype=np.int32)
    rows = len(tokens)
    drawn, _ = SAMPLE(logits[positions - 1], np.full(rows, params.temperature, np.float32),
                      np.full(rows, params.top_k, np.int32), np.full(rows, params.top_p, np.float32),
                      np.full(rows, params.seed & MASK32, np.uint32), positions)
    return np.asarray(drawn).tolist()


async def run_request(engine, prompt, params, request_id):
    outputs = [out async for out in engine.generate(prompt, params, request_id=request_id)]
    return [t for out in outputs for t in out.outputs[0].token_ids]


# (temperature, top_k, top_p): plain, top-k, top-p, both
FILTERS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.7), (0.9, 20, 0.9)]


async def test_engine_samples_what_sampling_gives_on_reference_logits(engine, reference_logits):
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    requests = {}  # every filter with two seeds over the same prompt, all batched together
    for i, (temperature, top_k, top_p) in enumerate(FILTERS):
        prompt = rng.integers(3, vocab, 5 + 3 * i).tolist()  # prompts up to 14: prefill over two chunks
        for seed in (17 + i, 2**40 + 5 * i):
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                    max_tokens=MAX_TOKENS)
            requests[f"f{i}-s{seed}"] = (prompt, params)
    results = await asyncio.gather(*(run_request(engine, prompt, params, rid)
                                     for rid, (prompt, params) in requests.items()))
    for (prompt, params), tokens in zip(requests.values(), results):
        assert len(tokens) == MAX_TOKENS
        assert tokens == expected_tokens(reference_logits, prompt, tokens, params), params
    for i in range(len(FILTERS)):
        assert results[2 * i] != results[2 * i + 1]  # the seed matters
    await engine.wait_until_idle()
    assert engine.core.at_baseline()


async def test_extreme_valid_params_leave_their_batch_alone(engine, reference_logits):
    extreme = SamplingParams(temperature=1e30, top_k=2**31 - 1, top_p=1e-30, seed=2**64 - 1,
                             max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0, stop_token_ids=[2**31 - 1])
    normal = [SamplingParams(temperature=0.8, top_k=10, seed=seed, max_tokens=MAX_TOKENS) for seed in (1, 2, 3)]
    prompts = [[5, 9, 30, 41], [7, 7, 100], [250, 3, 3, 3, 8], [60, 61]]
    alone = [await run_request(engine, prompt, params, f"alone{i}")
             for i, (prompt, params) in enumerate(zip(prompts[1:], normal))]
    together = await asyncio.gather(*(run_request(engine, prompt, params, f"together{i}")
                                      for i, (prompt, params) in enumerate(zip(prompts, [extreme] + normal))))
    assert together[1:] == alone
    for prompt, params, tokens in zip(prompts, [extreme] + normal, together):
        assert tokens == expected_tokens(reference_logits, prompt, tokens, params)
    await engine.wait_until_idle()
    assert engine.core.at_baseline()


# -- SamplingParams validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=2**40), r"top_k must be in \[-1, 2147483647\], got 1099511627776"),
    (dict(top_k=-2), r"top_k must be in \[-1, "),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=1e39), "temperature must be finite"),  # inf in the float32 batch
    (dict(temperature="1"), "temperature must be a number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), "top_p must be finite"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed=-(2**63) - 1), "seed must be in"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(max_tokens=3.0), "max_tokens must be an integer"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must be <= max_tokens \(2\)"),
    (dict(logprobs=-1), r"logprobs must be in \[0, 20\]"),
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
    (dict(logprobs=False), "logprobs must be an integer"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids entry must be in"),
    (dict(stop_token_ids=[-1]), "stop_token_ids entry must be in"),
    (dict(stop_token_ids=[True]), "stop_token_ids entry must be an integer"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list of token ids"),
    (dict(stop=[1]), "stop must be a string or a list of strings"),
    (dict(n=0), r"n must be in \[1, 128\]"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be a bool"),
    (dict(output_kind="delta"), "output_kind must be a RequestOutputKind"),
])
def test_invalid_sampling_params_raise_at_construction(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        SamplingParams(**kwargs)
    assert caught.value.code == "invalid_request" and isinstance(caught.value, ValueError)


def test_sampling_params_keep_plain_python_values():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), seed=np.uint64(2**64 - 1),
                            stop="x", stop_token_ids=np.array([3, 4]), top_p=1, max_tokens=np.int32(9))
    assert (params.temperature, params.top_k, params.seed, params.top_p, params.max_tokens) == (
        0.5, 4, 2**64 - 1, 1.0, 9)
    assert params.stop == ("x",) and params.stop_token_ids == (3, 4)
    assert all(type(v) in (int, float) for v in (params.temperature, params.top_k, params.seed, params.top_p))
