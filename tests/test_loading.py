"""Checkpoint loading: Mistral-native == Hugging Face (names, q/k RoPE rows), the real 4B native name map,
Orbax conversion and sharded restore, validation errors, dtype and streaming memory.

Native checkpoints are built here from the transformers fixtures with an independent reverse name map and
the inverse q/k permutation of spec voxtral_realtime.md §5.5; logits are anchored to the transformers
reference outputs (tests/make_reference_fixtures.py).
"""
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

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
from jaxstream.errors import UserError
from jaxstream.models import VOXTRAL_MINI_4B, TextConfig, hf_name_map, num_parameters
from jaxstream.models import loading, orbax_writer
from jaxstream.models.layers import contiguous_page_table, init_kv_cache
from jaxstream.models.native_weights import native_tensor_shapes, native_to_hf_name, rope_permutation_heads

FIXTURES = Path(__file__).parent / "fixtures"
VOXTRAL_DIR = FIXTURES / "voxtral_tiny"
MISTRAL_DIR = FIXTURES / "mistral_tiny"
NUM_TOKENS = 40  # a causal prefix of the reference sequence keeps the forward passes short
P = "mm_streams_embeddings.embedding_module."

# ------------------------------------------------------------------- HF -> native (the test's oracle)

_DECODER_LAYER = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                  "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                  "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                  "mlp.up_proj": "feed_forward.w3", "ada_rms_norm.linear1": "ada_rms_norm_t_cond.0",
                  "ada_rms_norm.linear2": "ada_rms_norm_t_cond.2"}
_ENCODER_LAYER = {**_DECODER_LAYER, "self_attn_layer_norm": "attention_norm", "final_layer_norm": "ffn_norm"}


