"""Pieces shared by the two Pallas kernels of `ring_attention`.

- Launch plumbing: where a kernel runs (TPU Mosaic, GPU Triton, or one of the two CPU interpreters)
  changes only the spec of the per-session scalars and the `pallas_call` keyword arguments.
- Layout: the wrapper folds the GQA group into query rows, `[S, C, Hq, D] -> [S, Hkv, C*G, D]` with
  token-major rows (row r is token `r div G`), because the TPU interpreter rejects `ref.reshape`; it pads
  rows and chunk keys to powers of two of at least 16, which Triton's `tl.dot` (M, N, K >= 16,
  power-of-two shapes) needs and which fills whole bf16 sublane tiles on TPU.
- Math: the score product and one online-softmax step over a block of keys.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxstream.tpu_kernels.ring_attention import positions

# Finite "minus infinity": m - m_new stays finite when a whole block is masked.
MASK_VALUE = -1e30
LANES = 128
MIN_TILE = 16
# Keys of the chunk processed per step of the in-kernel loop over the chunk.
CHUNK_BLOCK = 128


def target_of(interpret, platform):
    """Which lowering a kernel is built for: "tpu" (Mosaic or the TPU interpreter), "gpu" (Triton) or
    "interpret" (the generic interpreter, which takes the Triton-style specs so CI covers them)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return "tpu"
    if interpret:
        return "interpret"
    target = compiled_target(platform)
    if target is None:
        # The advice to run the interpreter instead is the dispatcher's (`api.choose_implementation`): an
        # engine, which shares this reason, has no such option.
        backend = platform or jax.default_backend()
        raise NotImplementedError(f"Pallas kernels need a TPU or GPU (backend is {backend!r})")
    return target


def compiled_target(platform):
    """The compiled lowering on `platform` (default backend): "tpu" (Mosaic), "gpu" (Triton), or None."""
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    return None


def triton_available():
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def call_kwargs(target, interpret, dimension_semantics):
    """`pallas_call` keyword arguments (compiler params, interpreter) of a target."""
    if target == "tpu":
        kwargs = dict(compiler_params=pltpu.CompilerParams(dimension_semantics=dimension_semantics))
        if interpret:
            kwargs["interpret"] = interpret
        return kwargs
    if target == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return dict(compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2))
    return dict(interpret=True)


def scalar_spec(target, size):
    """Spec of a small int32 vector read element-wise in the kernel: scalar memory on TPU, one whole block
    (a pointer) on Triton, where `size` must be a power of two."""
    if target == "tpu":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((size,), lambda *_: (0,))


