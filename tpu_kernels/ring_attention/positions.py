"""Position math shared by every implementation of `ring_attention`.

Positions are derived from the per-session count of written positions, never stored: ring index j of a
session that has written L positions holds position n - ((n mod R - j) mod R) with n = L - 1, which is
negative (invalid) for never-written entries.
"""
import jax.numpy as jnp
from jax import lax


def ring_positions(lengths, ring):
    """[S] lengths -> [S, R] stream position held by each ring index (negative = empty)."""
    newest = lengths - 1
    base = jnp.remainder(newest, ring)
    j = jnp.arange(ring, dtype=jnp.int32)
    return newest[:, None] - jnp.remainder(base[:, None] - j[None, :], ring)


def attention_mask(query_pos, key_pos, key_valid, window):
    """[S, C] query positions, [S, K] key positions/validity -> [S, C, K] sliding-window causal mask."""
    q = query_pos[:, :, None]
    k = key_pos[:, None, :]
    return key_valid[:, None, :] & (k <= q) & (k > q - window)


def write_targets(page_table, lengths, num_new, chunk, page_size, num_pages):
    """Physical page and in-page offset of each new position; rows that must not be written get page
    index `num_pages` (out of range, dropped by a `mode="drop"` scatter).

    Padding rows (i >= num_new) are not written, and when a chunk is longer than the ring only its last
    R valid rows are written (XLA leaves the winner of duplicate scatter indices undefined).
    """
    pages_per_window = page_table.shape[1]
    ring = pages_per_window * page_size
    i = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] + i
    logical_page = jnp.remainder(lax.div(pos, page_size), pages_per_window)
    physical = jnp.take_along_axis(page_table, logical_page, axis=1)
    keep = (i < num_new[:, None]) & (i >= num_new[:, None] - ring)
    return jnp.where(keep, physical, num_pages), jnp.remainder(pos, page_size)
