"""Checkpoint loading: Mistral-native == Hugging Face (names, q/k RoPE rows), the real 4B native name map,
Orbax conversion and sharded restore, dtype and streaming memory, and the one-line errors of missing or broken weights
and configs. Tokenizers, declared token ids and Orbax metadata: test_loading_metadata.py.

Native checkpoints are built from the transformers fixtures by loading_fixtures.write_native, with an independent
reverse name map and the inverse q/k permutation of spec voxtral_realtime.md §5.5; logits are anchored to the
transformers reference outputs (tests/make_reference_fixtures.py).
"""
import json
import math
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxstream import cli
from jaxstream.models import VOXTRAL_MINI_4B, TextConfig, hf_name_map, num_parameters
from jaxstream.models import checkpoint_metadata, loading
from jaxstream.models.layers import contiguous_page_table, init_kv_cache
from jaxstream.models.native_weights import native_tensor_shapes, native_to_hf_name, rope_permutation_heads
from loading_fixtures import (FIXTURES, MISTRAL_DIR, VOXTRAL_DIR, P, copy_fixture, flat_params, one_line_error,
                              write_native)

NUM_TOKENS = 40  # a causal prefix of the reference sequence keeps the forward passes short


def assert_same_params(a, b):
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for path in fa:
        assert fa[path].dtype == fb[path].dtype and np.array_equal(fa[path], fb[path]), path


@pytest.fixture(scope="module")
def voxtral_reference():
    return np.load(FIXTURES / "voxtral_tiny_reference.npz")


def voxtral_logits(model, ref) -> np.ndarray:
    mel = ref["features_d6"][:, :, : 8 * NUM_TOKENS].transpose(0, 2, 1)
    ids = ref["input_ids_d6"][:, :NUM_TOKENS].astype(np.int32)
    return np.asarray(model.offline_logits(jnp.asarray(mel), jnp.asarray(ids), jnp.array([6.0])))


def text_logits(model, ids: np.ndarray) -> np.ndarray:
    cfg = model.cfg
    table, num_pages = contiguous_page_table(1, cfg.attention_window, cfg.attention_window)
    cache = init_kv_cache(cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.attention_window, cfg.head_dim)
    zero, count = jnp.zeros(1, jnp.int32), jnp.full(1, ids.shape[1], jnp.int32)
    logits, _ = model(jnp.asarray(ids, jnp.int32), cache, jnp.asarray(table), zero, count)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def voxtral_hf(voxtral_reference):
    loaded = loading.load_model(VOXTRAL_DIR)
    return loaded, voxtral_logits(loaded.model, voxtral_reference)


def test_hf_voxtral_matches_transformers(voxtral_hf, voxtral_reference):
    loaded, logits = voxtral_hf
    assert loaded.tokenizer_path == VOXTRAL_DIR / "tekken.json"
    np.testing.assert_allclose(logits, voxtral_reference["logits_d6"][:, :NUM_TOKENS], atol=1e-4, rtol=1e-4)


def test_native_voxtral_equals_hf(voxtral_hf, voxtral_reference, tmp_path):
    (hf_model, hf_config, _), hf_logits = voxtral_hf
    native_dir = write_native(VOXTRAL_DIR, tmp_path / "native")
    with safe_open(native_dir / "consolidated.safetensors", "numpy") as f:  # the rows really are reordered
        hf_q = load_file(VOXTRAL_DIR / "model.safetensors")["audio_tower.layers.0.self_attn.q_proj.bias"]
        assert not np.array_equal(f.get_tensor(P + "whisper_encoder.transformer.layers.0.attention.wq.bias"), hf_q)
    model, config, tokenizer = loading.load_model(native_dir)
    assert config == hf_config and tokenizer == native_dir / "tekken.json"
    assert_same_params(model, hf_model)
    np.testing.assert_array_equal(voxtral_logits(model, voxtral_reference), hf_logits)


