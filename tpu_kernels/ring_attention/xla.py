"""XLA reference of `ring_attention`: gathers the reachable part of each session's window from its pages and
runs a masked softmax in f32.

Runs on every backend; it is what training uses (the only implementation with a backward of its own), what
CPU serving runs where the C++ kernel cannot (no compiler, not float32), and the fallback of the dispatcher.
The keys are laid out in position order, the last `reach` written positions then the chunk. Its cost
follows the filled positions, not the window: `reach` is one of a few static buckets (`reach_buckets`:
64 old positions, doubling up to the whole window W - 1), and one `lax.switch` inside the single compiled
program picks, on device, the smallest bucket that covers the longest history any active session of the
batch can see, min(length, W - 1). Only the taken branch runs, so a Voxtral stream's first 128 decoder
positions (its 39-slot prompt and 7 s of audio) gather and score at most 128 old keys of the 8192-token
window, not 8191; the engine still compiles one program per (step, batch bucket). Windows of at most
SINGLE_BUCKET_REACH + 1 positions have a single bucket and no switch.

Long chunks are cut into blocks of QUERY_BLOCK queries, each scored only against the keys it can see, at
most W - 1 + QUERY_BLOCK: a whole-chunk score matrix would be (reach + C) wide for every query, and on CPU
the softmax's elementwise work over those scores dominates (the tiny model's training chunks of ~320
encoder frames score 45 % fewer keys this way).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxstream.tpu_kernels.ring_attention import positions

QUERY_BLOCK = 64
# The smallest reach bucket, in old positions (64 Voxtral decoder slots of 80 ms, the 39-slot prompt included;
# 1.3 s of encoder frames); each further bucket doubles it, the last is W - 1. Voice-agent turns last seconds:
# with 256 as the smallest bucket, a new stream's decoder steps gathered 4x the keys they can see
# (benchmarks/realtime_step.py, the random mid-size Voxtral, 32 rows at fill 40: K = 16 dispatches
# 440 -> 351-361 ms with 64). Every branch is compiled into every program: that model's engine builds in
# 101-137 s instead of 83-104 (with 64 then 256, 512, ... it took 126 s where this took 137, but a stream's
# 3rd to 17th second of audio then reads 256 keys).
MIN_REACH = 64
# Windows up to this many old positions have one bucket, the whole window, and no switch: gathering a short
# window whole is cheap, while each switch costs (~0.25 ms a call in a mid-size K = 1 step) and makes
# training's reverse mode keep a residual per branch. The tiny models' 128-position windows stay switch-free.
SINGLE_BUCKET_REACH = 256


def reach_buckets(window):
    """Static numbers of old positions the XLA path may gather: MIN_REACH, 2 MIN_REACH, ... < W - 1, then W - 1;
    only W - 1 for windows of at most SINGLE_BUCKET_REACH + 1 positions.

    Doubling bounds the gathered positions at 2x the needed ones (past MIN_REACH) with about
    log2(W / MIN_REACH) + 1 branches (8 for W = 8192, 5 for W = 750).
    """
    if window - 1 <= SINGLE_BUCKET_REACH:
        return (window - 1,)
    reaches = []
    reach = MIN_REACH
    while reach < window - 1:
        reaches.append(reach)
        reach *= 2
    return (*reaches, window - 1)


def reach_bucket(lengths, num_new, window):
    """Index (int32 scalar, on device) of the smallest of `reach_buckets(window)` that holds every old
    position the batch's queries can see: the longest min(length, W - 1) over sessions with new rows.
    Sessions without new rows output zeros whatever their history, so they need no reach."""
    reaches = reach_buckets(window)
    needed = jnp.max(jnp.where(num_new > 0, jnp.minimum(lengths, window - 1), 0), initial=0)
    return jnp.sum(jnp.asarray(reaches[:-1], jnp.int32) < needed, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def ring_attention_xla(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, scale=None):
    out = attention_output(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window=window,
                           scale=scale)
    # The write stays outside the branches: a scatter into a donated pool at the top level of the program
    # is done in place (tests/test_ring_attention.py checks that no copy of a pool appears).
    k_pages, v_pages = write_new_entries(k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, after=out)
    return out, k_pages, v_pages


def attention_output(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, scale=None):
    """The attention output [S, C, Hq, D] of `ring_attention`, without the write (also the C++ kernel's
    backward)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    operands = (q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new)
    branches = [functools.partial(_attend, reach=reach, window=window, scale=scale) for reach in reach_buckets(window)]
    if len(branches) == 1:
        return branches[0](*operands)
    # Differentiable (training runs through it), but reverse mode keeps a residual slot per branch, the
    # untaken ones zero-filled: training memory for attention residuals grows up to ~2x for such windows.
    return lax.switch(reach_bucket(lengths, num_new, window), branches, *operands)


