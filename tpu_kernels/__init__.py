"""Attention kernels over a paged ring-buffer KV cache: Pallas (TPU Mosaic, GPU Triton) + XLA reference."""
from jaxstream.tpu_kernels.ring_attention import ring_attention, unsupported_reason

__all__ = ["ring_attention", "unsupported_reason"]
