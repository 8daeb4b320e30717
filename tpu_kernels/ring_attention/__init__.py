"""Sliding-window attention over a paged ring-buffer KV cache (one op for chunked prefill and decode)."""
from jaxstream.tpu_kernels.ring_attention.api import ring_attention

__all__ = ["ring_attention"]
