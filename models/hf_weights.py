"""Hugging Face safetensors (on-disk, legacy names) -> NNX state of `TextLM` / `VoxtralRealtime`.

`hf_name_map(cfg)` names every tensor a checkpoint must hold, the NNX state path it fills and the layout
transform (PyTorch Linear [out, in] -> kernel [in, out]; Conv1d [out, in, k] -> kernel [k, in, out]);
`expected_shapes(cfg)` gives the on-disk shapes. `state_from_hf` checks a name -> array dict against both
and returns a pure state dict for `nnx.replace_by_pure_dict`; `load_hf_weights` fills a module in place.
Checkpoint discovery, Mistral-native names, dtype policy and streaming reads live in the loaders.
"""
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxstream.models.config import EncoderConfig, TextConfig, VoxtralConfig

Path = tuple[str | int, ...]


def linear_kernel(weight: np.ndarray) -> np.ndarray:
    """PyTorch Linear weight [out, in] -> NNX Linear kernel [in, out]."""
    return weight.T


def conv_kernel(weight: np.ndarray) -> np.ndarray:
    """PyTorch Conv1d weight [out, in, k] -> NNX Conv kernel [k, in, out]."""
    return weight.transpose(2, 1, 0)


def unchanged(weight: np.ndarray) -> np.ndarray:
    return weight


class HFTensor(NamedTuple):
    path: Path  # NNX state path, e.g. ("model", "layers", 0, "self_attn", "q_proj", "kernel")
    transform: Callable[[np.ndarray], np.ndarray]  # on-disk layout -> NNX layout
    shape: tuple[int, ...]  # on-disk shape


# Non-persistent buffers that some checkpoints still carry; never parameters.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


