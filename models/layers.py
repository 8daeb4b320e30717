"""Building blocks shared by the text LMs and Voxtral: RMSNorm, exact RoPE, paged-ring attention, SwiGLU.

The KV cache lives outside the modules as a list of per-layer `(k_pages, v_pages)` tuples (see
`init_kv_cache`); attention blocks take their layer's pair and return it updated.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.tpu_kernels import ring_attention

# Positions are split into this many bit fields for RoPE range reduction; 4 x 8 bits covers every
# non-negative int32 position with 256-row tables.
_ROPE_FIELD_BITS = 8
_ROPE_NUM_FIELDS = 4


class RMSNorm(nnx.Module):
    """y = weight * cast_back(x_f32 * rsqrt(mean(x_f32^2) + eps)), statistics in float32 (as HF)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     llama3_scaling: tuple[float, float, float, int] | None = None) -> np.ndarray:
    """Per-pair rotation frequencies [head_dim // 2] in float64 (HF half-split layout: pair i = (i, i + hd/2))."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if llama3_scaling is None:
        return freqs
    factor, low_freq_factor, high_freq_factor, original_max_positions = llama3_scaling
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


@functools.lru_cache(maxsize=16)
def _angle_tables(freqs: tuple[float, ...]) -> np.ndarray:
    """[fields, 2**bits, len(freqs)] float32: (field_value << (bits * field)) * freq reduced mod 2 pi in float64."""
    rows = np.arange(1 << _ROPE_FIELD_BITS, dtype=np.float64)
    shifts = np.array([float(1 << (_ROPE_FIELD_BITS * f)) for f in range(_ROPE_NUM_FIELDS)])
    angles = (shifts[:, None, None] * rows[None, :, None]) * np.asarray(freqs)[None, None, :]
    return np.mod(angles, 2 * math.pi).astype(np.float32)


def rope_angles(positions, freqs: np.ndarray):
    """Rotation angles [..., len(freqs)] float32 of int32 `positions`, exact for any int32 position.

    `pos * freq` in float32 loses the angle once pos * freq is large (at 5e6 positions the float32
    spacing is 0.5 rad), so the position is split into bit fields whose angles come from tables reduced
    mod 2 pi in float64; the sum of the few reduced field angles stays small and accurate in float32.
    """
    tables = jnp.asarray(_angle_tables(tuple(float(f) for f in freqs)))
    positions = positions.astype(jnp.int32)
    mask = (1 << _ROPE_FIELD_BITS) - 1
    total = jnp.zeros(positions.shape + (len(freqs),), jnp.float32)
    for field in range(_ROPE_NUM_FIELDS):
        # Logical shift so the top field of a (never valid) negative position still indexes in range.
        index = jax.lax.shift_right_logical(positions, _ROPE_FIELD_BITS * field) & mask
        total = total + tables[field][index]
    return total


def rope_cos_sin(positions, freqs: np.ndarray):
    """(cos, sin), each [..., 2 * len(freqs)] float32 in the half-split layout (the angles repeated twice)."""
    angles = rope_angles(positions, freqs)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates x [S, C, H, hd] by per-position (cos, sin) [S, C, hd] (HF `rotate_half` convention)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def chunk_positions(lengths, chunk: int):
    """[S, C] stream positions of a chunk: lengths[s] + arange(C) (derived, never stored)."""
    return lengths[:, None].astype(jnp.int32) + jnp.arange(chunk, dtype=jnp.int32)[None, :]


class Attention(nnx.Module):
    """Multi-head / grouped-query self-attention with RoPE over a paged ring KV cache; `qk_norm_eps` adds Qwen3's
    RMSNorm of each head's queries and keys before RoPE."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, window: int,
                 q_bias: bool = False, k_bias: bool = False, v_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        linear = functools.partial(nnx.Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = linear(hidden_size, num_heads * head_dim, use_bias=q_bias)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=k_bias)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=v_bias)
        self.o_proj = linear(num_heads * head_dim, hidden_size, use_bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.qk_norm = qk_norm_eps is not None
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window

    def __call__(self, x, cos, sin, kv, page_table, lengths, num_new, *, attention_impl=None):
        """x [S, C, hidden]; kv = (k_pages, v_pages) of this layer -> (out [S, C, hidden], kv)."""
        num_sessions, chunk, _ = x.shape
        q = self.q_proj(x).reshape(num_sessions, chunk, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(num_sessions, chunk, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_sessions, chunk, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages, v_pages = kv
        out, k_pages, v_pages = ring_attention(q, k, v, k_pages, v_pages, page_table, lengths, num_new,
                                               window=self.window, implementation=attention_impl)
        out = self.o_proj(out.reshape(num_sessions, chunk, self.num_heads * self.head_dim))
        return out, (k_pages, v_pages)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); only the down projection may carry a bias (Voxtral's encoder)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, down_bias: bool = False, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        linear = functools.partial(nnx.Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = linear(hidden_size, intermediate_size, use_bias=False)
        self.up_proj = linear(hidden_size, intermediate_size, use_bias=False)
        self.down_proj = linear(intermediate_size, hidden_size, use_bias=down_bias)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def init_kv_cache(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                  dtype=jnp.float32) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k_pages, v_pages), each [num_pages, num_kv_heads, page_size, head_dim]; page 0 is null."""
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


def contiguous_page_table(num_sessions: int, window: int, page_size: int) -> tuple[np.ndarray, int]:
    """A fully allocated page table: session s owns pages 1 + s*P .. (s+1)*P, P = ceil(window / page_size).

    Returns (page_table [S, P] int32, num_pages incl. the null page 0). For tests and one-shot paths; the
    engine allocates pages on demand instead.
    """
    pages_per_window = -(-window // page_size)
    table = 1 + np.arange(num_sessions * pages_per_window, dtype=np.int32).reshape(num_sessions, pages_per_window)
    return table, 1 + num_sessions * pages_per_window


def num_parameters(module: nnx.Module) -> int:
    """Parameter count of a module (or of its `nnx.eval_shape` abstract version)."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))
