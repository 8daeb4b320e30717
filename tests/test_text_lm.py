"""TextLM (Mistral with a sliding window, Llama with tied embeddings, Qwen2 with q/k/v biases, Qwen3 with q/k
norms and biases) vs transformers fixtures, over shuffled paged rings: full-sequence logits, chunked prefill ==
one shot, greedy continuation == generate(); and how Hugging Face configs of these families parse."""
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxstream.models import CheckpointMismatchError, TextLM, config_from_hf, init_kv_cache, load_hf_weights

FIXTURES = Path(__file__).parent / "fixtures"
PAGE_SIZE = 4
CHUNK = 8


@pytest.fixture(scope="module", params=["mistral", "llama", "qwen2", "qwen3"])
def lm(request):
    name = request.param
    cfg = config_from_hf(json.loads((FIXTURES / f"{name}_tiny" / "config.json").read_text()))
    model = nnx.eval_shape(lambda: TextLM(cfg, rngs=nnx.Rngs(0)))  # no random init: the checkpoint fills it
    load_hf_weights(model, load_file(FIXTURES / f"{name}_tiny" / "model.safetensors"))
    graphdef, state = nnx.split(model)

    def forward(state, *args, **kwargs):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    ref = dict(np.load(FIXTURES / f"{name}_tiny_reference.npz"))
    return SimpleNamespace(name=name, cfg=cfg, graphdef=graphdef, state=state, ref=ref,
                           step=jax.jit(forward, donate_argnums=(2,)))


