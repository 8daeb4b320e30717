"""`EngineConfig`: the knobs of one engine instance (capacity, shape buckets, limits, placement)."""
import dataclasses
import math
import numbers
from typing import Any

from jaxstream.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Capacity, compiled shape buckets and limits of an engine.

    Every program shape the engine dispatches comes from the buckets below and is compiled at start-up,
    so serving never recompiles (a realtime server must not compile while streams wait).

    Start-up cost grows with the number of programs: a Voxtral engine compiles
    `len(decode_batch_buckets) * len(realtime_step_buckets)` decode programs plus its prefill buckets, 17
    with the defaults (batch buckets 1, 4, 16, 64 from `max_sessions=64`; steps 1, 4, 16; 5 prefill
    buckets); a text engine compiles `len(decode_batch_buckets) + len(prefill_buckets)`. On a 2-core CPU
    the tiny model starts in about 20 s with the defaults and 6 s with `EngineConfig(max_sessions=1)` (5
    programs), the setting for a script that runs one stream at a time. A server sized for N streams
    compiles fewer with `batch_buckets=(N,)` (every batch padded to N rows) or fewer
    `realtime_step_buckets`. `jaxstream -v` logs the count and time at start-up.

    Behaviour at the limits:

    * `max_sessions` sessions are resident on the device (running or parked with their KV). A session
      beyond that waits, unless a parked session can be evicted to host memory (least recently active
      first, `host_offload_bytes` in total; of transcription streams, only one idle for a second or one
      that arrived later); evicted sessions are restored on their next input with identical subsequent
      outputs. When host memory is full too, a parked text session is evicted by
      dropping its KV (its context is recomputed on resume); a transcription session cannot be recomputed
      (its audio is gone), so a new one waits until a session ends or host memory frees up.
    * When the page pool runs out, parked sessions are evicted first; if none is parked, the most recently
      admitted running text session is preempted (its KV is recomputed later, vLLM's rule). A
      transcription session cannot recompute (its audio is gone). With `realtime_admission="demand"` (the
      default) streams take pages as they grow, so as many run as their actual lengths fit; a stream that
      finds no page displaces parked streams idle for a second, then streams that arrived after it, to host
      memory, and when host memory is full too the newest stream on the device ends with `CapacityError`
      (engine/realtime_admission.py). With `"window"` admission commits a whole window of every pool to each
      stream, or the pages of its whole length when `start_transcription(max_audio_seconds=)` caps it shorter:
      every admitted stream can always advance, and a stream that finds the pools committed waits (after
      idle parked streams are evicted) until one ends. Under both, a parked stream whose next chunk is due
      (audio within the last second) never gives way to a newer stream.
    * `max_live_sessions` (default `max_sessions`) bounds the transcription sessions the engine accepts at
      once, running, parked or evicted: `start_transcription` beyond it raises `CapacityError` at once
      instead of queueing a stream nobody computes.
    * `max_model_len` caps the cumulative context of a text session: reaching it ends the *session* with
      finish reason `length` (vLLM leaves this undefined). Transcription streams have no length limit:
      both attention rings wrap, so memory per stream is bounded by the windows.
    * `max_queued_audio_seconds` bounds the audio a transcription session may have queued but not yet
      processed (counted from the caller's side, so audio still in the command queue counts); an append
      beyond it awaits until the engine catches up (or raises `BacklogError` with `wait=False`).
    """

    max_sessions: int = 64
    page_size: int = 64  # decoder / text KV positions per page
    encoder_page_size: int = 64  # Voxtral encoder KV frames per page
    # Pages per pool including the null page. None: `max_sessions` full windows, scaled down to fit
    # `kv_memory_fraction` of the free device memory (a CPU's: the host's available memory): all pools alike, or
    # under demand admission as `planned_stream_seconds` says.
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
    # How long a busy device's tick (the last one took 40 ms or more) may hold back streams whose audio is
    # here, waiting for the paced streams whose next 80 ms slot is due, so that one dispatch carries them
    # all: paced streams arrive spread over each 80 ms, and without waiting a loaded device runs several
    # part-filled (padded) batches per 80 ms. 0 dispatches whatever is ready at once.
    realtime_batch_wait_ms: float = 80.0
    # (rows, slots) buckets of realtime prompt prefill; None: rows (1, 8) with slots enough for the
    # default delay's prompt and for the longest one (2400 ms) after the cached prefix (or, without it,
    # BOS + 32 + 30 delay slots), and 32 rows at the default delay. A longer prompt is prefilled in pieces.
    realtime_prefill_buckets: tuple[tuple[int, int], ...] | None = None
    # Compute the 31 silent left-pad slots every transcription stream starts with once per delay, and
    # copy them into each new stream (engine/prefix_cache.py); False computes them in every stream.
    cache_silent_prefix: bool = True
    # Text LMs: sessions whose contexts start alike share the KV pages of their common full blocks, and a session
    # prefills from the end of the cached part (vLLM's automatic prefix caching; engine/text_prefix_cache.py). Off
    # where the page ring is shorter than max_model_len (a sliding window shorter than it: sessions would rewrite
    # shared pages). Transcription engines ignore it (cache_silent_prefix is theirs).
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's maximum positions
    host_offload_bytes: int = 8 << 30
    max_queued_audio_seconds: float = 600.0
    default_delay_ms: int | None = None  # None: the model's default transcription delay
    seed: int = 0  # base of the sampling seeds of requests that do not set one
    dtype: str | None = None  # compute/KV dtype; None: float32 on CPU, bfloat16 elsewhere
    # Weight-only quantization (vLLM's `quantization`): "int8" stores the weights as int8 with one float32 scale
    # per output channel (models/quantization.py), activations and KV staying in `dtype`: half the weight memory of
    # bfloat16, which the page pools get (they are sized from the memory left after the parameters). None: the
    # weights as loaded. `from_pretrained` quantizes each tensor as it is read; a float model given to the engine
    # is quantized when the engine is built (the caller's float copy then still takes its memory). On a CPU, int8
    # decode steps are slower (1.25-2x: its backend converts each kernel before the matmul).
    quantization: str | None = None
    # KV cache dtype (vLLM's `kv_cache_dtype`): "auto" stores K/V in `dtype`; "fp8" (= "fp8_e4m3": float8_e4m3fn,
    # vLLM's meaning of "fp8") and "fp8_e5m2" store them in 8 bits, unscaled (vLLM's default scale of 1.0), with
    # the attention computed in `dtype`: a page holds the same positions in half the bytes of bfloat16, so the pools
    # hold twice the streams. A stream's new keys and values are rounded to it before they are attended to, so an
    # output never depends on whether its keys came from the pages or from the same dispatch. "bfloat16" keeps
    # a float32 engine's KV in bfloat16. On a CPU, fp8 pages take the XLA attention, not the C++ kernel.
    kv_cache_dtype: str = "auto"
    # ring_attention implementation; None picks per backend. A named one must run on this backend and dtype.
    attention_impl: str | None = None
    mesh: Any = None  # jax.sharding.Mesh for tensor parallelism (params and KV heads on `tp_axis`)
    tp_axis: str = "tp"
    # "vllm": a stream closed while parked just ends; "strict": it ends with an empty finished output.
    compat: str = "vllm"
    max_live_sessions: int | None = None  # transcription sessions accepted at once; None: max_sessions
    # "demand": transcription streams take pages as they grow, newer ones giving way to older ones; "window":
    # admission commits each stream its whole windows (see above). On one H200, Voxtral Realtime 4B: 256 paced
    # 10 s streams keep up with demand admission, 128 fall behind with window admission (README, "Tests and
    # benchmarks").
    realtime_admission: str = "demand"
    # Demand admission, when the default pools do not fit whole: memory is split between Voxtral's encoder and
    # decoder pools so that both hold as many streams of this many seconds as it can (up to `max_sessions`), the
    # rest going to the decoder pool, which a longer stream still grows in (its encoder window is full after 15 s).
    # None plans full windows (the decoder's is 11 minutes). Voxtral 4B in bfloat16 on a 16 GB chip holds streams of
    # 10 s / 1 min / 5 min / 11 min at once: 6 / 5 / 5 / 5 planned for full windows, 9 / 9 / 9 / 4 for 300 s, 21 /
    # 20 / 4 / 2 for 60 s (benchmarks/pool_plan.py; start-up logs the split). Set it to your streams' usual length:
    # a voice agent's turns want less, streams that run past 11 minutes None.
    planned_stream_seconds: float | None = 300.0

    def __post_init__(self):
        """Rejects, with `InvalidRequestError`, every value the engine would misuse rather than fail on at
        once (a token budget of 0, say, schedules nothing, forever); buckets become tuples of ints.

        `max_num_batched_tokens` only needs to be >= 1: a tick with a smaller budget than its decode rows
        or prefill chunk schedules fewer rows and splits the prefill, and every session still advances."""
        for name in ("max_sessions", "page_size", "encoder_page_size", "max_num_batched_tokens"):
            _check_int(self, name, minimum=1)
        for name, minimum in (("num_pages", 2), ("encoder_num_pages", 2), ("max_model_len", 1),
                              ("max_live_sessions", 1)):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=minimum)
        _check_int(self, "host_offload_bytes", minimum=0)
        _check_int(self, "seed")
        _check_real(self, "kv_memory_fraction", lambda f: 0 < f <= 1, "a number in (0, 1]")
        _check_real(self, "max_queued_audio_seconds", lambda s: 0 < s < math.inf, "a finite number > 0")
        if self.planned_stream_seconds is not None:
            _check_real(self, "planned_stream_seconds", lambda s: 0 < s < math.inf, "a finite number > 0 or None")
        _check_real(self, "realtime_batch_wait_ms", lambda ms: 0 <= ms <= 1000, "a number of ms in [0, 1000]")
        _set_buckets(self, "prefill_buckets", pairs=True)
        _set_buckets(self, "realtime_step_buckets", pairs=False)
        if self.batch_buckets is not None:
            _set_buckets(self, "batch_buckets", pairs=False)
        if self.realtime_prefill_buckets is not None:
            _set_buckets(self, "realtime_prefill_buckets", pairs=True)
        for name in ("cache_silent_prefix", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if self.compat not in ("vllm", "strict"):
            _fail("compat", self.compat, "'vllm' or 'strict'")
        if self.realtime_admission not in ("window", "demand"):
            _fail("realtime_admission", self.realtime_admission, "'window' or 'demand'")
        _check_choices(self)

    @property
    def decode_batch_buckets(self) -> tuple[int, ...]:
        if self.batch_buckets is not None:
            buckets = {min(b, self.max_sessions) for b in self.batch_buckets}
        else:
            buckets = {4**i for i in range(12) if 4**i < self.max_sessions}
        return tuple(sorted(buckets | {self.max_sessions}))


# -- validation helpers of `EngineConfig.__post_init__` ----------------------------------------------------

def _fail(name: str, value, expected: str):
    raise InvalidRequestError(f"EngineConfig.{name} must be {expected}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(cfg: EngineConfig, name: str, *, minimum: int | None = None) -> None:
    value = getattr(cfg, name)
    if not _is_int(value) or (minimum is not None and value < minimum):
        _fail(name, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""))


def _check_real(cfg: EngineConfig, name: str, valid, expected: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not valid(value):
        _fail(name, value, expected)


def _set_buckets(cfg: EngineConfig, name: str, *, pairs: bool) -> None:
    """A non-empty sequence of positive ints (or of (rows, length) pairs of them), stored as tuples."""
    value = getattr(cfg, name)
    expected = "a non-empty sequence of " + ("(rows, length) pairs of ints >= 1" if pairs else "ints >= 1")
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        _fail(name, value, expected)
    buckets = []
    for bucket in value:
        parts = tuple(bucket) if pairs and isinstance(bucket, (list, tuple)) else (bucket,)
        if len(parts) != (2 if pairs else 1) or not all(_is_int(part) and part >= 1 for part in parts):
            _fail(name, value, expected)
        buckets.append(tuple(int(part) for part in parts) if pairs else int(bucket))
    object.__setattr__(cfg, name, tuple(buckets))


# `EngineConfig.kv_cache_dtype` values and the dtype each stores K/V in (None: the compute dtype).
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}


def _check_choices(cfg: EngineConfig) -> None:
    """The fields whose valid values another module owns (delays, dtypes, quantizations, kernels, mesh axes)."""
    if cfg.default_delay_ms is not None:
        from jaxstream.models.audio import n_delay_from_ms

        try:
            n_delay_from_ms(cfg.default_delay_ms)
        except ValueError as exc:
            raise InvalidRequestError(f"EngineConfig.default_delay_ms: {exc}") from None
    if cfg.dtype is not None:
        import jax.numpy as jnp

        try:
            floating = jnp.issubdtype(jnp.dtype(cfg.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            _fail("dtype", cfg.dtype, "a floating-point dtype name (e.g. 'float32', 'bfloat16') or None")
    if cfg.quantization is not None:
        from jaxstream.models.quantization import QUANTIZATION_METHODS

        if cfg.quantization not in QUANTIZATION_METHODS:
            _fail("quantization", cfg.quantization, f"one of {', '.join(map(repr, QUANTIZATION_METHODS))} or None")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail("kv_cache_dtype", cfg.kv_cache_dtype, f"one of {', '.join(map(repr, KV_CACHE_DTYPES))}")
    if cfg.attention_impl is not None:
        from jaxstream.tpu_kernels.ring_attention import IMPLEMENTATIONS

        if cfg.attention_impl not in IMPLEMENTATIONS:
            _fail("attention_impl", cfg.attention_impl, f"one of {', '.join(IMPLEMENTATIONS)} or None")
        _check_attention_runs_here(cfg)
    if not isinstance(cfg.tp_axis, str):
        _fail("tp_axis", cfg.tp_axis, "a mesh axis name")
    if cfg.mesh is not None and cfg.tp_axis not in getattr(cfg.mesh, "axis_names", ()):
        _fail("mesh", cfg.mesh, f"a jax.sharding.Mesh with a {cfg.tp_axis!r} axis (tp_axis)")


# Pages every kernel accepts (Triton's power-of-two tiles, the portable TPU kernel's VMEM budget): the probe
# asks whether an implementation runs on this backend at these dtypes at all.
_PROBE_PAGES = (2, 1, 64, 64)  # [num_pages, kv_heads, page_size, head_dim]


def _check_attention_runs_here(cfg: EngineConfig) -> None:
    """An `attention_impl` that cannot run on this backend (Pallas on a CPU, the C++ kernel on a GPU, with
    bfloat16 pages or without a C++ compiler) is a configuration error here, in one line, rather than a
    traceback from the first compile at warm-up. The reason is the dispatcher's own check (tpu_kernels'
    `unsupported_reason`). Limits that depend on the model's shapes (Triton's head_dim) are still checked by
    the kernel when it is traced."""
    import jax

    from jaxstream.engine.builders import kv_dtype  # imports this module: imported only when called
    from jaxstream.tpu_kernels import unsupported_reason

    reason = unsupported_reason(cfg.attention_impl, jax.ShapeDtypeStruct(_PROBE_PAGES, kv_dtype(cfg)))
    if reason:
        raise InvalidRequestError(f"EngineConfig.attention_impl {cfg.attention_impl!r} cannot run here: {reason}")