def _attend(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, reach, window, scale):
    """Attention output [S, C, Hq, D] of the chunk over the last `reach` old positions and the chunk itself;
    exact when every session with new rows has min(length, W - 1) <= reach."""
    num_sessions, chunk, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    ring = page_table.shape[1] * page_size
    group = num_q_heads // num_kv_heads

    # The `reach` positions before the chunk (negative ones were never written), read from their pages.
    old_pos = lengths[:, None] + jnp.arange(-reach, 0, dtype=jnp.int32)[None, :]  # [S, reach]
    ring_index = jnp.remainder(old_pos, ring)
    page = positions.page_read(jnp.take_along_axis(page_table, ring_index // page_size, axis=1), num_pages)
    offset = ring_index % page_size

    def in_position_order(pages, new):  # -> [S, Hkv, reach + C, D], in the chunk's dtype (pages may be narrower)
        return jnp.concatenate([pages[page, :, offset].astype(new.dtype), new], axis=1).transpose(0, 2, 1, 3)

    keys, values = in_position_order(k_pages, k_new), in_position_order(v_pages, v_new)
    query_pos = lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [S, C]
    key_pos = jnp.concatenate([old_pos, query_pos], axis=1)
    key_valid = jnp.concatenate([old_pos >= 0, jnp.arange(chunk)[None, :] < num_new[:, None]], axis=1)
    # A zero probability times NaN is still NaN, so a value no query may see is replaced, not multiplied
    # away: unwritten ring entries hold whatever an earlier session left in the page. With one position per
    # session (decode) every written key gathered is inside its window, and a non-finite value reaches its
    # queries as in the float64 oracle. A longer chunk's queries share the values of their block, and a
    # written value outside one query's window (it slid out, or it is a chunk row after the query) would
    # reach it as 0 x NaN: every non-finite value is replaced too, and `_with_seen_non_finite` gives NaN
    # back to the queries that can see one. (Decode keeps its single select: an extra pass over the
    # gathered values made an XLA:CPU decode step 1.5x slower. A chunk's forward pays 5-50 % more on the
    # 2-core CPU, benchmarks/ring_attention.py --baseline; a training chunk's forward and backward 1-3 %.)
    valid = key_valid[:, None, :, None]
    unusable = None
    if chunk > 1:
        finite = jnp.isfinite(values)
        unusable = key_valid[:, None, :] & ~jnp.all(finite, axis=-1)  # [S, Hkv, K]: written, not all finite
        valid = valid & finite
    values = jnp.where(valid, values, jnp.zeros((), values.dtype))
    qg = q.reshape(num_sessions, chunk, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)

    # Queries first..last-1 see the keys of positions (length + first - W, length + last - 1]: key index
    # reach + i of the chunk's position i, old ones before it.
    spans = tuple((first, min(first + QUERY_BLOCK, chunk), max(0, first + reach - (window - 1)),
                   min(first + QUERY_BLOCK, chunk) + reach) for first in range(0, chunk, QUERY_BLOCK))
    masks = tuple(positions.attention_mask(query_pos[:, first:last], key_pos[:, lo:hi], key_valid[:, lo:hi], window)
                  for first, last, lo, hi in spans)
    out = _blocked_attention(qg, keys, values, masks, spans, scale)
    if unusable is not None:
        out = _with_seen_non_finite(out, unusable, masks, spans)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_sessions, chunk, num_q_heads, head_dim).astype(q.dtype)
    # A session without new rows outputs zeros (as in the Pallas kernels), which is also what lets the bucket
    # choice ignore its history. Zeroing the output is cheaper than masking its keys.
    return jnp.where(num_new[:, None, None, None] > 0, out, jnp.zeros((), out.dtype))


def _with_seen_non_finite(out, unusable, masks, spans):
    """`out` [S, Hkv, G, C, D] with NaN in the whole output of each query (of each query head) that can see a
    key whose value is not finite (`unusable` [S, Hkv, K]), where the float64 oracle's is NaN or inf at
    least in that value's elements. Whole rows: marking only those elements would take a second [C, K] x
    [K, D] product (or a branch, which on XLA:CPU doubled a call's time); this product is [C, K] x [K],
    1 / (G D) of the scores'."""
    seen = [jnp.einsum("sck,shk->shc", mask.astype(jnp.float32), unusable[:, :, lo:hi].astype(jnp.float32))
            for (_, _, lo, hi), mask in zip(spans, masks)]
    seen = jnp.concatenate(seen, axis=2) if len(seen) > 1 else seen[0]
    return jnp.where(seen[:, :, None, :, None] > 0, jnp.nan, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked_attention(qg, keys, values, masks, spans, scale):
    """qg [S, Hkv, G, C, D], keys/values [S, Hkv, K, D] -> f32 [S, Hkv, G, C, D]: the queries first..last-1 of
    each span (first, last, lo, hi) attend to keys lo..hi-1 under that span's mask [S, last - first, hi - lo].

    Its own backward adds each span's key and value gradients into one buffer in place. Autodiff of the
    slices summed padded copies of them instead, and XLA:CPU compiled that sum into a program that crashed
    (a null store in an Eigen worker) when YNNPACK handles only the dots
    (`xla_cpu_experimental_ynn_fusion_type`), which makes CPU training steps 1.5x faster."""
    return _blocked_attention_forward(qg, keys, values, masks, spans, scale)[0]


def _blocked_attention_forward(qg, keys, values, masks, spans, scale):
    outs, probs = [], []
    for (first, last, lo, hi), mask in zip(spans, masks):
        out, block_probs = _masked_attention_forward(qg[:, :, :, first:last], keys[:, :, lo:hi], values[:, :, lo:hi],
                                                     mask, scale)
        outs.append(out)
        probs.append(block_probs)
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out, (qg, keys, values, masks, tuple(probs), out)


def _blocked_attention_backward(spans, scale, residuals, d_out):
    qg, keys, values, masks, probs, out = residuals
    d_qg = []
    d_keys, d_values = jnp.zeros(keys.shape, jnp.float32), jnp.zeros(values.shape, jnp.float32)
    for (first, last, lo, hi), block_probs in zip(spans, probs):
        block_d_qg, block_d_keys, block_d_values = _masked_attention_backward(
            scale, qg[:, :, :, first:last], keys[:, :, lo:hi], values[:, :, lo:hi], block_probs,
            out[:, :, :, first:last], d_out[:, :, :, first:last])
        d_qg.append(block_d_qg)
        d_keys = lax.dynamic_update_slice_in_dim(d_keys, d_keys[:, :, lo:hi] + block_d_keys, lo, axis=2)
        d_values = lax.dynamic_update_slice_in_dim(d_values, d_values[:, :, lo:hi] + block_d_values, lo, axis=2)
    d_qg = jnp.concatenate(d_qg, axis=3) if len(d_qg) > 1 else d_qg[0]
    no_masks = tuple(np.zeros(mask.shape, jax.dtypes.float0) for mask in masks)
    return d_qg.astype(qg.dtype), d_keys.astype(keys.dtype), d_values.astype(values.dtype), no_masks


_blocked_attention.defvjp(_blocked_attention_forward, _blocked_attention_backward)


def _masked_attention_forward(qg, keys, values, mask, scale):
    """qg [S, Hkv, G, Cb, D], keys/values [S, Hkv, K, D], mask [S, Cb, K] -> (f32 [S, Hkv, G, Cb, D], the
    probabilities)."""
    num_sessions, num_kv_heads, group, chunk, head_dim = qg.shape
    # The keys are the dot's left operand, [K, D] with D minor as gathered, and the queries its right: with
    # the queries on the left (einsum's order) XLA:CPU transposed the gathered keys to [D, K] inside the
    # gather, a strided write that took most of a decode step's attention. `jaxstream bench --fast` of a
    # random mid-size Voxtral (benchmarks/vs_transformers.py --build-mid), 32 streams: 80 ms step p50
    # 53-57 -> 43-44 ms; benchmarks/ring_attention.py, Voxtral's full decoder window: 2.3x faster.
    scores = lax.dot_general(keys, qg.reshape(num_sessions, num_kv_heads, group * chunk, head_dim),
                             (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    scores = scores.reshape(num_sessions, num_kv_heads, -1, group, chunk).transpose(0, 1, 3, 4, 2) * scale
    # A finite fill: on CPU the forward+backward of -inf fills took 1.9x as long (0.156 vs 0.083 s for the
    # tiny encoder's shapes), and training runs through this path.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    # Normalised after the values' product: the division is then over [.., C, D] instead of every score
    # [.., C, K], one pass fewer over the scores, which on CPU cost as much as the dots (the mid-size
    # Voxtral's encoder, 32 rows x 64 frames over 464 keys: 20.6-21.5 instead of 26.7-27.0 ms a layer). The
    # probabilities themselves only feed the backward (XLA drops them from inference programs).
    out = jnp.einsum("shgck,shkd->shgcd", weights, values.astype(jnp.float32)) / total
    # A query with no valid key (padding rows, empty sessions) outputs zeros, not the mean of stale values.
    has_key = mask.any(axis=-1)[:, None, None, :, None]
    return jnp.where(has_key, out, 0.0), jnp.where(has_key, weights / total, 0.0)


def _masked_attention_backward(scale, qg, keys, values, probs, out, d_out):
    """The softmax backward as FlashAttention writes it: sum_k P dP = dO . O, a row sum over the head dim
    instead of over the keys, and no masking (masked probabilities are exactly 0). Training runs through
    this: one tiny-model encoder attention's forward+backward takes 58 ms instead of autodiff's 67 (2-core
    CPU, batch 16 x 324 frames, medians of 20 alternated calls)."""
    d_values = jnp.einsum("shgck,shgcd->shkd", probs, d_out)
    d_probs = jnp.einsum("shgcd,shkd->shgck", d_out, values.astype(jnp.float32))
    d_scores = probs * (d_probs - jnp.sum(d_out * out, axis=-1, keepdims=True)) * scale
    d_qg = jnp.einsum("shgck,shkd->shgcd", d_scores, keys.astype(jnp.float32))
    d_keys = jnp.einsum("shgck,shgcd->shkd", d_scores, qg.astype(jnp.float32))
    return d_qg, d_keys, d_values


def write_new_entries(k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, after):
    """Scatter the valid new rows into their pages, after the attention output `after` is computed.

    Every implementation writes with this scatter after attending (read before write); `mode="drop"`
    discards padding rows, which `write_targets` sends to an out-of-range page. XLA updates a donated pool
    in place only if it can order the scatter after every other reader of the pool, and its copy
    insertion sees only data dependences (not even an optimization_barrier): without one it copies the
    whole pool. So the written rows get `after` folded in as a signed zero, +0.0 or -0.0 whatever `after`
    holds (NaN included), which leaves every value unchanged and which XLA cannot fold away.
    """
    num_pages, _, page_size, _ = k_pages.shape
    page_index, offset = positions.write_targets(page_table, lengths, num_new, k_new.shape[1], page_size, num_pages)
    zero = jnp.where(jnp.sum(after, dtype=jnp.float32) > 0, 0.0, -0.0).astype(k_pages.dtype)
    k_pages = k_pages.at[page_index, :, offset].set(k_new.astype(k_pages.dtype) + zero, mode="drop")
    v_pages = v_pages.at[page_index, :, offset].set(v_new.astype(v_pages.dtype) + zero, mode="drop")
    return k_pages, v_pages
