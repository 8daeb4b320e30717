"""Mistral/Llama/Qwen decoder-only LM (`TextLM`) and the decoder stack Voxtral reuses (`TextDecoder`).

Attribute names mirror Hugging Face (`model.embed_tokens`, `model.layers[i].self_attn.q_proj`, ...), so
checkpoint names map one to one (models/hf_weights.py).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstream.models.config import TextConfig
from jaxstream.models.layers import Attention, RMSNorm, SwiGLU, chunk_positions, rope_cos_sin, rope_frequencies
from jaxstream.models.quantization import Int8Embed


class AdaRMSNorm(nnx.Module):
    """Voxtral's delay-conditioned FFN norm scale: s = linear2(gelu(linear1(t_cond))), no biases, exact GELU."""

    def __init__(self, hidden_size: int, cond_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.linear1 = linear(hidden_size, cond_dim)
        self.linear2 = linear(cond_dim, hidden_size)

    def __call__(self, t_cond):
        return self.linear2(jax.nn.gelu(self.linear1(t_cond), approximate=False))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   window=cfg.attention_window, q_bias=cfg.qkv_bias, k_bias=cfg.qkv_bias,
                                   v_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                   qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype,
                                                param_dtype=param_dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.ada_rms_norm = AdaRMSNorm(cfg.hidden_size, cfg.ada_t_cond_dim, **kw) if cfg.ada_t_cond_dim else None

    def __call__(self, x, cos, sin, kv, page_table, lengths, num_new, *, t_cond=None, attention_impl=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, page_table, lengths, num_new,
                                  attention_impl=attention_impl)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if self.ada_rms_norm is not None:
            h = h * (1 + self.ada_rms_norm(t_cond)[:, None, :])
        return x + self.mlp(h), kv


class TextDecoder(nnx.Module):
    """Embedding, decoder layers and final norm (HF `model` of a causal LM; Voxtral's `language_model`)."""

    def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype,
                                      param_dtype=param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, embeds, cache, page_table, lengths, num_new, *, t_cond=None, attention_impl=None):
        """embeds [S, C, D] input embeddings -> (final-normed hidden [S, C, D], updated cache)."""
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the decoder has {len(self.layers)}")
        freqs = rope_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_llama3_scaling)
        cos, sin = rope_cos_sin(chunk_positions(lengths, embeds.shape[1]), freqs)
        x = embeds
        new_cache = []
        for layer, kv in zip(self.layers, cache):
            x, kv = layer(x, cos, sin, kv, page_table, lengths, num_new, t_cond=t_cond,
                          attention_impl=attention_impl)
            new_cache.append(kv)
        return self.norm(x), new_cache


def check_session_arrays(num_sessions: int, page_table, **per_session) -> None:
    """Clear errors for mis-shaped step metadata (static shapes, so this also runs under jit)."""
    for name, value in per_session.items():
        if value.shape != (num_sessions,):
            raise ValueError(f"{name} must have shape [{num_sessions}], got {value.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != num_sessions:
        raise ValueError(f"page_table must be [{num_sessions}, pages_per_window], got {page_table.shape}")


def check_token_ids(token_ids) -> None:
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [sessions, chunk], got shape {token_ids.shape}")


def select_logit_rows(hidden, logits_at):
    """hidden [S, C, D] -> [S, D] at chunk index logits_at[s], or unchanged when logits_at is None."""
    if logits_at is None:
        return hidden
    if logits_at.shape != hidden.shape[:1]:
        raise ValueError(f"logits_at must have shape [{hidden.shape[0]}], got {logits_at.shape}")
    return jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]


def tied_logits(hidden, embedding):
    """float32 logits of a tied head: hidden @ E^T."""
    return jnp.einsum("...d,vd->...v", hidden, embedding.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def embedding_logits(hidden, embed):
    """float32 logits of the tied head over `embed`, an `nnx.Embed` or its int8 form (models/quantization.py)."""
    if isinstance(embed, Int8Embed):
        return embed.attend(hidden)
    return tied_logits(hidden, embed.embedding[...])


class TextLM(nnx.Module):
    """Mistral/Llama/Qwen causal LM over a paged ring KV cache (one call = chunked prefill or decode, C = 1)."""

    def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if cfg.ada_t_cond_dim:
            raise ValueError("a TextConfig with ada_t_cond_dim belongs to VoxtralRealtime, not TextLM")
        self.cfg = cfg
        self.model = TextDecoder(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs, dtype=dtype,
                                      param_dtype=param_dtype, preferred_element_type=jnp.float32)

    def __call__(self, token_ids, cache, page_table, lengths, num_new, *, logits_at=None, attention_impl=None):
        """token_ids [S, C] -> (float32 logits [S, C, V], or [S, V] at `logits_at`; updated cache)."""
        hidden, cache = self.hidden_states(token_ids, cache, page_table, lengths, num_new,
                                           attention_impl=attention_impl)
        return self.logits(select_logit_rows(hidden, logits_at)), cache

    def hidden_states(self, token_ids, cache, page_table, lengths, num_new, *, attention_impl=None):
        """token_ids [S, C] -> (the decoder's final-normed hidden states [S, C, D], updated cache): what `logits`
        takes, for a caller that wants the logits of more positions than one a row, a few at a time."""
        check_token_ids(token_ids)
        check_session_arrays(token_ids.shape[0], page_table, lengths=lengths, num_new=num_new)
        return self.model(self.model.embed_tokens(token_ids), cache, page_table, lengths, num_new,
                          attention_impl=attention_impl)

    def logits(self, hidden):
        """float32 logits [..., V] of final hidden states [..., D] (the LM head, tied or not)."""
        if self.cfg.tie_embeddings:
            return embedding_logits(hidden, self.model.embed_tokens)
        return self.lm_head(hidden).astype(jnp.float32)

    def with_attention_window(self, window: int) -> "TextLM":
        """This model attending over at most the last `window` positions, sharing its parameters.

        Its outputs equal the model's for sequences of at most `window` positions (both windows then hold
        every earlier position). The engine serves a model this way when `max_model_len` is below its
        window: the KV ring then holds only `max_model_len` positions, and the attention kernel must be
        given the window that ring covers, not one it cannot hold.
        """
        cfg = dataclasses.replace(self.cfg, sliding_window=min(window, self.cfg.attention_window))
        view = nnx.merge(*nnx.split(self))  # new modules over the same parameter variables
        view.cfg = view.model.cfg = cfg
        for layer in view.model.layers:
            layer.self_attn.window = cfg.attention_window
        return view
