"""The checkpoints test_loading.py and test_loading_metadata.py share: the tiny transformers fixtures, a
Mistral-native copy of one written with the tests' own HF -> native map (the oracle: spec voxtral_realtime.md §5.4
read right to left, and the inverse q/k permutation of §5.5), and the helpers that copy a fixture with edited
tensors, flatten a model's parameters and expect a one-line UserError."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx, traverse_util
from safetensors.numpy import load_file, save_file

from jaxstream.errors import UserError
from jaxstream.models import loading

FIXTURES = Path(__file__).parent / "fixtures"
VOXTRAL_DIR = FIXTURES / "voxtral_tiny"
MISTRAL_DIR = FIXTURES / "mistral_tiny"
P = "mm_streams_embeddings.embedding_module."

# -- HF -> native (the oracle) -------------------------------------------------------------------------------------
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


# -- helpers -------------------------------------------------------------------------------------------------------
def flat_params(model) -> dict:
    return {path: np.asarray(value) for path, value in
            traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


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