def test_native_text_lm_equals_hf(tmp_path):
    ref = np.load(FIXTURES / "mistral_tiny_reference.npz")
    hf_model, hf_config, _ = loading.load_model(MISTRAL_DIR)
    hf_logits = text_logits(hf_model, ref["input_ids"])
    np.testing.assert_allclose(hf_logits, ref["logits"], atol=1e-4, rtol=1e-4)
    model, config, _ = loading.load_model(write_native(MISTRAL_DIR, tmp_path / "native"))
    assert config == hf_config and not config.tie_embeddings  # exercises output.weight -> lm_head
    assert_same_params(model, hf_model)
    np.testing.assert_array_equal(text_logits(model, ref["input_ids"]), hf_logits)


def test_modern_names_sharded_index_and_tied_head(voxtral_hf, tmp_path):
    """transformers' load-time names, split over two files with an index, plus a redundant tied head."""
    tensors = load_file(VOXTRAL_DIR / "model.safetensors")
    modern = {}
    for name, tensor in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        else:
            name = "model." + name
        modern[name] = tensor
    modern["lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"]
    names = sorted(modern)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "modern"
    out.mkdir()
    for file, members in shards.items():
        save_file({name: modern[name] for name in members}, out / file)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: file for file, members in shards.items() for name in members}}))
    shutil.copy(VOXTRAL_DIR / "config.json", out / "config.json")
    shutil.copy(VOXTRAL_DIR / "tekken.json", out / "tekken.json")  # Voxtral does not load without its tokenizer
    model, _, tokenizer = loading.load_model(out)
    assert tokenizer == out / "tekken.json"
    assert_same_params(model, voxtral_hf[0].model)


def test_voxtral_4b_native_name_map():
    """Spec §5.2's table, expanded: 711 tensors, every shape, each filling one parameter of the 4B model."""
    enc = P + "whisper_encoder."
    table = {P + "tok_embeddings.weight": (131072, 3072),
             enc + "conv_layers.0.conv.weight": (1280, 128, 3), enc + "conv_layers.0.conv.bias": (1280,),
             enc + "conv_layers.1.conv.weight": (1280, 1280, 3), enc + "conv_layers.1.conv.bias": (1280,),
             enc + "transformer.norm.weight": (1280,),
             P + "audio_language_projection.0.weight": (3072, 5120),
             P + "audio_language_projection.2.weight": (3072, 3072), "norm.weight": (3072,)}
    for i in range(32):
        layer = f"{enc}transformer.layers.{i}."
        table.update({layer + "attention.wq.weight": (2048, 1280), layer + "attention.wq.bias": (2048,),
                      layer + "attention.wk.weight": (2048, 1280),
                      layer + "attention.wv.weight": (2048, 1280), layer + "attention.wv.bias": (2048,),
                      layer + "attention.wo.weight": (1280, 2048), layer + "attention.wo.bias": (1280,),
                      layer + "attention_norm.weight": (1280,), layer + "feed_forward.w1.weight": (5120, 1280),
                      layer + "feed_forward.w2.weight": (1280, 5120), layer + "feed_forward.w2.bias": (1280,),
                      layer + "feed_forward.w3.weight": (5120, 1280), layer + "ffn_norm.weight": (1280,)})
    for i in range(26):
        layer = f"layers.{i}."
        table.update({layer + "attention_norm.weight": (3072,), layer + "attention.wq.weight": (4096, 3072),
                      layer + "attention.wk.weight": (1024, 3072), layer + "attention.wv.weight": (1024, 3072),
                      layer + "attention.wo.weight": (3072, 4096), layer + "ffn_norm.weight": (3072,),
                      layer + "feed_forward.w1.weight": (9216, 3072), layer + "feed_forward.w2.weight": (3072, 9216),
                      layer + "feed_forward.w3.weight": (9216, 3072),
                      layer + "ada_rms_norm_t_cond.0.weight": (32, 3072),
                      layer + "ada_rms_norm_t_cond.2.weight": (3072, 32)})
    assert len(table) == 711
    assert native_tensor_shapes(VOXTRAL_MINI_4B) == table

    abstract = loading.abstract_model(VOXTRAL_MINI_4B, jnp.bfloat16)  # shapes only: nothing allocated
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    entries = hf_name_map(VOXTRAL_MINI_4B)
    filled = {}
    for name, shape in table.items():
        entry = entries[native_to_hf_name(name, VOXTRAL_MINI_4B)]
        filled[entry.path] = entry.transform(np.broadcast_to(np.zeros((), np.int8), shape)).shape  # no memory
    assert filled == {path: leaf.shape for path, leaf in leaves.items()}
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves.values())
    assert sum(math.prod(shape) for shape in table.values()) == num_parameters(abstract) == 4_429_679_360

    permuted = {name for name in table if rope_permutation_heads(native_to_hf_name(name, VOXTRAL_MINI_4B),
                                                                 VOXTRAL_MINI_4B)}
    assert permuted == ({f"{enc}transformer.layers.{i}.attention.{w}" for i in range(32)
                         for w in ("wq.weight", "wk.weight", "wq.bias")}
                        | {f"layers.{i}.attention.{w}.weight" for i in range(26) for w in ("wq", "wk")})


