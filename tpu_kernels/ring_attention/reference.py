"""Dense float64 numpy oracle of `ring_attention` over the full stream history, and a numpy page writer.

Independent of the ring: the oracle attends over the explicit history of every session, and
`write_positions` fills a page pool straight from the layout rule of design.md (position p lives in
page `page_table[s, (p // page_size) % P]` at offset `p % page_size`). Tests and benchmarks use both.
"""
import numpy as np


def dense_attention(q, k_history, v_history, lengths, num_new, *, window, scale=None):
    """Sliding-window causal attention of each chunk over its session's full history, in float64.

    q: [S, C, Hq, D]; k_history/v_history: [S, T, Hkv, D], the key/value of every stream position of each
    session, the chunk's own at positions lengths[s] + i; lengths, num_new: [S]. Query i of session s
    (position lengths[s] + i) attends to positions in (pos - window, pos]. Returns [S, C, Hq, D] float64
    with padding rows (i >= num_new[s]) set to 0.
    """
    q = np.asarray(q, np.float64)
    k_history = np.asarray(k_history, np.float64)
    v_history = np.asarray(v_history, np.float64)
    sessions, chunk, num_q_heads, head_dim = q.shape
    num_kv_heads = k_history.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    for s in range(sessions):
        for i in range(min(int(num_new[s]), chunk)):
            pos = int(lengths[s]) + i
            keys = k_history[s, max(0, pos - window + 1): pos + 1]  # [K, Hkv, D]
            values = v_history[s, max(0, pos - window + 1): pos + 1]
            queries = q[s, i].reshape(num_kv_heads, group, head_dim)
            scores = np.einsum("hgd,khd->hgk", queries, keys) * scale
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[s, i] = np.einsum("hgk,khd->hgd", probs, values).reshape(num_q_heads, head_dim)
    return out


def write_positions(pages, page_table, history, start, stop):
    """Return a copy of `pages` [num_pages, Hkv, page_size, D] in which session s holds the history
    entries [S, T, Hkv, D] of positions [start[s], stop[s]); of those only the last R = P * page_size
    survive in a ring, so earlier ones are skipped."""
    pages = np.array(pages, copy=True)
    page_size = pages.shape[2]
    pages_per_window = page_table.shape[1]
    ring = pages_per_window * page_size
    for s in range(page_table.shape[0]):
        for p in range(max(int(start[s]), int(stop[s]) - ring), int(stop[s])):
            pages[page_table[s, (p // page_size) % pages_per_window], :, p % page_size] = history[s, p]
    return pages