class _Builder:
    def __init__(self):
        self.entries: dict[str, HFTensor] = {}

    def linear(self, hf: str, path: Path, in_features: int, out_features: int, bias: bool = False):
        self.entries[f"{hf}.weight"] = HFTensor(path + ("kernel",), linear_kernel, (out_features, in_features))
        if bias:
            self.entries[f"{hf}.bias"] = HFTensor(path + ("bias",), unchanged, (out_features,))

    def conv(self, hf: str, path: Path, in_channels: int, out_channels: int, kernel_size: int):
        self.entries[f"{hf}.weight"] = HFTensor(path + ("kernel",), conv_kernel,
                                                (out_channels, in_channels, kernel_size))
        self.entries[f"{hf}.bias"] = HFTensor(path + ("bias",), unchanged, (out_channels,))

    def vector(self, hf: str, path: Path, dim: int):
        self.entries[f"{hf}.weight"] = HFTensor(path + ("weight",), unchanged, (dim,))

    def decoder(self, cfg: TextConfig, hf: str, path: Path):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.entries[f"{hf}embed_tokens.weight"] = HFTensor(path + ("embed_tokens", "embedding"), unchanged,
                                                            (cfg.vocab_size, d))
        for i in range(cfg.num_layers):
            name, at = f"{hf}layers.{i}.", path + ("layers", i)
            self.vector(name + "input_layernorm", at + ("input_layernorm",), d)
            self.vector(name + "post_attention_layernorm", at + ("post_attention_layernorm",), d)
            attn, attn_at = name + "self_attn.", at + ("self_attn",)
            self.linear(attn + "q_proj", attn_at + ("q_proj",), d, cfg.num_heads * hd, bias=cfg.qkv_bias)
            self.linear(attn + "k_proj", attn_at + ("k_proj",), d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
            self.linear(attn + "v_proj", attn_at + ("v_proj",), d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
            self.linear(attn + "o_proj", attn_at + ("o_proj",), cfg.num_heads * hd, d, bias=cfg.o_bias)
            if cfg.qk_norm:
                self.vector(attn + "q_norm", attn_at + ("q_norm",), hd)
                self.vector(attn + "k_norm", attn_at + ("k_norm",), hd)
            self._mlp(name + "mlp.", at + ("mlp",), d, cfg.intermediate_size, down_bias=False)
            if cfg.ada_t_cond_dim:
                self.linear(name + "ada_rms_norm.linear1", at + ("ada_rms_norm", "linear1"), d, cfg.ada_t_cond_dim)
                self.linear(name + "ada_rms_norm.linear2", at + ("ada_rms_norm", "linear2"), cfg.ada_t_cond_dim, d)
        self.vector(f"{hf}norm", path + ("norm",), d)

    def encoder(self, cfg: EncoderConfig, hf: str, path: Path):
        d, inner = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.conv(f"{hf}embedder.conv1", path + ("embedder", "conv1"), cfg.num_mel_bins, d, 3)
        self.conv(f"{hf}embedder.conv2", path + ("embedder", "conv2"), d, d, 3)
        for i in range(cfg.num_layers):
            name, at = f"{hf}layers.{i}.", path + ("layers", i)
            self.vector(name + "self_attn_layer_norm", at + ("self_attn_layer_norm",), d)
            self.vector(name + "final_layer_norm", at + ("final_layer_norm",), d)
            attn, attn_at = name + "self_attn.", at + ("self_attn",)
            self.linear(attn + "q_proj", attn_at + ("q_proj",), d, inner, bias=True)
            self.linear(attn + "k_proj", attn_at + ("k_proj",), d, inner)
            self.linear(attn + "v_proj", attn_at + ("v_proj",), d, inner, bias=True)
            self.linear(attn + "o_proj", attn_at + ("o_proj",), inner, d, bias=True)
            self._mlp(name + "mlp.", at + ("mlp",), d, cfg.intermediate_size, down_bias=True)
        self.vector(f"{hf}norm", path + ("norm",), d)

    def _mlp(self, hf: str, path: Path, d: int, inner: int, *, down_bias: bool):
        self.linear(hf + "gate_proj", path + ("gate_proj",), d, inner)
        self.linear(hf + "up_proj", path + ("up_proj",), d, inner)
        self.linear(hf + "down_proj", path + ("down_proj",), inner, d, bias=down_bias)


def hf_name_map(cfg: TextConfig | VoxtralConfig) -> dict[str, HFTensor]:
    """Every required on-disk HF tensor name -> (NNX state path, layout transform, on-disk shape)."""
    builder = _Builder()
    if isinstance(cfg, VoxtralConfig):
        builder.encoder(cfg.encoder, "audio_tower.", ("audio_tower",))
        text = cfg.text
        builder.linear("multi_modal_projector.linear_1", ("multi_modal_projector", "linear_1"),
                       cfg.encoder.hidden_size * cfg.downsample_factor, text.hidden_size)
        builder.linear("multi_modal_projector.linear_2", ("multi_modal_projector", "linear_2"),
                       text.hidden_size, text.hidden_size)
        builder.decoder(text, "language_model.model.", ("language_model",))
    else:
        builder.decoder(cfg, "model.", ("model",))
        if not cfg.tie_embeddings:
            builder.linear("lm_head", ("lm_head",), cfg.hidden_size, cfg.vocab_size)
    return builder.entries


def expected_shapes(cfg: TextConfig | VoxtralConfig) -> dict[str, tuple[int, ...]]:
    """On-disk HF tensor name -> shape, for every tensor the checkpoint must hold."""
    return {name: entry.shape for name, entry in hf_name_map(cfg).items()}


def ignorable_names(cfg: TextConfig | VoxtralConfig) -> frozenset[str]:
    """Names a checkpoint may hold that carry no parameter here (a tied head's duplicate)."""
    if isinstance(cfg, VoxtralConfig):
        return frozenset({"language_model.lm_head.weight"})
    return frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the configuration (missing, mis-shaped or unexpected)."""


def _summarise(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")
    return f"{len(items)} {kind}: {shown}"


def check_tensor_names(cfg: TextConfig | VoxtralConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raises CheckpointMismatchError listing missing, mis-shaped and unexpected tensors (name -> shape)."""
    wanted = expected_shapes(cfg)
    ignored = ignorable_names(cfg)
    missing = sorted(set(wanted) - set(shapes))
    unexpected = sorted(n for n in shapes if n not in wanted and n not in ignored and not _IGNORED.match(n))
    misshaped = sorted(f"{n} {tuple(shapes[n])} (expected {wanted[n]})"
                       for n in set(wanted) & set(shapes) if tuple(shapes[n]) != wanted[n])
    problems = [_summarise(kind, items) for kind, items in
                (("missing", missing), ("mis-shaped", misshaped), ("unexpected", unexpected)) if items]
    if problems:
        raise CheckpointMismatchError("checkpoint does not match the model configuration: " + "; ".join(problems))


def state_from_hf(cfg: TextConfig | VoxtralConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Checks `tensors` (on-disk HF name -> array) and returns the nested pure state dict (NNX layouts,
    dtypes unchanged) for `nnx.replace_by_pure_dict`."""
    check_tensor_names(cfg, {name: np.shape(value) for name, value in tensors.items()})
    state: dict = {}
    for name, entry in hf_name_map(cfg).items():
        node = state
        for key in entry.path[:-1]:
            node = node.setdefault(key, {})
        node[entry.path[-1]] = entry.transform(np.asarray(tensors[name]))
    return state


def load_hf_weights(model: nnx.Module, tensors: Mapping[str, np.ndarray]) -> None:
    """Fills `model` (TextLM or VoxtralRealtime) in place from HF tensors, cast to each parameter's dtype."""
    pure = state_from_hf(model.cfg, tensors)
    state = nnx.state(model, nnx.Param)
    params = dict(nnx.to_flat_state(state))
    flat = traverse_util.flatten_dict(pure)
    if set(flat) != set(params):
        raise CheckpointMismatchError(f"name map and module disagree on {sorted(set(flat) ^ set(params))[:5]}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
        {path: jnp.asarray(value, dtype=params[path].dtype) for path, value in flat.items()}))
    nnx.update(model, state)