def next_power_of_two(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def padded_rows(chunk, group):
    return max(MIN_TILE, next_power_of_two(chunk * group))


def padded_chunk(chunk):
    return max(MIN_TILE, next_power_of_two(chunk))


def chunk_block(chunk_keys, limit=CHUNK_BLOCK):
    return min(chunk_keys, limit)


def pad_axis(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def fold_queries(q, num_kv_heads):
    """[S, C, Hq, D] -> [S, Hkv, rows, D], rows token-major (query head h*G + g of token i is row i*G + g)."""
    sessions, chunk, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    folded = q.reshape(sessions, chunk, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    folded = folded.reshape(sessions, num_kv_heads, chunk * group, head_dim)
    return pad_axis(folded, 2, padded_rows(chunk, group))


def unfold_output(out, q_shape):
    """Inverse of `fold_queries`: [S, Hkv, rows, D] -> [S, C, Hq, D], dropping the padding rows."""
    sessions, chunk, num_q_heads, head_dim = q_shape
    num_kv_heads = out.shape[1]
    group = num_q_heads // num_kv_heads
    out = out[:, :, : chunk * group].reshape(sessions, num_kv_heads, chunk, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(q_shape)


def chunk_keys_by_head(x, dtype):
    """[S, C, Hkv, D] -> [S, Hkv, C_pad, D] in the compute dtype, padded with zero keys (never valid)."""
    return pad_axis(x.astype(dtype).transpose(0, 2, 1, 3), 2, padded_chunk(x.shape[1]))


class KernelOperands(NamedTuple):
    """The kernel-layout operands and static sizes both Pallas wrappers start from."""

    q_rows: jax.Array  # [S, Hkv, rows, D] folded queries
    k_chunk: jax.Array  # [S, Hkv, C_pad, D]
    v_chunk: jax.Array
    num_new: jax.Array  # [S] clipped to [0, C]
    group: int
    scale: float


def kernel_operands(q, k_new, v_new, num_kv_heads, num_new, scale) -> KernelOperands:
    head_dim = q.shape[-1]
    return KernelOperands(
        q_rows=fold_queries(q, num_kv_heads),
        k_chunk=chunk_keys_by_head(k_new, q.dtype),
        v_chunk=chunk_keys_by_head(v_new, q.dtype),
        num_new=jnp.clip(num_new, 0, q.shape[1]),
        group=q.shape[2] // num_kv_heads,
        scale=head_dim**-0.5 if scale is None else scale,
    )


def scores(q, k, scale):
    """[M, D] x [N, D] -> [M, N] in f32, an "NT" dot that is native on the MXU and `tl.dot`."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale


def online_softmax_step(s, valid, v, carry):
    """One flash-attention update of (m [M,1], l [M,1], acc [M,D]) by scores s [M,N] and values v [N,D].

    Masked probabilities are forced to 0, so a fully masked block (or an empty session) leaves the state
    unchanged and the output of a row with no visible key is 0, not NaN, whatever the masked pages hold.
    """
    m, l, acc = carry
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    # Masked keys can be stale page contents (another session's, or padding rows): 0 x NaN is NaN, so
    # non-finite values are replaced rather than multiplied by their zero probability. (Mosaic tests
    # finiteness of f32 only.)
    v = jnp.where(jnp.isfinite(v.astype(jnp.float32)), v, jnp.zeros((), v.dtype))
    acc_new = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


def initial_state(rows, head_dim):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def normalise(l, acc, dtype):
    return (acc / jnp.where(l == 0.0, 1.0, l)).astype(dtype)


def chunk_step(q, k_ref, v_ref, start, block, num_new, group, window, scale, carry, first_row=0):
    """Online-softmax step over chunk keys [start, start + block): key i' is visible to the query of token
    i when i' <= i, i - i' < window and i' < num_new (padding keys are never visible). q holds the folded
    rows from `first_row` on."""
    rows = q.shape[0]
    k = k_ref[pl.ds(start, block), :]
    v = v_ref[pl.ds(start, block), :]
    token = lax.div(first_row + lax.broadcasted_iota(jnp.int32, (rows, block), 0), group)
    key = start + lax.broadcasted_iota(jnp.int32, (rows, block), 1)
    valid = (key <= token) & (token - key < window) & (key < num_new)
    return online_softmax_step(scores(q, k, scale), valid, v, carry)


def page_step(q, k, v, first_index, length, group, window, ring, scale, carry, first_row=0):
    """Online-softmax step over entries of the old ring (k, v: [N, D], a page or part of one, the first
    at ring index `first_index`). An entry is visible to the query of token i (position length + i) when
    it holds a written position inside that query's window; every old position is < length, so causality
    holds."""
    rows = q.shape[0]
    entries = k.shape[0]
    token = lax.div(first_row + lax.broadcasted_iota(jnp.int32, (rows, entries), 0), group)
    ring_index = first_index + lax.broadcasted_iota(jnp.int32, (rows, entries), 1)
    held = positions.position_at(length - 1, ring, ring_index)
    valid = (held >= 0) & (held > length + token - window)
    return online_softmax_step(scores(q, k.astype(q.dtype), scale), valid, v.astype(q.dtype), carry)