def test_orbax_convert_round_trip_and_sharded_restore(voxtral_hf, voxtral_reference, tmp_path, capsys):
    (hf_model, hf_config, _), hf_logits = voxtral_hf
    out = tmp_path / "orbax"
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out)]) == 0
    assert "205,408 float32 parameters" in capsys.readouterr().out
    model, config, tokenizer = loading.load_model(out)
    assert config == hf_config and tokenizer == out / "tekken.json"
    assert_same_params(model, hf_model)
    np.testing.assert_array_equal(voxtral_logits(model, voxtral_reference), hf_logits)

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    model = loading.load_model(out, sharding=replicated).model
    assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert_same_params(model, hf_model)

    def rows_over_x(path, shape):  # a per-parameter rule: split the leading axis where it divides
        return NamedSharding(mesh, PartitionSpec("x") if shape[0] % 4 == 0 else PartitionSpec())
    for source in (out, VOXTRAL_DIR):  # Orbax restore and safetensors streaming place shards alike
        sharded = loading.load_model(source, sharding=rows_over_x).model
        embedding = nnx.to_pure_dict(nnx.state(sharded, nnx.Param))["language_model"]["embed_tokens"]["embedding"]
        assert embedding.sharding.spec == PartitionSpec("x") and len(embedding.addressable_shards) == 4
        assert embedding.addressable_shards[0].data.shape == (1100 // 4, 64)
        assert_same_params(sharded, hf_model)


def test_convert_bfloat16_and_overwrite(voxtral_hf, tmp_path, capsys):
    hf_model = voxtral_hf[0].model
    out = tmp_path / "bf16"
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "jaxstream.json").read_text())["param_dtype"] == "bfloat16"
    restored = flat_params(loading.load_model(out, dtype="bfloat16").model)
    for path, value in flat_params(hf_model).items():
        assert restored[path].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(restored[path], value.astype(ml_dtypes.bfloat16))
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out), "--overwrite"]) == 0
    assert json.loads((out / "jaxstream.json").read_text())["param_dtype"] == "float32"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert cli.main(["convert", str(VOXTRAL_DIR), str(precious), "--overwrite"]) == 2
    assert (precious / "notes.txt").read_text() == "keep me"


