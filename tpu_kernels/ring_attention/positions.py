"""Position math shared by every implementation of `ring_attention`.

Positions are derived from the per-session count of written positions, never stored: with n = L - 1 the
newest written position and base = n mod R, ring index j holds position n - (base - j) if j <= base and
n - (base - j + R) otherwise; a negative position marks a never-written (invalid) entry. Only `base` needs
a modulo, so inside kernels it is one scalar operation and the vector side does compares and selects.
"""
import jax.numpy as jnp
from jax import lax


def position_at(newest, ring, ring_index):
    """Stream position held by `ring_index` (any int32 array) of a ring whose newest position is `newest`.

    `newest` may be a scalar (inside kernels) or broadcastable against `ring_index`; it is -1 for an empty
    session, which makes every entry invalid.
    """
    base = jnp.remainder(newest, ring)
    back = jnp.where(ring_index <= base, base - ring_index, base - ring_index + ring)
    return newest - back


def page_read(entry, num_pages):
    """The physical page a page-table entry (any int32 array, or a scalar inside kernels) reads, as XLA's
    gather reads it (jnp indexing): a negative entry counts from the end of the pool, and the result is
    clamped into the pool. Entries are promised valid, but the table is traced data: every implementation
    reads an out-of-range one the same way (cpu_kernel.cc's PageOf too), and none reads past the pool.
    Writes through such an entry are dropped instead (`write_targets`)."""
    entry = jnp.where(entry < 0, entry + num_pages, entry)
    return jnp.clip(entry, 0, num_pages - 1)


def attention_mask(query_pos, key_pos, key_valid, window):
    """[S, C] query positions, [S, K] key positions/validity -> [S, C, K] sliding-window causal mask."""
    q = query_pos[:, :, None]
    k = key_pos[:, None, :]
    return key_valid[:, None, :] & (k <= q) & (k > q - window)


def visible_pages(length, num_new, window, page_size, pages_per_window):
    """Scalar range of logical pages that a chunk's queries can see in the old ring.

    The queries of a chunk starting at position `length` see old positions in
    [max(0, length - window + 1), length - 1] (query 0 has the widest window). Returns (first, count):
    visit the logical pages (first + t) mod pages_per_window for t in [0, count), each at most once. Pages
    holding only positions outside the window are never visited, and a session with no valid new rows
    (num_new == 0, its rows are padding) visits nothing. All operands are non-negative, so `lax.div` is
    exact (and, unlike `//`, lowers on Mosaic from a CPU host).
    """
    lowest = jnp.maximum(length - window + 1, 0)
    highest = length - 1
    first = lax.div(lowest, page_size)
    spanned = lax.div(jnp.maximum(highest, 0), page_size) - first + 1
    count = jnp.where((num_new > 0) & (highest >= lowest), jnp.minimum(spanned, pages_per_window), 0)
    return first, count


def write_targets(page_table, lengths, num_new, chunk, page_size, num_pages):
    """Physical page and in-page offset of each new position; rows that must not be written get page
    index `num_pages` (out of range, dropped by a `mode="drop"` scatter).

    Padding rows (i >= num_new) are not written, and when a chunk is longer than the ring only its last
    R valid rows are written (XLA leaves the winner of duplicate scatter indices undefined). num_new is
    clipped to [0, chunk] first, as every kernel reads it: a count past the chunk (out of contract) would
    otherwise count rows that do not exist towards the last R, and drop rows the kernels attended to.
    A row whose page-table entry is outside [0, num_pages) is not written either, unlike `page_read`'s
    clamped read: jnp's scatter counts a negative index from the end of the pool, so an entry in
    [-num_pages, -1] would overwrite a page another session may own. Every implementation writes through
    this function (`xla.write_new_entries`).
    """
    num_new = jnp.clip(num_new, 0, chunk)
    pages_per_window = page_table.shape[1]
    ring = pages_per_window * page_size
    i = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] + i
    logical_page = jnp.remainder(lax.div(pos, page_size), pages_per_window)
    physical = jnp.take_along_axis(page_table, logical_page, axis=1)
    keep = (i < num_new[:, None]) & (i >= num_new[:, None] - ring) & (physical >= 0) & (physical < num_pages)
    return jnp.where(keep, physical, num_pages), jnp.remainder(pos, page_size)
