"""Sliding-window attention over a paged ring-buffer KV cache (one op for chunked prefill and decode).

`ring_attention` dispatches to one of `IMPLEMENTATIONS`: "xla" (reference, any backend), "cpu" (C++ kernel
for XLA:CPU), "pallas" (portable kernel: TPU Mosaic, GPU Triton, interpreters) and "pallas_tpu" (TPU-tuned
kernel);
`choose_implementation` tells which one a call would run, `unsupported_reason` why a named one cannot run
here (the dispatcher's own check); `reach_buckets` are the static numbers of old positions the XLA path
chooses from (one compiled branch each), `reach_bucket` the one a batch takes.
"""
from jaxstream.tpu_kernels.ring_attention.api import (IMPLEMENTATIONS, choose_implementation, ring_attention,
                                                      unsupported_reason)
from jaxstream.tpu_kernels.ring_attention.xla import reach_bucket, reach_buckets

__all__ = ["IMPLEMENTATIONS", "choose_implementation", "reach_bucket", "reach_buckets", "ring_attention",
           "unsupported_reason"]
