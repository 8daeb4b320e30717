"""Voxtral Realtime: causal conv stem + sliding-window audio encoder + 4x frame-stacking adapter, feeding a
delay-conditioned (ada-RMSNorm) Mistral decoder with a tied head (specs/voxtral_realtime.md §2-§4).

Streaming: `audio_step` turns C decoder slots of mel frames (8 per 80 ms slot) into C audio embeddings,
carrying the conv stem's left context in `ConvState` and the encoder's KV in a paged ring; `text_step` runs
the decoder on token embedding + audio embedding. One big chunk through both is the offline forward.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.models.audio import ALLOWED_DELAYS_MS, ALLOWED_DELAYS_TEXT, SLOT_MS
from jaxstream.models.config import EncoderConfig, VoxtralConfig
from jaxstream.models.layers import (
    Attention, RMSNorm, SwiGLU, chunk_positions, contiguous_page_table, init_kv_cache, rope_cos_sin,
    rope_frequencies,
)
from jaxstream.models.text_lm import (
    TextDecoder, check_session_arrays, check_token_ids, embedding_logits, select_logit_rows,
)

# Causal left padding of the two stem convolutions (kernel - stride): the input frames carried over.
CONV1_CONTEXT = 2
CONV2_CONTEXT = 1
CONV_STRIDE = 2
T_COND_THETA = 10000.0
# Delays the model was trained for, in 80 ms decoder slots.
SUPPORTED_DELAY_TOKENS = frozenset(ms // SLOT_MS for ms in ALLOWED_DELAYS_MS)


class ConvState(NamedTuple):
    """Streaming state of the conv stem: the last input frames each causal conv needs (zeros at start)."""

    conv1: jax.Array  # [S, 2, n_mel] last mel frames
    conv2: jax.Array  # [S, 1, encoder hidden] last conv1 output frame


def conv_state_shapes(cfg: VoxtralConfig, num_sessions: int) -> ConvState:
    return ConvState((num_sessions, CONV1_CONTEXT, cfg.encoder.num_mel_bins),
                     (num_sessions, CONV2_CONTEXT, cfg.encoder.hidden_size))


def init_conv_state(cfg: VoxtralConfig, num_sessions: int, dtype=jnp.float32) -> ConvState:
    return ConvState(*(jnp.zeros(shape, dtype) for shape in conv_state_shapes(cfg, num_sessions)))


def check_delay_tokens(n_delay) -> None:
    """Raises a clear error for a concrete delay the model does not support (traced values pass through)."""
    try:
        values = np.atleast_1d(np.asarray(n_delay, np.float64))
    except jax.errors.TracerArrayConversionError:
        return
    for value in values:
        if value not in SUPPORTED_DELAY_TOKENS:
            raise ValueError(f"unsupported transcription delay of {value:g} slots ({SLOT_MS * value:g} ms); "
                             f"the delay in ms must be {ALLOWED_DELAYS_TEXT}")


def _last_valid_frames(frames, end, count: int):
    """frames [S, T, F] -> frames[s, end[s] - count : end[s]] as [S, count, F] (per-row dynamic window)."""
    index = end[:, None] - count + jnp.arange(count, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(frames, index[:, :, None], axis=1)


class ConvStem(nnx.Module):
    """conv1 (k3, s1) -> GELU -> conv2 (k3, s2) -> GELU, causal (left context only), streaming via ConvState."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        conv = functools.partial(nnx.Conv, kernel_size=(3,), padding="VALID", use_bias=True, rngs=rngs,
                                 dtype=dtype, param_dtype=param_dtype)
        self.conv1 = conv(cfg.num_mel_bins, cfg.hidden_size, strides=(1,))
        self.conv2 = conv(cfg.hidden_size, cfg.hidden_size, strides=(CONV_STRIDE,))

    def __call__(self, mel, state: ConvState, num_valid_frames):
        """mel [S, T, n_mel] (T even), num_valid_frames [S] (even) -> (frames [S, T/2, hidden], state)."""
        x1 = jnp.concatenate([state.conv1.astype(mel.dtype), mel], axis=1)
        h1 = jax.nn.gelu(self.conv1(x1), approximate=False)
        x2 = jnp.concatenate([state.conv2.astype(h1.dtype), h1], axis=1)
        h2 = jax.nn.gelu(self.conv2(x2), approximate=False)
        # The inputs are offset by the carried context, so the last valid frames end at num_valid + context;
        # for a padding row (num_valid 0) this returns the old state unchanged.
        new_state = ConvState(
            _last_valid_frames(x1, num_valid_frames + CONV1_CONTEXT, CONV1_CONTEXT).astype(state.conv1.dtype),
            _last_valid_frames(x2, num_valid_frames + CONV2_CONTEXT, CONV2_CONTEXT).astype(state.conv2.dtype))
        return h2, new_state


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        norm = functools.partial(RMSNorm, cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn_layer_norm = norm()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_heads, cfg.head_dim,
                                   window=cfg.sliding_window, q_bias=True, v_bias=True, o_bias=True, **kw)
        self.final_layer_norm = norm()
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, down_bias=True, **kw)

    def __call__(self, x, cos, sin, kv, page_table, lengths, num_new, *, attention_impl=None):
        attn, kv = self.self_attn(self.self_attn_layer_norm(x), cos, sin, kv, page_table, lengths, num_new,
                                  attention_impl=attention_impl)
        x = x + attn
        return x + self.mlp(self.final_layer_norm(x)), kv


