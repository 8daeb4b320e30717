"""Mistral-native checkpoint names (`consolidated.safetensors`) and their Hugging Face equivalents.

Native checkpoints (the files vLLM and mistral-inference read) differ from Hugging Face ones in two ways
(spec voxtral_realtime.md §5): tensor names, and the row order of the q/k projections. Native q/k rows
are in *interleaved* RoPE pair order (rows 2i, 2i+1 share frequency i); HF and jaxstream use the
*half-split* order of `rotate_half` (rows i, i + head_dim/2). Loading a native checkpoint therefore
renames each tensor to its on-disk HF name and permutes the q and k rows of both towers, including the
encoder's q bias, but never v or o (spec pitfall 2).
"""
import re
from collections.abc import Mapping

import numpy as np

from jaxstream.models.config import TextConfig, VoxtralConfig
from jaxstream.models.hf_weights import CheckpointMismatchError

VOXTRAL_PREFIX = "mm_streams_embeddings.embedding_module."
_ENC = re.escape(VOXTRAL_PREFIX + "whisper_encoder.")

# (native pattern, HF replacement) with {dec} = the HF decoder prefix and {head} = the HF output head.
_DECODER_RULES = (
    (rf"(?:{re.escape(VOXTRAL_PREFIX)})?tok_embeddings\.weight", r"{dec}embed_tokens.weight"),
    (r"norm\.weight", r"{dec}norm.weight"),
    (r"output\.weight", r"{head}"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"{dec}layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"{dec}layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.weight", r"{dec}layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"{dec}layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"{dec}layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"{dec}layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.ada_rms_norm_t_cond\.0\.weight", r"{dec}layers.\1.ada_rms_norm.linear1.weight"),
    (r"layers\.(\d+)\.ada_rms_norm_t_cond\.2\.weight", r"{dec}layers.\1.ada_rms_norm.linear2.weight"),
)
_AUDIO_RULES = (
    (rf"{_ENC}conv_layers\.0\.conv\.(weight|bias)", r"audio_tower.embedder.conv1.\1"),
    (rf"{_ENC}conv_layers\.1\.conv\.(weight|bias)", r"audio_tower.embedder.conv2.\1"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.attention\.w([qkv])\.(weight|bias)",
     r"audio_tower.layers.\1.self_attn.\2_proj.\3"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.attention\.wo\.(weight|bias)", r"audio_tower.layers.\1.self_attn.o_proj.\2"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.attention_norm\.weight",
     r"audio_tower.layers.\1.self_attn_layer_norm.weight"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.ffn_norm\.weight", r"audio_tower.layers.\1.final_layer_norm.weight"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.feed_forward\.w1\.weight", r"audio_tower.layers.\1.mlp.gate_proj.weight"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.feed_forward\.w2\.(weight|bias)", r"audio_tower.layers.\1.mlp.down_proj.\2"),
    (rf"{_ENC}transformer\.layers\.(\d+)\.feed_forward\.w3\.weight", r"audio_tower.layers.\1.mlp.up_proj.weight"),
    (rf"{_ENC}transformer\.norm\.weight", r"audio_tower.norm.weight"),
    (rf"{re.escape(VOXTRAL_PREFIX)}audio_language_projection\.0\.weight", r"multi_modal_projector.linear_1.weight"),
    (rf"{re.escape(VOXTRAL_PREFIX)}audio_language_projection\.2\.weight", r"multi_modal_projector.linear_2.weight"),
)


def _compile(rules, dec: str, head: str):
    return tuple((re.compile(pattern), replacement.replace("{dec}", dec).replace("{head}", head))
                 for pattern, replacement in rules)


# HF names in their on-disk form (what `save_pretrained` writes): legacy names for Voxtral.
_VOXTRAL_RULES = _compile(_AUDIO_RULES + _DECODER_RULES, "language_model.model.", "language_model.lm_head.weight")
_TEXT_RULES = _compile(_DECODER_RULES, "model.", "lm_head.weight")


def native_to_hf_name(name: str, config: TextConfig | VoxtralConfig) -> str | None:
    """The on-disk HF name of native tensor `name`, or None when `name` is not a tensor of this model."""
    rules = _VOXTRAL_RULES if isinstance(config, VoxtralConfig) else _TEXT_RULES
    for pattern, replacement in rules:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    return None


def native_tensor_shapes(config: TextConfig | VoxtralConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a native checkpoint of `config`, with its PyTorch-layout shape (spec §5.2)."""
    text = config.text if isinstance(config, VoxtralConfig) else config
    shapes: dict[str, tuple[int, ...]] = {}
    if isinstance(config, VoxtralConfig):
        enc = config.encoder
        p = VOXTRAL_PREFIX + "whisper_encoder."
        e_dim, e_attn = enc.hidden_size, enc.num_heads * enc.head_dim
        shapes[p + "conv_layers.0.conv.weight"] = (e_dim, enc.num_mel_bins, 3)
        shapes[p + "conv_layers.0.conv.bias"] = (e_dim,)
        shapes[p + "conv_layers.1.conv.weight"] = (e_dim, e_dim, 3)
        shapes[p + "conv_layers.1.conv.bias"] = (e_dim,)
        for i in range(enc.num_layers):
            layer = f"{p}transformer.layers.{i}."
            shapes.update({
                layer + "attention.wq.weight": (e_attn, e_dim), layer + "attention.wq.bias": (e_attn,),
                layer + "attention.wk.weight": (e_attn, e_dim),
                layer + "attention.wv.weight": (e_attn, e_dim), layer + "attention.wv.bias": (e_attn,),
                layer + "attention.wo.weight": (e_dim, e_attn), layer + "attention.wo.bias": (e_dim,),
                layer + "attention_norm.weight": (e_dim,),
                layer + "feed_forward.w1.weight": (enc.intermediate_size, e_dim),
                layer + "feed_forward.w2.weight": (e_dim, enc.intermediate_size),
                layer + "feed_forward.w2.bias": (e_dim,),
                layer + "feed_forward.w3.weight": (enc.intermediate_size, e_dim),
                layer + "ffn_norm.weight": (e_dim,),
            })
        shapes[p + "transformer.norm.weight"] = (e_dim,)
        stacked = e_dim * config.downsample_factor
        shapes[VOXTRAL_PREFIX + "audio_language_projection.0.weight"] = (text.hidden_size, stacked)
        shapes[VOXTRAL_PREFIX + "audio_language_projection.2.weight"] = (text.hidden_size, text.hidden_size)
        shapes[VOXTRAL_PREFIX + "tok_embeddings.weight"] = (text.vocab_size, text.hidden_size)
    else:
        shapes["tok_embeddings.weight"] = (text.vocab_size, text.hidden_size)
    dim, q_dim, kv_dim = text.hidden_size, text.num_heads * text.head_dim, text.num_kv_heads * text.head_dim
    for i in range(text.num_layers):
        layer = f"layers.{i}."
        shapes.update({
            layer + "attention_norm.weight": (dim,),
            layer + "attention.wq.weight": (q_dim, dim),
            layer + "attention.wk.weight": (kv_dim, dim),
            layer + "attention.wv.weight": (kv_dim, dim),
            layer + "attention.wo.weight": (dim, q_dim),
            layer + "ffn_norm.weight": (dim,),
            layer + "feed_forward.w1.weight": (text.intermediate_size, dim),
            layer + "feed_forward.w2.weight": (dim, text.intermediate_size),
            layer + "feed_forward.w3.weight": (text.intermediate_size, dim),
        })
        if text.ada_t_cond_dim:
            shapes[layer + "ada_rms_norm_t_cond.0.weight"] = (text.ada_t_cond_dim, dim)
            shapes[layer + "ada_rms_norm_t_cond.2.weight"] = (dim, text.ada_t_cond_dim)
    shapes["norm.weight"] = (dim,)
    if not text.tie_embeddings:
        shapes["output.weight"] = (text.vocab_size, dim)
    return shapes


def _summarise(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")
    return f"{len(items)} {kind}: {shown}"


def check_native_tensors(config: TextConfig | VoxtralConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raises CheckpointMismatchError naming missing, mis-shaped and unexpected native tensors."""
    wanted = native_tensor_shapes(config)
    text = config.text if isinstance(config, VoxtralConfig) else config
    tied_head = {"output.weight"} if text.tie_embeddings else set()  # a tied head's redundant copy
    missing = sorted(set(wanted) - set(shapes))
    misshaped = sorted(f"{name} {tuple(shapes[name])} (expected {wanted[name]})"
                       for name in set(wanted) & set(shapes) if tuple(shapes[name]) != wanted[name])
    unexpected = sorted(set(shapes) - set(wanted) - tied_head)
    problems = [_summarise(kind, items) for kind, items in
                (("missing", missing), ("mis-shaped", misshaped), ("unexpected", unexpected)) if items]
    if problems:
        raise CheckpointMismatchError("checkpoint does not match the model configuration: " + "; ".join(problems))


def rope_permutation_heads(hf_name: str, config: TextConfig | VoxtralConfig) -> int | None:
    """Heads to un-interleave for tensor `hf_name` (q/k weights of both towers, encoder q bias), else None."""
    match = re.search(r"self_attn\.([qk])_proj\.(weight|bias)$", hf_name)
    if match is None:
        return None
    if hf_name.startswith("audio_tower."):
        return config.encoder.num_heads  # MHA: k has as many heads as q
    text = config.text if isinstance(config, VoxtralConfig) else config
    return text.num_heads if match.group(1) == "q" else text.num_kv_heads


def interleaved_to_half_split(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorders the rows of each head from native interleaved RoPE pairs to HF half-split order.

    `hf_row[h, j * hd/2 + i] = native_row[h, 2i + j]` for j in {0, 1} (spec §5.5); works on weights
    [heads * head_dim, in] and on biases [heads * head_dim].
    """
    rows, rest = tensor.shape[0], tensor.shape[1:]
    half = rows // num_heads // 2
    return tensor.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