def native_name(hf: str, voxtral: bool) -> str:
    """Spec §5.4 read right to left."""
    decoder = "language_model.model." if voxtral else "model."
    fixed = {decoder + "embed_tokens.weight": (P if voxtral else "") + "tok_embeddings.weight",
             decoder + "norm.weight": "norm.weight", "lm_head.weight": "output.weight",
             "audio_tower.embedder.conv1.weight": P + "whisper_encoder.conv_layers.0.conv.weight",
             "audio_tower.embedder.conv1.bias": P + "whisper_encoder.conv_layers.0.conv.bias",
             "audio_tower.embedder.conv2.weight": P + "whisper_encoder.conv_layers.1.conv.weight",
             "audio_tower.embedder.conv2.bias": P + "whisper_encoder.conv_layers.1.conv.bias",
             "audio_tower.norm.weight": P + "whisper_encoder.transformer.norm.weight",
             "multi_modal_projector.linear_1.weight": P + "audio_language_projection.0.weight",
             "multi_modal_projector.linear_2.weight": P + "audio_language_projection.2.weight"}
    if hf in fixed:
        return fixed[hf]
    for prefix, native_prefix, table in ((decoder + "layers.", "layers.", _DECODER_LAYER),
                                         ("audio_tower.layers.", P + "whisper_encoder.transformer.layers.",
                                          _ENCODER_LAYER)):
        if hf.startswith(prefix):
            index, rest = hf[len(prefix):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            return f"{native_prefix}{index}.{table[module]}.{leaf}"
    raise AssertionError(f"no native name for {hf}")


def interleave_rows(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    """HF half-split q/k rows -> native interleaved pairs: native[h, 2i + j] = hf[h, j * hd/2 + i]."""
    rows = tensor.shape[0]
    return tensor.reshape(num_heads, 2, rows // num_heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(
        tensor.shape)


def voxtral_params_json(hf: dict) -> dict:
    audio, text = hf["audio_config"], hf["text_config"]
    return {
        "dim": text["hidden_size"], "n_layers": text["num_hidden_layers"], "head_dim": text["head_dim"],
        "hidden_dim": text["intermediate_size"], "n_heads": text["num_attention_heads"],
        "n_kv_heads": text["num_key_value_heads"], "use_biases": False, "causal": True,
        "rope_theta": text["rope_parameters"]["rope_theta"], "norm_eps": text["rms_norm_eps"],
        "vocab_size": text["vocab_size"], "tied_embeddings": True, "sliding_window": text["sliding_window"],
        "model_max_length": text["max_position_embeddings"], "ada_rms_norm_t_cond": True,
        "ada_rms_norm_t_cond_dim": 32,
        "multimodal": {"whisper_model_args": {
            "encoder_args": {
                "audio_encoding_args": {"sampling_rate": 16000, "frame_rate": 12.5,
                                        "num_mel_bins": audio["num_mel_bins"], "hop_length": 160,
                                        "window_size": 400, "chunk_length_s": None, "global_log_mel_max": 1.5,
                                        "transcription_format": "streaming"},
                "dim": audio["hidden_size"], "n_layers": audio["num_hidden_layers"], "head_dim": audio["head_dim"],
                "hidden_dim": audio["intermediate_size"], "n_heads": audio["num_attention_heads"],
                "n_kv_heads": audio["num_attention_heads"], "vocab_size": 131072, "use_biases": True,
                "use_cache": False, "rope_theta": audio["rope_parameters"]["rope_theta"], "causal": True,
                "norm_eps": audio["rms_norm_eps"], "pos_embed": "rope", "max_source_positions": None,
                "ffn_type": "swiglu", "norm_type": "rms_norm", "sliding_window": audio["sliding_window"]},
            "downsample_args": {"downsample_factor": hf["downsample_factor"]}}},
    }


def text_params_json(hf: dict) -> dict:
    return {"dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "head_dim": hf["head_dim"],
            "hidden_dim": hf["intermediate_size"], "n_heads": hf["num_attention_heads"],
            "n_kv_heads": hf["num_key_value_heads"], "rope_theta": hf["rope_parameters"]["rope_theta"],
            "norm_eps": hf["rms_norm_eps"], "vocab_size": hf["vocab_size"], "sliding_window": hf["sliding_window"],
            "model_max_length": hf["max_position_embeddings"], "tied_embeddings": hf["tie_word_embeddings"]}


def write_native(hf_dir: Path, out: Path) -> Path:
    """A Mistral-native checkpoint with the same weights as the HF checkpoint `hf_dir`."""
    hf = json.loads((hf_dir / "config.json").read_text())
    voxtral = hf["model_type"] == "voxtral_realtime"
    text = hf["text_config"] if voxtral else hf
    heads = {"q": text["num_attention_heads"], "k": text["num_key_value_heads"]}
    native = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        parts = name.split(".")
        if parts[-2] in ("q_proj", "k_proj"):  # weights of both towers and the encoder's q bias
            tower_heads = hf["audio_config"]["num_attention_heads"] if name.startswith("audio_tower.") else None
            tensor = interleave_rows(tensor, tower_heads or heads[parts[-2][0]])
        native[native_name(name, voxtral)] = tensor
    out.mkdir(parents=True)
    save_file(native, out / "consolidated.safetensors")
    (out / "params.json").write_text(json.dumps(voxtral_params_json(hf) if voxtral else text_params_json(hf)))
    if (hf_dir / "tekken.json").exists():
        shutil.copy(hf_dir / "tekken.json", out / "tekken.json")
    return out


# ------------------------------------------------------------------------------------------ helpers


def flat_params(model) -> dict:
    return {path: np.asarray(value) for path, value in
            traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


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


# ------------------------------------------------------------------------------------------- tests


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


def copy_fixture(src: Path, dst: Path, edit=None) -> Path:
    """`src` copied to `dst`, its tensors passed through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    if edit is not None:
        save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def one_line_error(source) -> str:
    with pytest.raises(UserError) as err:
        loading.load_model(source)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_declared_token_ids_prefer_generation_config(tmp_path):
    def declared(**files):
        directory = Path(tempfile.mkdtemp(dir=tmp_path))
        for name, content in files.items():
            (directory / f"{name}.json").write_text(json.dumps(content))
        return loading.declared_token_ids(directory)

    # generation_config.json first (transformers' generate reads it), field by field, then config.json.
    assert declared(generation_config={"eos_token_id": [128001, 128009]},
                    config={"bos_token_id": 1, "eos_token_id": 2}) == (1, (128001, 128009))
    assert declared(generation_config={"bos_token_id": 5, "eos_token_id": None},
                    config={"bos_token_id": 1, "eos_token_id": 2}) == (5, (2,))
    assert declared(config={"eos_token_id": 2}) == (None, (2,))
    assert declared() == (None, ())
    with pytest.raises(UserError, match="generation_config.json: eos_token_id must be a token id or a list"):
        declared(generation_config={"eos_token_id": "</s>"})
    with pytest.raises(UserError, match="config.json: bos_token_id must be a token id"):
        declared(config={"bos_token_id": [1, 2]})


def test_hf_checkpoint_tokenizer_json_wins_over_tokenizer_model(tmp_path):
    from tokenizers import Tokenizer, models

    directory = copy_fixture(FIXTURES / "llama_tiny", tmp_path / "llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 3]}))
    # Hub repos of Llama/Mistral ship their original sentencepiece model too; its ids are not the checkpoint's
    # in our Voxtral-layout SentencePieceTokenizer, so it must not be picked (never read: not a real model).
    (directory / "tokenizer.model").write_bytes(b"the original sentencepiece model")

    loaded = loading.load_model(directory)
    assert loaded.tokenizer_path == directory / "tokenizer.json"
    tokenizer = loading.load_checkpoint_tokenizer(directory, loaded.tokenizer_path)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)  # the checkpoint's ids (the first EOS)
    assert tokenizer.encode("hello") == [3]
    assert loading.load_checkpoint_tokenizer(directory, None) is None

    # `convert` keeps what the source declared: the engine stops at the same EOS ids after conversion.
    converted = tmp_path / "converted"
    assert cli.main(["convert", str(directory), str(converted)]) == 0
    assert loading.declared_token_ids(converted) == loading.declared_token_ids(directory) == (1, (2, 3))
    restored = loading.load_checkpoint_tokenizer(converted, loading.load_model(converted).tokenizer_path)
    assert (restored.bos_id, restored.eos_id) == (1, 2)


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


# ------------------------------------------------------------------ tokenizers, metadata and broken files


def word_level_tokenizer_json(path: Path):
    """A tokenizer.json with the checkpoint's own ids (`hello` is 3); returns the `tokenizers` object."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))
    return tokenizer


def test_text_models_never_read_tokenizer_model_in_the_voxtral_layout(tmp_path, caplog):
    """A native (params.json) directory takes tokenizer.json over the original sentencepiece model too, and a
    text model whose only tokenizer is a tokenizer.model loads without one instead of with ids off by 1000."""
    native = write_native(MISTRAL_DIR, tmp_path / "native")
    oracle = word_level_tokenizer_json(native / "tokenizer.json")
    shutil.copy(loading.BUILTIN_MODELS["tiny"] / "tokenizer.model", native / "tokenizer.model")
    loaded = loading.load_model(native)
    assert loaded.tokenizer_path == native / "tokenizer.json"
    tokenizer = loading.load_checkpoint_tokenizer(native, loaded.tokenizer_path)
    assert tokenizer.encode("hello") == oracle.encode("hello", add_special_tokens=False).ids == [3]

    (native / "tokenizer.json").unlink()
    hf = copy_fixture(MISTRAL_DIR, tmp_path / "hf")
    shutil.copy(native / "tokenizer.model", hf / "tokenizer.model")
    for directory in (native, hf):
        with caplog.at_level("WARNING", logger="jaxstream.models.loading"):
            assert loading.load_model(directory).tokenizer_path is None
        assert "tokenizer.model not used" in caplog.text
        caplog.clear()


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
    assert loading.checkpoint_dtype(loading.inspect_checkpoint(mixed)) == jnp.bfloat16


@pytest.fixture(scope="module")
def voxtral_orbax(tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "voxtral"
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out)]) == 0
    return out


def broken_orbax(source: Path, destination: Path, metadata_edit=None) -> Path:
    shutil.copytree(source, destination)
    if metadata_edit is not None:
        metadata = json.loads((destination / "jaxstream.json").read_text())
        metadata_edit(metadata)
        (destination / "jaxstream.json").write_text(json.dumps(metadata))
    return destination


def test_orbax_metadata_and_state_errors_are_one_line(voxtral_orbax, tmp_path):
    no_tokenizer = broken_orbax(voxtral_orbax, tmp_path / "no_tokenizer")
    (no_tokenizer / "tekken.json").unlink()
    assert "lacks tekken.json, the tokenizer jaxstream.json names" in one_line_error(no_tokenizer)
    outside = broken_orbax(voxtral_orbax, tmp_path / "outside", lambda m: m.update(tokenizer="../x/tekken.json"))
    assert "tokenizer must be the name of a file beside it" in one_line_error(outside)
    version = broken_orbax(voxtral_orbax, tmp_path / "version", lambda m: m.update(format_version="1"))
    assert "format_version must be an integer, got '1'" in one_line_error(version)
    no_dtype = broken_orbax(voxtral_orbax, tmp_path / "no_dtype", lambda m: m.pop("param_dtype"))
    assert "param_dtype must be one of" in one_line_error(no_dtype)
    with pytest.raises(UserError, match="param_dtype"):
        loading.checkpoint_dtype(loading.CheckpointInfo("orbax", no_dtype, VOXTRAL_MINI_4B, (), None))
    no_data = broken_orbax(voxtral_orbax, tmp_path / "no_data")
    shutil.rmtree(no_data / "state" / "ocdbt.process_0")
    # In a process of its own: after the first failed read Orbax abandons its other reads, whose failures
    # surface later as "Exception ignored in ..." tracebacks (after the CLI's error line, or in a later test).
    result = subprocess.run([sys.executable, "-m", "jaxstream", "convert", str(no_data), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    [message] = [line for line in result.stderr.splitlines() if line.startswith("jaxstream convert: error:")]
    assert result.returncode == 2 and len(message) < 300 + 2 * len(str(no_data))  # it names the folder twice
    assert message.startswith(f"jaxstream convert: error: cannot restore {no_data / 'state'}")
    # TensorStore's own status names the array and what is wrong with its file, not Orbax's wrapper (which
    # printed the store's spec: "See full TensorStore details: <bound method pybind11_detail_function_...").
    assert 'Error reading "' in message and "TensorStore details" not in message, message
    assert "Task exception was never retrieved" not in result.stderr


def test_orbax_reads_abandoned_after_a_failed_restore_are_not_logged(voxtral_orbax, tmp_path):
    """After the first failed read Orbax abandons the others; asyncio logs each that failed as it is collected
    (when is up to the garbage collector: at exit, in about one CLI run of seven), with TensorStore's whole spec.
    Those records are dropped once a restore has failed; asyncio's other errors are not."""
    no_data = broken_orbax(voxtral_orbax, tmp_path / "no_data")
    shutil.rmtree(no_data / "state" / "ocdbt.process_0")
    asyncio_logger = logging.getLogger("asyncio")
    abandoned = ("Task exception was never retrieved\nfuture: <Task finished name='Task-241' coro=<async_deserialize() "
                 "done, defined at /site-packages/orbax/checkpoint/_src/serialization/serialization.py:394> "
                 "exception=Exception('Encountered error while reading array index: (slice(0, 256, 1),)')>")
    other = "Task exception was never retrieved\nfuture: <Task finished name='Task-7' coro=<handler() done>>"
    with pytest.raises(UserError, match="cannot restore"):
        loading.load_model(no_data)
    assert not asyncio_logger.filter(asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 0, abandoned, (),
                                                               None))
    assert asyncio_logger.filter(asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 0, other, (), None))


def test_tokenizer_file_errors_are_one_line(voxtral_orbax, tmp_path):
    def tokenizer_error(directory: Path) -> str:
        with pytest.raises(UserError) as err:
            loading.load_checkpoint_tokenizer(directory, loading.load_model(directory).tokenizer_path)
        assert "\n" not in str(err.value)
        return str(err.value)

    no_tekken = copy_fixture(VOXTRAL_DIR, tmp_path / "no_tekken")
    (no_tekken / "tekken.json").unlink()
    assert "Voxtral Realtime needs its tokenizer" in one_line_error(no_tekken)
    orbax_without = broken_orbax(voxtral_orbax, tmp_path / "orbax_without", lambda m: m.update(tokenizer=None))
    (orbax_without / "tekken.json").unlink()
    assert "Voxtral Realtime needs its tokenizer" in one_line_error(orbax_without)

    malformed = copy_fixture(VOXTRAL_DIR, tmp_path / "malformed")
    (malformed / "tekken.json").write_text('{"not": "tekken"')
    assert f"cannot read tokenizer {malformed / 'tekken.json'}" in tokenizer_error(malformed)
    specials = copy_fixture(VOXTRAL_DIR, tmp_path / "specials")
    tekken = json.loads((specials / "tekken.json").read_text())
    tekken["config"].update(default_num_special_tokens=1001, default_vocab_size=1101)
    (specials / "tekken.json").write_text(json.dumps(tekken))
    assert "expected 1000 special tokens" in tokenizer_error(specials)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        directory = copy_fixture(FIXTURES / "llama_tiny", tmp_path / name)
        word_level_tokenizer_json(directory / "tokenizer.json")
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        (directory / name).write_text("{bad")
        assert f"cannot read tokenizer {directory / name}" in tokenizer_error(directory)


def test_failed_convert_leaves_the_destination_as_it_was(voxtral_orbax, tmp_path):
    loaded = loading.load_model(VOXTRAL_DIR)
    before = flat_params(loading.load_model(voxtral_orbax).model)
    lost = loaded._replace(tokenizer_path=tmp_path / "gone" / "tekken.json")  # fails after state/ is written
    for destination in (voxtral_orbax, tmp_path / "fresh"):
        with pytest.raises(FileNotFoundError):
            orbax_writer.save_checkpoint(lost, destination, overwrite=True)
        assert sorted(path.name for path in destination.parent.iterdir() if path.name.startswith(".")) == []
    assert not (tmp_path / "fresh").exists()
    after = flat_params(loading.load_model(voxtral_orbax).model)
    assert before.keys() == after.keys() and all(np.array_equal(before[path], after[path]) for path in before)
    assert orbax_writer.check_destination(voxtral_orbax, overwrite=True) == voxtral_orbax
    assert orbax_writer.save_checkpoint(loaded, voxtral_orbax, overwrite=True) == voxtral_orbax
    assert loading.load_model(voxtral_orbax).tokenizer_path == voxtral_orbax / "tekken.json"


def test_convert_keeps_bos_eos_named_only_in_tokenizer_config(tmp_path):
    source = copy_fixture(FIXTURES / "llama_tiny", tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.endswith("token_id")}))
    (source / "generation_config.json").unlink()
    word_level_tokenizer_json(source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert cli.main(["convert", str(source), str(tmp_path / "converted")]) == 0
    for directory in (source, tmp_path / "converted"):
        tokenizer = loading.load_checkpoint_tokenizer(directory, loading.load_model(directory).tokenizer_path)
        assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)


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
