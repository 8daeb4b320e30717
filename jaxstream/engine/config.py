"""`EngineConfig`: the knobs of one engine instance (capacity, shape buckets, limits, placement)."""
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Capacity, compiled shape buckets and limits of an engine.

    Every program shape the engine dispatches comes from the buckets below and is compiled at start-up,
    so serving never recompiles. Behaviour at the limits:

    * `max_sessions` sessions are resident on the device (running or parked with their KV). A session
      beyond that waits, unless a parked session can be evicted to host memory (least recently active
      first, `host_offload_bytes` in total); evicted sessions are restored on their next input with
      identical subsequent outputs. When host memory is full too, a parked text session is evicted by
      dropping its KV (its context is recomputed on resume); a transcription session cannot be recomputed
      (its audio is gone), so a new one waits until a session ends or host memory frees up.
    * When the page pool runs out, parked sessions are evicted first; if none is parked, the most recently
      admitted running text session is preempted (its KV is recomputed later, vLLM's rule), and a
      transcription session waits for pages (a stream whose audio keeps arriving then falls behind).
    * `max_model_len` caps the cumulative context of a text session: reaching it ends the *session* with
      finish reason `length` (vLLM leaves this undefined). Transcription streams have no length limit:
      both attention rings wrap, so memory per stream is bounded by the windows.
    * `max_queued_audio_seconds` bounds the audio a transcription session may have queued but not yet
      processed; an append beyond it raises `BufferError` (backpressure instead of unbounded memory).
    """

    max_sessions: int = 64
    page_size: int = 64  # decoder / text KV positions per page
    encoder_page_size: int = 64  # Voxtral encoder KV frames per page
    # Pages per pool including the null page. None: `max_sessions` full windows, scaled down (all pools
    # alike) to fit `kv_memory_fraction` of the free device memory where the device reports it.
    num_pages: int | None = None
    encoder_num_pages: int | None = None
    kv_memory_fraction: float = 0.85
    # Batch-slot buckets of decode programs; None: powers of four up to `max_sessions`, plus it.
    batch_buckets: tuple[int, ...] | None = None
    # (rows, chunk length) buckets of text prefill programs.
    prefill_buckets: tuple[tuple[int, int], ...] = ((1, 256), (4, 64), (16, 16))
    max_num_batched_tokens: int = 2048  # token budget of one tick (decode rows count one each)
    # Realtime 80 ms steps one dispatch may run per session when audio is queued (catch-up).
    realtime_step_buckets: tuple[int, ...] = (1, 4, 16)
    # (rows, slots) buckets of realtime prompt prefill; None: rows (1, 8) and slots enough for the
    # longest prompt (BOS + 32 + 30 delay slots at 2400 ms). A longer prompt is prefilled in pieces.
    realtime_prefill_buckets: tuple[tuple[int, int], ...] | None = None
    max_model_len: int | None = None  # None: the model's maximum positions
    host_offload_bytes: int = 8 << 30
    max_queued_audio_seconds: float = 600.0
    default_delay_ms: int | None = None  # None: the model's default transcription delay
    seed: int = 0  # base of the sampling seeds of requests that do not set one
    dtype: str | None = None  # compute/KV dtype; None: float32 on CPU, bfloat16 elsewhere
    attention_impl: str | None = None  # ring_attention implementation; None picks per backend
    mesh: Any = None  # jax.sharding.Mesh for tensor parallelism (params and KV heads on `tp_axis`)
    tp_axis: str = "tp"
    # "vllm": a stream closed while parked just ends; "strict": it ends with an empty finished output.
    compat: str = "vllm"

    def __post_init__(self):
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if self.page_size < 1 or self.encoder_page_size < 1:
            raise ValueError("page sizes must be >= 1")
        if self.compat not in ("vllm", "strict"):
            raise ValueError("compat must be 'vllm' or 'strict'")
        if not self.prefill_buckets or not self.realtime_step_buckets:
            raise ValueError("prefill_buckets and realtime_step_buckets must not be empty")
        if any(rows < 1 or chunk < 1 for rows, chunk in self.prefill_buckets):
            raise ValueError("prefill buckets must be positive (rows, chunk) pairs")

    @property
    def decode_batch_buckets(self) -> tuple[int, ...]:
        if self.batch_buckets is not None:
            buckets = {min(b, self.max_sessions) for b in self.batch_buckets}
        else:
            buckets = {4**i for i in range(12) if 4**i < self.max_sessions}
        return tuple(sorted(buckets | {self.max_sessions}))