class AudioEncoder(nnx.Module):
    """HF `audio_tower`: conv stem + pre-norm transformer (absolute-position RoPE, sliding window) + norm."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embedder = ConvStem(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, mel, conv_state, cache, page_table, lengths, num_valid_frames, *, attention_impl=None):
        """mel [S, T, n_mel] -> (post-norm encoder frames [S, T/2, hidden], conv_state, cache).

        `lengths` [S] = encoder frames written before (their absolute indices are the RoPE positions);
        `num_valid_frames` [S] = valid (even) mel frames of each row.
        """
        if len(cache) != len(self.layers):
            raise ValueError(f"encoder cache has {len(cache)} layers, the encoder has {len(self.layers)}")
        x, conv_state = self.embedder(mel.astype(self.dtype), conv_state, num_valid_frames)
        num_new = num_valid_frames // CONV_STRIDE
        freqs = rope_frequencies(self.cfg.head_dim, self.cfg.rope_theta)
        cos, sin = rope_cos_sin(chunk_positions(lengths, x.shape[1]), freqs)
        new_cache = []
        for layer, kv in zip(self.layers, cache):
            x, kv = layer(x, cos, sin, kv, page_table, lengths, num_new, attention_impl=attention_impl)
            new_cache.append(kv)
        return self.norm(x), conv_state, new_cache


class MultiModalProjector(nnx.Module):
    """The adapter: stacked encoder frames -> linear_1 -> exact GELU -> linear_2 (no biases)."""

    def __init__(self, in_features: int, hidden_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.linear_1 = linear(in_features, hidden_size)
        self.linear_2 = linear(hidden_size, hidden_size)

    def __call__(self, x):
        return self.linear_2(jax.nn.gelu(self.linear_1(x), approximate=False))


def time_condition(n_delay, hidden_size: int, dtype):
    """t_cond [S, D] = concat(cos(n * inv_freq), sin(n * inv_freq)), theta 1e4, in the embedding dtype (as HF)."""
    half = hidden_size // 2
    inv_freq = jnp.exp(-np.log(T_COND_THETA) * jnp.arange(half, dtype=jnp.float32) / half).astype(dtype)
    angle = n_delay.astype(dtype)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=-1)


class VoxtralRealtime(nnx.Module):
    """Voxtral-Mini-4B-Realtime-2602 (and tiny variants); attribute tree mirrors HF's names."""

    def __init__(self, cfg: VoxtralConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if cfg.mel_frames_per_token != CONV_STRIDE * cfg.downsample_factor:
            raise ValueError(f"mel_frames_per_token={cfg.mel_frames_per_token} must equal {CONV_STRIDE} (conv "
                             f"stride) x downsample_factor={cfg.downsample_factor}")
        if not cfg.text.tie_embeddings or not cfg.text.ada_t_cond_dim:
            raise ValueError("Voxtral Realtime's decoder needs tie_embeddings=True and ada_t_cond_dim > 0")
        self.cfg = cfg
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.audio_tower = AudioEncoder(cfg.encoder, **kw)
        self.multi_modal_projector = MultiModalProjector(cfg.encoder.hidden_size * cfg.downsample_factor,
                                                         cfg.text.hidden_size, **kw)
        self.language_model = TextDecoder(cfg.text, **kw)
        self.dtype = dtype

    def audio_step(self, mel, conv_state, enc_cache, enc_page_table, enc_lengths, num_slots, *,
                   attention_impl=None):
        """mel [S, 8C, n_mel] of C slots -> (audio_embeds [S, C, D], conv_state, enc_cache).

        enc_lengths [S] = encoder frames written so far (4 per slot); num_slots [S] valid slots (<= C);
        padding rows do not advance the conv state or the cache.
        """
        cfg = self.cfg
        if mel.ndim != 3 or mel.shape[-1] != cfg.encoder.num_mel_bins or mel.shape[1] % cfg.mel_frames_per_token:
            raise ValueError(f"mel must be [sessions, {cfg.mel_frames_per_token} * slots, "
                             f"{cfg.encoder.num_mel_bins}], got shape {mel.shape}")
        num_sessions, num_frames, _ = mel.shape
        for name, have, want in zip(ConvState._fields, conv_state, conv_state_shapes(cfg, num_sessions)):
            if have.shape != want:
                raise ValueError(f"conv_state.{name} must have shape {want}, got {have.shape}")
        check_session_arrays(num_sessions, enc_page_table, enc_lengths=enc_lengths, num_slots=num_slots)
        frames, conv_state, enc_cache = self.audio_tower(
            mel, conv_state, enc_cache, enc_page_table, enc_lengths, num_slots * cfg.mel_frames_per_token,
            attention_impl=attention_impl)
        num_slots_in_chunk = num_frames // cfg.mel_frames_per_token
        stacked = frames.reshape(num_sessions, num_slots_in_chunk, cfg.downsample_factor * cfg.encoder.hidden_size)
        return self.multi_modal_projector(stacked), conv_state, enc_cache

    def text_step(self, token_ids, audio_embeds, n_delay, cache, page_table, lengths, num_new, *, logits_at=None,
                  attention_impl=None):
        """Decoder over E[token] + audio_embed, conditioned on n_delay [S] (delay in 80 ms slots, float).

        Returns (float32 logits [S, C, V], or [S, V] at chunk indices `logits_at`; updated cache).
        """
        check_token_ids(token_ids)
        n_delay = jnp.asarray(n_delay)
        check_session_arrays(token_ids.shape[0], page_table, lengths=lengths, num_new=num_new, n_delay=n_delay)
        expected = token_ids.shape + (self.cfg.text.hidden_size,)
        if audio_embeds.shape != expected:
            raise ValueError(f"audio_embeds must have shape {expected}, got {audio_embeds.shape}")
        check_delay_tokens(n_delay)
        embed = self.language_model.embed_tokens
        embeds = embed(token_ids) + audio_embeds.astype(embed.dtype)
        t_cond = time_condition(n_delay, self.cfg.text.hidden_size, embed.dtype)
        hidden, cache = self.language_model(embeds, cache, page_table, lengths, num_new, t_cond=t_cond,
                                            attention_impl=attention_impl)
        return embedding_logits(select_logit_rows(hidden, logits_at), embed), cache

    def init_caches(self, num_sessions: int, *, cache_dtype=None):
        """Fresh one-shot state for S sessions: (conv_state, (enc_cache, enc_page_table), (cache, page_table)),
        each ring a single page of the full window per session (for offline use and tests)."""
        cache_dtype = cache_dtype or self.dtype
        enc, text = self.cfg.encoder, self.cfg.text
        enc_table, enc_pages = contiguous_page_table(num_sessions, enc.sliding_window, enc.sliding_window)
        dec_table, dec_pages = contiguous_page_table(num_sessions, text.attention_window, text.attention_window)
        enc_cache = init_kv_cache(enc.num_layers, enc_pages, enc.num_heads, enc.sliding_window, enc.head_dim,
                                  cache_dtype)
        cache = init_kv_cache(text.num_layers, dec_pages, text.num_kv_heads, text.attention_window, text.head_dim,
                              cache_dtype)
        conv_state = init_conv_state(self.cfg, num_sessions, self.dtype)
        return conv_state, (enc_cache, jnp.asarray(enc_table)), (cache, jnp.asarray(dec_table))

    def offline_logits(self, mel, token_ids, n_delay, *, attention_impl=None):
        """Full-sequence forward (one fresh cache, one chunk through audio_step and text_step).

        mel [S, 8N, n_mel], token_ids [S, N], n_delay [S] -> float32 logits [S, N, V].
        """
        num_sessions, num_tokens = token_ids.shape
        if mel.shape[:2] != (num_sessions, num_tokens * self.cfg.mel_frames_per_token):
            raise ValueError(f"mel must be [{num_sessions}, {num_tokens * self.cfg.mel_frames_per_token}, n_mel] "
                             f"for token_ids of shape {token_ids.shape}, got {mel.shape}")
        conv_state, (enc_cache, enc_table), (cache, table) = self.init_caches(num_sessions)
        zeros = jnp.zeros((num_sessions,), jnp.int32)
        full = jnp.full((num_sessions,), num_tokens, jnp.int32)
        audio_embeds, _, _ = self.audio_step(mel, conv_state, enc_cache, enc_table, zeros, full,
                                             attention_impl=attention_impl)
        logits, _ = self.text_step(token_ids, audio_embeds, n_delay, cache, table, zeros, full,
                                   attention_impl=attention_impl)
        return logits
