"""Public entry point and dispatcher of `ring_attention`."""
from jaxstream.tpu_kernels.ring_attention.xla import ring_attention_xla


def ring_attention(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window,
                                     implementation=None, scale=None):
    """Attention of C new positions per session over a paged ring KV cache, writing the new K/V.

    Shapes: q [S, C, Hq, D]; k_new/v_new [S, C, Hkv, D]; k_pages/v_pages [num_pages, Hkv, page_size, D];
    page_table [S, pages_per_window] int32; lengths, num_new [S] int32. Query i of session s (position
    lengths[s] + i) attends to keys at positions in (pos - window, pos]. Returns (out, k_pages, v_pages).
    """
    del implementation  # Only the XLA path exists so far.
    return ring_attention_xla(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new,
                                                        window=window, scale=scale)