def fresh_ring(lm, num_sessions, rng):
    """A shuffled paged ring (page_size 4) covering the model's attention window."""
    pages_per_window = -(-lm.cfg.attention_window // PAGE_SIZE)
    pages = 1 + rng.permutation(num_sessions * pages_per_window).astype(np.int32)
    cache = init_kv_cache(lm.cfg.num_layers, 1 + pages.size, lm.cfg.num_kv_heads, PAGE_SIZE, lm.cfg.head_dim)
    return cache, jnp.asarray(pages.reshape(num_sessions, pages_per_window))


def one_shot(lm, ids, rng):
    cache, table = fresh_ring(lm, ids.shape[0], rng)
    zeros = jnp.zeros((ids.shape[0],), jnp.int32)
    logits, _ = lm.step(lm.state, jnp.asarray(ids), cache, table, zeros, zeros + ids.shape[1])
    return np.asarray(logits)


def test_logits_match_transformers(lm):
    ids = lm.ref["input_ids"]
    if lm.cfg.sliding_window:
        assert ids.shape[1] > 2 * lm.cfg.sliding_window  # the window must matter
    error = np.abs(one_shot(lm, ids, np.random.default_rng(0)) - lm.ref["logits"]).max()
    print(f"{lm.name}: max |logits - transformers| = {error:.2e}")
    assert error <= 1e-4


def test_chunked_prefill_matches_one_shot(lm):
    """Two sessions prefill the same ids in different random pieces (padding rows hold garbage ids)."""
    rng = np.random.default_rng(1)
    ids = lm.ref["input_ids"][0]
    total = ids.size
    reference = one_shot(lm, ids[None], rng)[0]
    cache, table = fresh_ring(lm, 2, rng)
    written = [0, 0]
    logits_rows = [[], []]
    while min(written) < total:
        num_new = [min(int(rng.integers(0, CHUNK + 1)), total - w) for w in written]
        chunk_ids = rng.integers(0, lm.cfg.vocab_size, (2, CHUNK)).astype(np.int32)
        for s, n in enumerate(num_new):
            chunk_ids[s, :n] = ids[written[s] : written[s] + n]
        logits, cache = lm.step(lm.state, jnp.asarray(chunk_ids), cache, table, jnp.asarray(written, jnp.int32),
                                jnp.asarray(num_new, jnp.int32))
        for s, n in enumerate(num_new):
            logits_rows[s].extend(np.asarray(logits[s, :n]))
            written[s] += n
    for rows in logits_rows:
        np.testing.assert_allclose(np.stack(rows), reference, atol=1e-5)


def test_greedy_continuation_matches_generate(lm):
    rng = np.random.default_rng(2)
    prompt = lm.ref["prompt_ids"]
    expected = lm.ref["generate"][0, prompt.shape[1]:]
    cache, table = fresh_ring(lm, 1, rng)
    logits, cache = lm.step(lm.state, jnp.asarray(prompt), cache, table, jnp.zeros((1,), jnp.int32),
                            jnp.asarray([prompt.shape[1]], jnp.int32),
                            logits_at=jnp.asarray([prompt.shape[1] - 1], jnp.int32))
    step_logits = [np.asarray(logits[0])]
    for position in range(prompt.shape[1], prompt.shape[1] + expected.size - 1):
        token = int(np.argmax(step_logits[-1]))
        logits, cache = lm.step(lm.state, jnp.asarray([[token]], jnp.int32), cache, table,
                                jnp.asarray([position], jnp.int32), jnp.ones((1,), jnp.int32),
                                logits_at=jnp.zeros((1,), jnp.int32))
        step_logits.append(np.asarray(logits[0]))
    generated = [int(np.argmax(row)) for row in step_logits]
    assert generated == list(expected)
    np.testing.assert_allclose(np.stack(step_logits), lm.ref["generate_logits"], atol=1e-4)


def test_attention_window_view_equals_the_model_on_sequences_it_covers(lm):
    """`with_attention_window(W)` (the engine's model when max_model_len < window) matches transformers
    over W positions from a ring of W positions, shares the parameters and leaves the model as it was."""
    window = 24
    model = nnx.merge(lm.graphdef, lm.state)
    capped = model.with_attention_window(window)
    assert capped.cfg.attention_window == min(window, lm.cfg.attention_window)
    assert model.cfg == lm.cfg and {layer.self_attn.window for layer in model.model.layers} == {
        lm.cfg.attention_window}
    assert capped.model.embed_tokens.embedding is model.model.embed_tokens.embedding  # not a copy
    pages = -(-window // PAGE_SIZE)
    cache = init_kv_cache(lm.cfg.num_layers, 1 + pages, lm.cfg.num_kv_heads, PAGE_SIZE, lm.cfg.head_dim)
    table, zeros = jnp.arange(1, 1 + pages, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32)
    logits, _ = capped(jnp.asarray(lm.ref["input_ids"][:, :window]), cache, table, zeros, zeros + window)
    np.testing.assert_allclose(np.asarray(logits), lm.ref["logits"][:, :window], atol=1e-4)


def test_text_lm_rejects_bad_inputs():
    cfg = config_from_hf(json.loads((FIXTURES / "mistral_tiny" / "config.json").read_text()))
    model = nnx.eval_shape(lambda: TextLM(cfg, rngs=nnx.Rngs(0)))
    tensors = load_file(FIXTURES / "mistral_tiny" / "model.safetensors")
    load_hf_weights(model, tensors)
    cache = init_kv_cache(cfg.num_layers, 5, cfg.num_kv_heads, PAGE_SIZE, cfg.head_dim)
    table, one = jnp.ones((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="token_ids must be"):
        model(jnp.ones((3,), jnp.int32), cache, table, one, one)
    with pytest.raises(ValueError, match="lengths must have shape"):
        model(jnp.ones((1, 1), jnp.int32), cache, table, jnp.ones((2,), jnp.int32), one)
    with pytest.raises(ValueError, match="logits_at must have shape"):
        model(jnp.ones((1, 1), jnp.int32), cache, table, one, one, logits_at=jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="belongs to VoxtralRealtime"):
        TextLM(dataclasses.replace(cfg, ada_t_cond_dim=32), rngs=nnx.Rngs(0))
    del tensors["lm_head.weight"]  # untied: the head is required
    with pytest.raises(CheckpointMismatchError, match="1 missing: lm_head.weight"):
        load_hf_weights(model, tensors)


def qwen_config(**edits):
    return {**json.loads((FIXTURES / "qwen2_tiny" / "config.json").read_text()), **edits}


@pytest.mark.parametrize("edits, window", [
    # Qwen2.5 checkpoints saved by transformers 4 state a window that applies only with use_sliding_window.
    ({"layer_types": None, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 0}, None),
    ({"layer_types": None, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0}, 64),
    ({"layer_types": None, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, None),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}, 64),
    ({"layer_types": ["full_attention"] * 2, "sliding_window": 64}, None),
], ids=["v4-window-off", "v4-all-sliding", "v4-none-sliding", "all-sliding", "all-full"])
def test_a_qwen_window_applies_only_to_sliding_layers(edits, window):
    assert config_from_hf(qwen_config(**edits)).sliding_window == window


@pytest.mark.parametrize("edits, message", [
    ({"layer_types": None, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
     "some layers a sliding window and others full attention"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "unsupported layer_types"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"model_type": "mistral", "attention_bias": True}, "a mistral decoder does not use"),
])
def test_configs_the_decoder_cannot_serve_are_refused(edits, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(qwen_config(**edits))


def test_which_projections_carry_biases_and_norms_per_family():
    qwen2, qwen3 = (config_from_hf(json.loads((FIXTURES / f"{name}_tiny" / "config.json").read_text()))
                    for name in ("qwen2", "qwen3"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (True, True, True)
    llama = config_from_hf({**qwen_config(model_type="llama"), "attention_bias": True})
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
