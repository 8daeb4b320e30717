"""Weight-only int8 quantization (models/quantization.py, `--quantization int8`): the int8 model against the float
model run with the dequantized weights, the per-channel error bound, quantizing as the weights load (both checkpoint
paths, device memory, tensor-parallel placement), parameter bytes, the embedded model's transcript, greedy text
through the engine, and the flag from the command line to the engine."""
import gc
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jaxstream.cli import main
from jaxstream.commands.transcribe import QUANTIZATION_CHOICES
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams
from jaxstream.engine.sharding import Placement
from jaxstream.errors import InvalidRequestError
from jaxstream.models import VOXTRAL_MINI_4B, TextConfig, contiguous_page_table, hf_name_map, init_kv_cache, loading
from jaxstream.models.audio import load_audio
from jaxstream.models.orbax_writer import save_checkpoint
from jaxstream.models.quantization import (
    QUANTIZATION_METHODS, Int8Embed, Int8Linear, int8_weights, quantize_model, quantize_weight,
)
from jaxstream.models.tokenizers import load_tokenizer
from loading_fixtures import FIXTURES, MISTRAL_DIR, VOXTRAL_DIR, flat_params, write_native

LLAMA_DIR = FIXTURES / "llama_tiny"
SAMPLE = loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav"
SAMPLE_TEXT = "he who has imagination without learning has wings but no feet"  # the float model's (MODEL_CARD.md)


def scale_path(path: tuple) -> tuple:
    return path[:-1] + ("scale",)


def dequantized(float_model, int8_model):
    """A copy of the float model whose quantized weights are q * scale (float): the oracle of the int8 layers."""
    oracle = nnx.clone(float_model)
    state = nnx.state(oracle, nnx.Param)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    int8 = flat_params(int8_model)
    for path, axis in int8_weights(int8_model).items():
        flat[path] = jnp.asarray(int8[path].astype(np.float32) * np.expand_dims(int8[scale_path(path)], axis))
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    nnx.update(oracle, state)
    return oracle


def text_logits(model, token_ids):
    cfg = model.cfg
    table, num_pages = contiguous_page_table(1, cfg.attention_window, cfg.attention_window)
    cache = init_kv_cache(cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.attention_window, cfg.head_dim)
    logits, _ = model(jnp.asarray([token_ids], jnp.int32), cache, jnp.asarray(table), jnp.zeros(1, jnp.int32),
                      jnp.asarray([len(token_ids)], jnp.int32))
    return np.asarray(logits[0])


@pytest.fixture(scope="module")
def tiny():
    """The embedded model, float and int8."""
    loaded = loading.load_model("tiny")
    return loaded, quantize_model(loaded.model)