# -- missing and broken weights and configs: one-line errors --------------------------------------------------------
def test_missing_files(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no params.json" in one_line_error(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(MISTRAL_DIR / "config.json", no_weights)
    assert "no model.safetensors" in one_line_error(no_weights)
    (no_weights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors"}}))
    assert "shard-1.safetensors" in one_line_error(no_weights)
    (no_weights / "shard-1.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read" in one_line_error(no_weights)
    params_only = tmp_path / "params_only"
    params_only.mkdir()
    (params_only / "params.json").write_text("{}")
    assert "consolidated.safetensors" in one_line_error(params_only)
    assert "is a file" in one_line_error(MISTRAL_DIR / "config.json")


def test_missing_tensor(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    broken = copy_fixture(MISTRAL_DIR, tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != name})
    message = one_line_error(broken)
    assert "missing" in message and name in message


def test_misshaped_tensor_hf_and_native(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = (48, 64)
    broken = copy_fixture(MISTRAL_DIR, tmp_path / "hf", lambda t: {**t, name: t[name][:40]})
    message = one_line_error(broken)
    assert name in message and "(40, 64)" in message and "(48, 64)" in message
    native = write_native(broken, tmp_path / "native")
    message = one_line_error(native)
    assert "layers.0.attention.wk.weight (40, 64)" in message and "(48, 64)" in message


def test_unsupported_model_type(tmp_path):
    broken = copy_fixture(MISTRAL_DIR, tmp_path / "m")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    message = one_line_error(broken)
    assert "'bert'" in message and "config.json" in message


def test_bfloat16_load_streams_tensors(tmp_path):
    """Every leaf comes out bf16, and host memory never holds a second copy of the checkpoint.

    tracemalloc sees numpy buffers: the loader's transient tensors, and on CPU also the parameters jax
    adopted without copying (they are the model's one copy). So the peak above what the loaded model
    keeps must stay at a few tensors; a whole-file read is the control showing a full copy would be seen.
    """
    cfg = TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=1e4, max_positions=64)
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(entry.shape, np.float32).astype(ml_dtypes.bfloat16)
               for name, entry in hf_name_map(cfg).items()}
    size = sum(t.nbytes for t in tensors.values())
    largest = max(t.nbytes for t in tensors.values())
    out = tmp_path / "synthetic"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    del tensors
    (out / "config.json").write_text(json.dumps({
        "model_type": "mistral", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 1e4, "max_position_embeddings": 64}))
    assert size > 8e6 and largest <= size / 30

    loading.load_model(out, dtype="bfloat16")  # warm-up: jax's own caches are not the loader's memory
    tracemalloc.start()
    try:
        model = loading.load_model(out, dtype=jnp.bfloat16).model
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        whole = load_file(out / "model.safetensors")
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert whole_peak >= size  # the measurement sees a full host copy ...
    assert peak - kept < size / 5 and peak < 1.2 * size  # ... and the loader holds a few tensors at a time
    del whole


def test_convert_dtype_auto_broken_and_mixed_checkpoints(tmp_path, capsys):
    def convert_error(source) -> str:
        assert cli.main(["convert", str(source), str(tmp_path / "out")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and not (tmp_path / "out").exists()
        return lines[0]

    truncated = copy_fixture(MISTRAL_DIR, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    assert "cannot read" in convert_error(truncated) and "model.safetensors" in convert_error(truncated)
    empty = copy_fixture(MISTRAL_DIR, tmp_path / "empty", lambda tensors: {})
    assert "stores no tensors" in convert_error(empty)
    integers = copy_fixture(MISTRAL_DIR, tmp_path / "integers",
                            lambda tensors: {name: t.astype(np.int32) for name, t in tensors.items()})
    assert "stores I32 tensors; expected floating-point parameters" in convert_error(integers)

    # The first tensor stored (a small one) in float32, the bulk of the parameters in bfloat16: bfloat16.
    with safe_open(MISTRAL_DIR / "model.safetensors", "numpy") as reader:
        first = next(iter(reader.keys()))
    mixed = copy_fixture(MISTRAL_DIR, tmp_path / "mixed", lambda tensors: {
        name: t if name == first else t.astype(ml_dtypes.bfloat16) for name, t in tensors.items()})
    assert checkpoint_metadata.checkpoint_dtype(checkpoint_metadata.inspect_checkpoint(mixed)) == jnp.bfloat16


@pytest.mark.parametrize("edit, field", [
    ({"num_hidden_layers": "2"}, "num_layers must be a positive integer, got '2'"),
    ({"hidden_size": 64.0}, "hidden_size must be a positive integer, got 64.0"),
    ({"vocab_size": -5}, "vocab_size must be a positive integer, got -5"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_heads must be a positive integer, got 0"),
    ({"rms_norm_eps": None}, "norm_eps must be a positive number, got None"),
    ({"max_position_embeddings": True}, "max_positions must be a positive integer, got True"),
], ids=["string", "float", "negative", "zero-heads", "null-eps", "bool"])
def test_malformed_config_values_are_one_line_errors(tmp_path, edit, field):
    broken = copy_fixture(MISTRAL_DIR, tmp_path / "m")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **edit}))
    message = one_line_error(broken)
    assert "config.json" in message and field in message

