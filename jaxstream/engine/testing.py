"""A deterministic toy language model for engine tests and host-overhead benchmarks.

`ToyLM` has TextLM's call signature and really stores and reads its context through the paged ring KV
cache (`ring_attention` with all-zero queries and keys, i.e. uniform attention), so page-table, ring or
scheduling mistakes change its outputs. Its greedy next token after the context c_0..c_p (the window's
last W positions, the current token included) is

    (3 * sum(c_j) + 5 * sum(c_j * (j % 7 + 1)) + p) mod V

which `toy_next_token` computes in plain Python as the test oracle. Its logits fall off with the circular
distance from that token, so temperature / top-k / top-p sampling have a non-trivial distribution.
"""
import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxstream.models.config import TextConfig
from jaxstream.tpu_kernels import ring_attention


def toy_config(vocab_size=97, window=32, num_layers=2, max_positions=4096) -> TextConfig:
    return TextConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_layers=num_layers,
                      num_heads=1, num_kv_heads=1, head_dim=8, sliding_window=window,
                      max_positions=max_positions)


def toy_next_token(context, cfg: TextConfig) -> int:
    """The toy model's greedy token after `context` (every KV-valid token, the newest one last)."""
    last = len(context) - 1
    first = max(0, last - cfg.attention_window + 1)
    plain = sum(context[j] for j in range(first, last + 1))
    weighted = sum(context[j] * (j % 7 + 1) for j in range(first, last + 1))
    return (3 * plain + 5 * weighted + last) % cfg.vocab_size


def toy_logits(context, cfg: TextConfig, sharpness=1.0):
    """The toy model's logits after `context`, in numpy-compatible jnp (for sampling oracles)."""
    target = toy_next_token(context, cfg)
    vocab = jnp.arange(cfg.vocab_size)
    distance = jnp.minimum(jnp.abs(vocab - target), cfg.vocab_size - jnp.abs(vocab - target))
    return -sharpness * distance.astype(jnp.float32)


class ToyLM(nnx.Module):
    def __init__(self, cfg: TextConfig, *, rngs=None, sharpness=1.0):
        del rngs
        self.cfg = cfg
        self.sharpness = nnx.Param(jnp.asarray(sharpness, jnp.float32))

    def __call__(self, token_ids, cache, page_table, lengths, num_new, *, logits_at=None, attention_impl=None):
        cfg = self.cfg
        num_sessions, chunk = token_ids.shape
        pos = lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        tokens = token_ids.astype(jnp.float32)
        values = jnp.zeros((num_sessions, chunk, 1, cfg.head_dim), jnp.float32)
        values = values.at[..., 0, 0].set(tokens).at[..., 0, 1].set(tokens * (pos % 7 + 1))
        zeros = jnp.zeros_like(values)
        new_cache = []
        for k_pages, v_pages in cache:
            out, k_pages, v_pages = ring_attention(
                zeros, zeros, values.astype(k_pages.dtype), k_pages, v_pages, page_table, lengths, num_new,
                window=cfg.attention_window, implementation=attention_impl)
            new_cache.append((k_pages, v_pages))
        count = jnp.minimum(pos + 1, cfg.attention_window).astype(jnp.float32)
        plain = jnp.round(out[..., 0, 0].astype(jnp.float32) * count).astype(jnp.int32)
        weighted = jnp.round(out[..., 0, 1].astype(jnp.float32) * count).astype(jnp.int32)
        target = (3 * plain + 5 * weighted + pos) % cfg.vocab_size
        vocab = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
        distance = jnp.abs(vocab - target[..., None])
        distance = jnp.minimum(distance, cfg.vocab_size - distance)
        logits = -self.sharpness[...] * distance.astype(jnp.float32)
        if logits_at is not None:
            logits = jnp.take_along_axis(logits, logits_at[:, None, None], axis=1)[:, 0]
        return logits, new_cache

    def with_attention_window(self, window: int) -> "ToyLM":
        """TextLM's contract (models/text_lm.py): the same parameters over at most `window` positions."""
        view = nnx.merge(*nnx.split(self))
        view.cfg = dataclasses.replace(self.cfg, sliding_window=min(window, self.cfg.attention_window))
        return view