def test_int8_layers_equal_the_float_model_with_dequantized_weights(tiny):
    """(x @ q) * scale is x @ (q * scale) up to float rounding: every linear layer of Voxtral (encoder, adapter, ada
    norm, decoder) and its tied embedding in both roles, and a text LM's untied int8 LM head (the tiny Mistral)."""
    loaded, int8 = tiny
    assert {type(layer) for _, layer in nnx.iter_modules(int8)} >= {Int8Linear, Int8Embed}
    rng = np.random.default_rng(0)
    mel = jnp.asarray(rng.standard_normal((2, 8 * 12, 128)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, loaded.config.text.vocab_size, (2, 12)), jnp.int32)
    n_delay = jnp.array([6.0, 12.0])
    want = np.asarray(dequantized(loaded.model, int8).offline_logits(mel, ids, n_delay))
    got = np.asarray(int8.offline_logits(mel, ids, n_delay))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    # The quantization itself moves the logits far more than that: the comparison can tell.
    assert np.abs(np.asarray(loaded.model.offline_logits(mel, ids, n_delay)) - want).max() > 100 * 2e-5 * np.abs(
        want).max()

    mistral = loading.load_model(MISTRAL_DIR).model
    mistral_int8 = quantize_model(mistral)
    assert isinstance(mistral_int8.lm_head, Int8Linear) and isinstance(mistral_int8.model.embed_tokens, Int8Embed)
    tokens = rng.integers(0, mistral.cfg.vocab_size, 20).tolist()
    want = text_logits(dequantized(mistral, mistral_int8), tokens)
    np.testing.assert_allclose(text_logits(mistral_int8, tokens), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_each_weight_is_within_half_a_step_of_its_int8_value(tiny):
    """max |w - q * scale| <= scale / 2 per output channel (to float32 rounding: 0.5000022 scale at worst), q in
    [-127, 127] with the channel's largest weight at +-127 (the scale is no coarser than it must be); a channel of
    zeros gets scale 0."""
    loaded, int8 = tiny
    weights, quantized = flat_params(loaded.model), flat_params(int8)
    for path, axis in int8_weights(int8).items():
        w, q, scale = weights[path], quantized[path], quantized[scale_path(path)]
        assert q.dtype == np.int8 and scale.dtype == np.float32 and q.shape == w.shape, path
        assert np.abs(q.astype(np.int32)).max() <= 127 and (np.abs(q).max(axis=axis) == 127).all(), path
        error = np.abs(w - q * np.expand_dims(scale.astype(np.float64), axis)).max(axis=axis)  # exact products
        assert (error <= scale * (0.5 + 1e-5)).all(), path  # w / scale rounds in float32 before it is rounded to q
    q, scale = quantize_weight(jnp.asarray([[0.0, 1.0], [0.0, -2.0]]), 0)
    assert np.asarray(scale).tolist() == [0.0, np.float32(2 / 127)] and np.asarray(q).tolist() == [[0, 64], [0, -127]]


def test_parameter_bytes_quarter_against_float32_and_halve_against_bfloat16(tiny):
    """nbytes of the jax arrays: each quantized weight takes a quarter of its float32 bytes (half of bfloat16),
    plus 4 bytes per output channel; Voxtral Realtime 4B's weights (abstract) go from 8.86 to 4.44 GB."""
    loaded, int8 = tiny
    weights, quantized = flat_params(loaded.model), flat_params(int8)
    paths = int8_weights(int8)
    float_bytes = sum(weights[path].nbytes for path in paths)
    scale_bytes = sum(quantized[scale_path(path)].nbytes for path in paths)
    int8_total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(int8, nnx.Param)))
    float_total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(loaded.model, nnx.Param)))
    assert int8_total == float_total - float_bytes + float_bytes // 4 + scale_bytes
    assert float_bytes > 0.95 * float_total and int8_total < 0.28 * float_total
    bf16 = loading.load_model("tiny", dtype="bfloat16", quantization="int8").model
    bf16_weights = {path: leaf for path, leaf in flat_params(loading.load_model("tiny", dtype="bfloat16").model).items()
                    if path in paths}
    assert sum(flat_params(bf16)[path].nbytes for path in paths) * 2 == sum(w.nbytes for w in bf16_weights.values())

    def nbytes(model):
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))

    real = [nbytes(loading.abstract_model(VOXTRAL_MINI_4B, jnp.bfloat16, quantization=q)) for q in (None, "int8")]
    assert round(real[0] / 1e9, 2) == 8.86 and round(real[1] / 1e9, 2) == 4.44


def test_loading_quantizes_each_tensor_as_it_is_read(tiny, tmp_path):
    """`load_model(quantization="int8")` equals `quantize_model` of the float load, bit for bit, from an Orbax
    checkpoint (the embedded model), Hugging Face safetensors (Voxtral, Llama) and a Mistral-native Voxtral."""
    loaded, int8 = tiny
    native = write_native(VOXTRAL_DIR, tmp_path / "native")
    for source, expected in (("tiny", int8), (VOXTRAL_DIR, None), (LLAMA_DIR, None), (native, None)):
        expected = flat_params(expected or quantize_model(loading.load_model(source).model))
        got = flat_params(loading.load_model(source, quantization="int8").model)
        assert got.keys() == expected.keys()
        for path in got:
            assert got[path].dtype == expected[path].dtype and np.array_equal(got[path], expected[path]), path


def _live_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


def _live_bytes_after_collection() -> int:
    gc.collect()  # the modules of a model dropped before hold reference cycles
    return _live_bytes()


@pytest.mark.parametrize("kind", ["safetensors", "orbax"])
def test_quantized_loading_never_holds_the_float_model(tmp_path, monkeypatch, kind):
    """The device arrays alive each time a tensor is placed stay at the int8 model so far plus the tensors in flight
    (one safetensors tensor, or one Orbax restore group, made 1 MB here): never the float model, which a float load
    of the same checkpoint does reach (the measurement sees it)."""
    cfg = TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=1e4, max_positions=64)
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(entry.shape, np.float32) for name, entry in hf_name_map(cfg).items()}
    float_bytes = sum(t.nbytes for t in tensors.values())
    assert max(t.nbytes for t in tensors.values()) < float_bytes / 30
    source = tmp_path / "synthetic"
    source.mkdir()
    save_file(tensors, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({
        "model_type": "mistral", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 1e4, "max_position_embeddings": 64}))
    if kind == "orbax":
        source = save_checkpoint(loading.load_model(source), tmp_path / "orbax")
        monkeypatch.setattr(loading, "_QUANTIZED_RESTORE_BYTES", 1 << 20)
    placed = loading._placed  # noqa: SLF001 - what every placement goes through
    peaks = []

    def measured(*args):
        peaks.append(_live_bytes() - baseline)
        return placed(*args)

    monkeypatch.setattr(loading, "_placed", measured)
    baseline = _live_bytes_after_collection()
    model = loading.load_model(source, dtype="float32", quantization="int8").model
    int8_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    del model
    assert len(peaks) == len(tensors) and max(peaks) < int8_bytes + (3 << 20) < float_bytes / 2
    if kind == "safetensors":
        peaks.clear()
        baseline = _live_bytes_after_collection()
        loading.load_model(source, dtype="float32")
        assert max(peaks) > 0.9 * float_bytes


@pytest.mark.parametrize("source", ["tiny", VOXTRAL_DIR], ids=["orbax", "safetensors"])
def test_tensor_parallel_scales_follow_their_weights_output_channels(tiny, source):
    """Over a 4-device "tp" mesh (the engine's rule as the loading rule): a weight split on its outputs (q_proj,
    up_proj, the embedding's vocabulary) has its scales split alike; one split on its inputs (o_proj, down_proj)
    has them whole on every device. The values equal a single-device int8 load (scales reduced over split inputs)."""
    placement = Placement(Mesh(np.array(jax.devices()[:4]), ("tp",)), "tp")
    model = loading.load_model(source, sharding=placement.param_sharding, quantization="int8").model
    params = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    layer = ("language_model", "layers", 0)
    expected = {("self_attn", "q_proj"): (P(None, "tp"), P("tp")), ("mlp", "up_proj"): (P(None, "tp"), P("tp")),
                ("self_attn", "o_proj"): (P("tp", None), P()), ("mlp", "down_proj"): (P("tp", None), P())}
    for name, (kernel_spec, scale_spec) in expected.items():
        assert params[layer + name + ("kernel",)].sharding.spec == kernel_spec, name
        assert params[layer + name + ("scale",)].sharding.spec == scale_spec, name
    embed = ("language_model", "embed_tokens")
    assert params[embed + ("embedding",)].sharding.spec == P("tp", None)
    assert params[embed + ("scale",)].sharding.spec == P("tp")
    single = flat_params(tiny[1] if source == "tiny" else loading.load_model(source, quantization="int8").model)
    for path, value in params.items():
        assert np.array_equal(np.asarray(value), single[path]), path


async def test_the_embedded_model_transcribes_the_sample_exactly_in_int8(tiny):
    """A float model handed to an engine configured for int8 is served quantized, and the embedded model still
    transcribes the bundled sample exactly at the default delay (as in float; the same ids at every trained delay,
    160-960 ms, when measured)."""
    loaded, _ = tiny
    config = EngineConfig(max_sessions=1, quantization="int8")
    async with AsyncEngine(loaded.model, config=config, tokenizer=load_tokenizer(loaded.tokenizer_path)) as engine:
        params = engine.core.programs.params
        assert params["language_model"]["layers"][0]["mlp"]["up_proj"]["kernel"][...].dtype == jnp.int8
        done = await engine.transcribe(load_audio(SAMPLE))
    assert done.text == SAMPLE_TEXT


async def test_greedy_text_through_the_engine_equals_the_float_models():
    """The tiny Llama loaded in int8 by `from_pretrained` generates the float model's greedy tokens (transformers'
    reference) for a short prompt. Longer, this random model's top two logits come within 0.05 of each other (its
    11th token): int8 then picks the other, as any perturbation of that size would."""
    reference = dict(np.load(FIXTURES / "llama_tiny_reference.npz"))
    prompt = reference["prompt_ids"][0].tolist()
    expected = reference["generate"][0, len(prompt):len(prompt) + 8].tolist()
    config = EngineConfig(max_sessions=1, page_size=16, batch_buckets=(1,), prefill_buckets=((1, 8),),
                          max_num_batched_tokens=64, quantization="int8")
    async with AsyncEngine.from_pretrained(LLAMA_DIR, config=config) as engine:
        assert engine.core.programs.params["model"]["embed_tokens"]["embedding"][...].dtype == jnp.int8
        params = SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
        outputs = [out async for out in engine.generate(prompt, params, request_id="greedy")]
    assert [token for out in outputs for token in out.outputs[0].token_ids] == expected


def test_bad_quantization_values_name_the_choices(capsys):
    assert QUANTIZATION_CHOICES == QUANTIZATION_METHODS  # the parsers' copy (they do not import jax)
    with pytest.raises(InvalidRequestError, match=r"EngineConfig.quantization must be one of 'int8' or None"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"quantization must be one of int8 or None, got 'fp8'"):
        loading.load_model("tiny", quantization="fp8")
    with pytest.raises(ValueError, match="got 'int4'"):
        quantize_model(loading.load_model(LLAMA_DIR).model, "int4")
    with pytest.raises(SystemExit):
        main(["transcribe", str(SAMPLE), "--quantization", "int4"])
    assert capsys.readouterr().err.splitlines()[-1] == ("jaxstream transcribe: error: argument --quantization: "
                                                        "invalid choice: 'int4' (choose from 'int8')")
