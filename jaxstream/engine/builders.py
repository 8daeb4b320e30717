"""Builds an engine core (device cache + compiled programs + scheduler) for a model."""
import dataclasses
import gc
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxstream.engine import kv_cache, sharding, steps, text_prefix_cache
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import GENERATION_CONFIGS, SamplingParams
from jaxstream.engine.text_scheduler import STACK, TextScheduler
from jaxstream.models.config import TextConfig, VoxtralConfig

logger = logging.getLogger(__name__)


def model_config(model) -> TextConfig | VoxtralConfig:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if not isinstance(cfg, (TextConfig, VoxtralConfig)):
        raise TypeError(f"{type(model).__name__} has no TextConfig/VoxtralConfig `cfg` attribute")
    return cfg


def engine_dtype(engine_cfg: EngineConfig):
    if engine_cfg.dtype is not None:
        return jnp.dtype(engine_cfg.dtype)
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def kv_dtype(engine_cfg: EngineConfig):
    """The dtype the KV pages are stored in (`EngineConfig.kv_cache_dtype`)."""
    from jaxstream.engine.config import KV_CACHE_DTYPES

    stored = KV_CACHE_DTYPES[engine_cfg.kv_cache_dtype]
    return engine_dtype(engine_cfg) if stored is None else jnp.dtype(stored)


def load_pretrained(model_source, engine_cfg: EngineConfig, *, dtype=None):
    """(model, tokenizer, declared EOS ids or None) of a built-in name, local directory or hub id, with the
    parameters placed as `engine_cfg`'s mesh wants them (each process reads only its own shards) and quantized as
    they are read when `engine_cfg.quantization` says so."""
    from jaxstream.models import checkpoint_metadata, loading

    placement = sharding.Placement(engine_cfg.mesh, engine_cfg.tp_axis)
    rule = placement.param_sharding if engine_cfg.mesh is not None else None
    directory = loading.resolve_model_dir(model_source)
    loaded = loading.load_model(directory, dtype=dtype or engine_dtype(engine_cfg), sharding=rule,
                                quantization=engine_cfg.quantization)
    tokenizer = loading.load_checkpoint_tokenizer(directory, loaded.tokenizer_path)
    _, eos_ids = checkpoint_metadata.declared_token_ids(directory)
    return loaded.model, tokenizer, eos_ids or None


class Pretrained(NamedTuple):
    """What `AsyncEngine.from_pretrained` builds its engine from (its keyword arguments)."""

    model: Any
    tokenizer: Any
    eos_token_id: tuple[int, ...] | None  # the declared EOS ids; None: the tokenizer's
    default_sampling_params: SamplingParams


def load_for_engine(model_source, engine_cfg: EngineConfig, *, dtype=None, generation_config: str = "auto"):
    """`load_pretrained`, with the checkpoint's sampling defaults (`checkpoint_sampling_params`)."""
    from jaxstream.models import loading

    directory = loading.resolve_model_dir(model_source)  # once: a hub id is not looked up twice
    model, tokenizer, eos_ids = load_pretrained(directory, engine_cfg, dtype=dtype)
    return Pretrained(model, tokenizer, eos_ids, checkpoint_sampling_params(model, directory, generation_config))


def checkpoint_sampling_params(model, directory, generation_config: str = "auto") -> SamplingParams:
    """vLLM's `LLM.get_default_sampling_params()` for `model`'s checkpoint `directory`: with `generation_config`
    "auto", the sampling defaults it declares (`checkpoint_metadata.declared_sampling_defaults`); with "vllm",
    none. Voxtral Realtime transcribes greedily: none either."""
    from jaxstream.models import checkpoint_metadata

    if generation_config not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, "
                         f"got {generation_config!r}")
    if generation_config == "vllm" or isinstance(model_config(model), VoxtralConfig):
        return SamplingParams()
    return SamplingParams(**checkpoint_metadata.declared_sampling_defaults(directory))


def build_core(model, engine_cfg: EngineConfig, *, tokenizer=None, eos_token_id=None):
    """The engine core that serves `model`: Voxtral Realtime's transcription scheduler, or the text scheduler
    (stopping at `eos_token_id`, else the tokenizer's EOS; the EOS a tokenizer_config.json names is the model's
    own, as vLLM takes it, and any other reports its id as stop_reason). Every program is compiled before it returns.
    With `engine_cfg.quantization`, a float `model` is served quantized (`quantization.quantize_model`).

    Over a mesh that spans processes, parked sessions are never offloaded to host memory: an offload is a
    program of its own that the followers would have to mirror, so such sessions stay (or recompute)."""
    from jaxstream.engine import multihost
    from jaxstream.models import quantization

    if engine_cfg.quantization and not quantization.is_quantized(model):
        model = quantization.quantize_model(model, engine_cfg.quantization)
    if multihost.spans_processes(engine_cfg.mesh) and engine_cfg.host_offload_bytes:
        logger.info("multi-host engine: parked sessions stay on the devices (no host offload)")
        engine_cfg = dataclasses.replace(engine_cfg, host_offload_bytes=0)
    if isinstance(model_config(model), VoxtralConfig):
        if tokenizer is None:
            raise ValueError("Voxtral Realtime needs its tokenizer (tekken.json) for transcription")
        return build_realtime_core(model, engine_cfg, tokenizer)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_id
    return build_text_core(model, engine_cfg, eos_token_id=eos_token_id,
                           primary_eos_token_id=tokenizer.named_eos_id if tokenizer is not None else None,
                           tokenizer=tokenizer)


def build_text_core(model, engine_cfg: EngineConfig, *, eos_token_id=None, primary_eos_token_id=None,
                    tokenizer=None, warm_up=True) -> TextScheduler:
    """The text scheduler over `model`, stopping at `eos_token_id` (one id or several) and at
    `primary_eos_token_id` (default: the first of them), which reports stop_reason None; any other reports its id."""
    cfg = model_config(model)
    max_model_len = min(engine_cfg.max_model_len or cfg.max_positions, cfg.max_positions)
    ring = min(cfg.attention_window, max_model_len)
    if ring < cfg.attention_window:
        # No session outgrows max_model_len, so attending over the ring alone is exact, and the kernel
        # must not be asked for a window the ring does not hold.
        model = model.with_attention_window(ring)
    spec = kv_cache.stack_spec(
        STACK, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        page_size=engine_cfg.page_size, ring=ring, num_pages=engine_cfg.num_pages,
        max_sessions=engine_cfg.max_sessions)
    placement = sharding.Placement(engine_cfg.mesh, engine_cfg.tp_axis)
    slot_shapes = steps.text_slot_shapes(cfg.vocab_size)
    # Replicated: every device of the mesh holds the slot rows (free memory is counted over all of them).
    [spec] = fit_pools([spec], engine_cfg, placement,
                       kv_cache.slot_row_bytes(slot_shapes) * engine_cfg.max_sessions * placement.size)
    check_pool(spec)
    caching = engine_cfg.enable_prefix_caching and text_prefix_cache.supported(spec, max_model_len)
    if engine_cfg.enable_prefix_caching and not caching:
        logger.info("prefix caching is off: the %d-position page ring is shorter than max_model_len %d (a "
                    "session would rewrite its own shared pages)", spec.pages_per_window * spec.page_size,
                    max_model_len)
    cache = kv_cache.DeviceCache([spec], slot_shapes, engine_cfg.max_sessions, kv_dtype(engine_cfg),
                                 shardings={STACK: placement.kv_sharding(spec)},
                                 slot_sharding=placement.replicated(),
                                 pool_types={STACK: text_prefix_cache.CachingPagePool} if caching else None)
    programs = steps.Programs(model, cache, **placement.program_shardings(model, cache))
    scheduler = TextScheduler(programs, engine_cfg, cfg, max_model_len=max_model_len, eos_token_id=eos_token_id,
                              primary_eos_token_id=primary_eos_token_id, tokenizer=tokenizer)
    if warm_up:
        _warm_up(scheduler)
    return scheduler


def _warm_up(scheduler) -> None:
    """Compiles every program the scheduler can dispatch and runs each one at the attention buckets its
    streams meet early (first_runs.py), and logs what start-up cost."""
    start = time.perf_counter()
    scheduler.warm_up()
    logger.info("compiled and warmed %d step programs in %.1f s (decode batch buckets %s; the EngineConfig docstring "
                "says which settings compile fewer)", len(scheduler.programs), time.perf_counter() - start,
                scheduler.cfg.decode_batch_buckets)


def freeze_startup_heap() -> None:
    """Takes every object alive now (imports, the model, the compiled programs) out of the cyclic garbage
    collector's view, for a process that built its engine and now serves with it.

    A full collection visits every tracked object: with the ~260,000 a loaded engine holds, each one stopped
    every thread (the engine's tick and the event loop alike) for 140-190 ms, and the allocations of a
    busy engine trigger one every few seconds to minutes (the 99th-percentile tick of 256 tiny-model streams:
    49-65 ms, 4.0-4.8 ms frozen; benchmarks/scheduler_tick.py). Frozen objects are still freed by reference
    counting; only cycles among them would stay, and these objects live as long as the engine. vLLM freezes
    its heap after warm-up for the same reason. Not for a process that builds engines over and over (tests).
    """
    gc.collect()
    gc.freeze()


def fit_pools(specs: list[kv_cache.StackSpec], engine_cfg: EngineConfig, placement,
              reserved_bytes: int = 0, stream_pages: dict[str, int] | None = None) -> list[kv_cache.StackSpec]:
    """Scales default-sized pools down to `kv_memory_fraction` of the device's free memory (on CPU, the
    host's available memory), less `reserved_bytes` that other state takes (a text engine's penalty counts: one
    int32 per slot and vocabulary id, 33.5 MB for 64 slots of a 131k vocabulary).

    Pools the user sized explicitly are kept. A smaller pool holds fewer sessions at once: text sessions
    hold only the pages they use, while a transcription stream is committed its full windows, or its whole
    length when it has an audio limit (the limit rules of `EngineConfig`), so under window admission every pool
    is scaled alike. Under demand admission streams hold the pages they use, and with `stream_pages` (the pages
    of each pool a stream of `EngineConfig.planned_stream_seconds` holds) the pools are planned for such
    streams (`_planned_split`): scaling them alike would give most of the memory to Voxtral's decoder window
    (8,192 slots, 11 minutes), which a voice turn leaves mostly empty, while its encoder window (750 frames,
    15 s) is full in any stream past 15 s and runs out first.
    """
    explicit = {"text": engine_cfg.num_pages, "decoder": engine_cfg.num_pages,
                "encoder": engine_cfg.encoder_num_pages}
    free = _free_device_bytes(placement)
    if free is None:
        return specs
    dtype = kv_dtype(engine_cfg)
    defaulted = [spec for spec in specs if explicit.get(spec.name) is None]
    wanted = sum((spec.num_pages - 1) * spec.bytes_per_page(dtype) for spec in defaulted)
    budget = engine_cfg.kv_memory_fraction * free - reserved_bytes - sum(
        spec.num_pages * spec.bytes_per_page(dtype) for spec in specs if spec not in defaulted)
    if wanted <= budget:
        return specs
    if engine_cfg.realtime_admission == "demand" and stream_pages is not None and len(defaulted) > 1:
        planned = _planned_split(defaulted, budget, dtype, stream_pages, engine_cfg.max_sessions)
        if planned is not None:
            streams, pages = planned
            logger.info("page pools planned for %d streams of %g s in %.1f GB of free memory (demand admission): %s; "
                        "longer streams grow into the rest (EngineConfig.planned_stream_seconds)", streams,
                        engine_cfg.planned_stream_seconds, free / 1e9, ", ".join(
                            f"{spec.name} {pages[spec.name]} pages ({pages[spec.name] / spec.pages_per_window:.1f} "
                            f"full windows)" for spec in defaulted))
            return [dataclasses.replace(spec, num_pages=1 + pages[spec.name]) if spec in defaulted else spec
                    for spec in specs]
    scale = max(budget, 0) / wanted
    logger.info("page pools scaled to %.0f %% of %d sessions' full windows to fit %.1f GB of free memory",
                100 * scale, engine_cfg.max_sessions, free / 1e9)
    return [dataclasses.replace(spec, num_pages=1 + max(spec.pages_per_window, int((spec.num_pages - 1) * scale)))
            if spec in defaulted else spec for spec in specs]


def _planned_split(specs, budget: float, dtype, stream_pages: dict[str, int], max_sessions: int):
    """(streams, pages by pool) that give each pool in `specs` the `stream_pages` of as many streams as `budget`
    bytes hold (at most `max_sessions`; at least one whole window a pool, which one stream may fill), and the bytes
    left to the pools that a longer stream still grows in, in proportion to that growth (Voxtral's decoder: its
    encoder window is full by then); None when not one such stream fits."""
    page_bytes = {spec.name: spec.bytes_per_page(dtype) for spec in specs}

    def floor(streams):  # pages by pool that hold `streams` planned streams and one whole window
        return {spec.name: max(spec.pages_per_window, streams * stream_pages[spec.name]) for spec in specs}

    def cost(pages):
        return sum(pages[name] * page_bytes[name] for name in pages)

    streams = min(max_sessions, int(budget // sum(stream_pages[name] * page_bytes[name] for name in page_bytes)))
    while streams >= 1 and cost(floor(streams)) > budget:
        streams -= 1
    if streams < 1:
        return None
    pages = floor(streams)
    growth = {spec.name: (spec.pages_per_window - stream_pages[spec.name]) * page_bytes[spec.name] for spec in specs}
    if not any(growth.values()):  # planned past every window: what is left is shared as the windows are
        growth = {name: stream_pages[name] * page_bytes[name] for name in page_bytes}
    left = budget - cost(pages)
    return streams, {name: pages[name] + int(left * growth[name] / sum(growth.values()) // page_bytes[name])
                     for name in pages}


def _free_device_bytes(placement) -> int | None:
    """Free memory of the devices the pools live on, or None where unknown. A CPU device reports no limit:
    its memory is the host's, so the host's available memory stands in (without it, a CPU engine with the
    windows of Voxtral 4B allocated 1-2 GB per session up front until the kernel killed it)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * placement.size
    if jax.default_backend() != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # not Linux: no reading


def check_pool(spec: kv_cache.StackSpec) -> None:
    if spec.num_pages - 1 < spec.pages_per_window:
        raise ValueError(f"the {spec.name} page pool ({spec.num_pages - 1} usable pages) cannot hold one "
                         f"session's window ({spec.pages_per_window} pages of {spec.page_size})")


def realtime_stack_specs(cfg: VoxtralConfig, engine_cfg: EngineConfig) -> list[kv_cache.StackSpec]:
    """The encoder and decoder KV stacks of a Voxtral engine, their pools as `engine_cfg` sizes them (before
    `fit_pools`)."""
    enc, text = cfg.encoder, cfg.text
    common = dict(max_sessions=engine_cfg.max_sessions)
    return [
        kv_cache.stack_spec("encoder", num_layers=enc.num_layers, num_kv_heads=enc.num_heads, head_dim=enc.head_dim,
                            page_size=engine_cfg.encoder_page_size, ring=enc.sliding_window,
                            num_pages=engine_cfg.encoder_num_pages, **common),
        kv_cache.stack_spec("decoder", num_layers=text.num_layers, num_kv_heads=text.num_kv_heads,
                            head_dim=text.head_dim, page_size=engine_cfg.page_size, ring=text.attention_window,
                            num_pages=engine_cfg.num_pages, **common),
    ]


def planned_stream_pages(cfg: VoxtralConfig, engine_cfg: EngineConfig) -> dict[str, int] | None:
    """The pages of each pool that a stream of `engine_cfg.planned_stream_seconds` at the default delay holds at
    its end (None: no plan, full windows)."""
    from jaxstream.engine.realtime_admission import stream_pages
    from jaxstream.models.audio import n_delay_from_ms, stream_slot_bound

    if engine_cfg.planned_stream_seconds is None:
        return None
    n_delay = n_delay_from_ms(engine_cfg.default_delay_ms or cfg.default_delay_ms)
    slots = stream_slot_bound(engine_cfg.planned_stream_seconds, n_delay, cfg.n_left_pad_tokens)
    return stream_pages({spec.name: spec for spec in realtime_stack_specs(cfg, engine_cfg)}, slots,
                        cfg.downsample_factor)


def build_realtime_core(model, engine_cfg: EngineConfig, tokenizer, *, warm_up=True):
    from jaxstream.engine import prefix_cache
    from jaxstream.engine.transcription_scheduler import RealtimeScheduler
    from jaxstream.models.audio import ALLOWED_DELAYS_MS, n_delay_from_ms, prompt_length

    cfg = model_config(model)
    enc = cfg.encoder
    placement = sharding.Placement(engine_cfg.mesh, engine_cfg.tp_axis)
    specs = fit_pools(realtime_stack_specs(cfg, engine_cfg), engine_cfg, placement,
                      stream_pages=planned_stream_pages(cfg, engine_cfg))
    for spec in specs:
        check_pool(spec)
    # The prefix cache's pages come on top of the pools sized above.
    by_name = {spec.name: spec for spec in specs}
    prefix_slots, _ = prefix_cache.prefix_layout(cfg, by_name, engine_cfg.cache_silent_prefix)
    held_out = prefix_cache.held_out_pages(cfg, by_name, engine_cfg.cache_silent_prefix)
    specs = [dataclasses.replace(spec, num_pages=spec.num_pages + held_out[spec.name]) for spec in specs]
    slot_shapes = {
        "conv1": ((2, enc.num_mel_bins), jnp.float32),  # float32 holds any compute dtype exactly
        "conv2": ((1, enc.hidden_size), jnp.float32),
        "last_token": ((), jnp.int32),
    }
    cache = kv_cache.DeviceCache(specs, slot_shapes, engine_cfg.max_sessions, kv_dtype(engine_cfg),
                                 shardings={spec.name: placement.kv_sharding(spec) for spec in specs},
                                 slot_sharding=placement.replicated(),
                                 reserved_slots=prefix_cache.RESERVED_SLOTS if prefix_slots else 0)
    programs = steps.Programs(model, cache, **placement.program_shardings(model, cache))
    buckets = engine_cfg.realtime_prefill_buckets
    if buckets is None:
        default_ms = engine_cfg.default_delay_ms or cfg.default_delay_ms
        # Chunks in multiples of 8 slots (TPU f32 sublanes), not 16: the default prompt after the cached
        # prefix is 8 slots, and a 16-slot chunk computed 8 padding slots per stream, half of a prefill (the
        # random mid-size Voxtral, 32 rows: 222-229 ms a dispatch at 16 slots).
        default_chunk, longest_chunk = (
            -(-(prompt_length(n_delay_from_ms(ms), cfg.n_left_pad_tokens) - prefix_slots) // 8) * 8
            for ms in (default_ms, max(ALLOWED_DELAYS_MS)))
        # 32 rows at the default delay: a burst of new streams is prefilled at once, not 8 per tick (32
        # streams starting together then decoded in groups of 8, 16 and 24 rows padded to 32, at the start and
        # again at the end: 25 % of a 4 s run of the mid-size model on the 2-core CPU).
        buckets = tuple(sorted({(min(rows, engine_cfg.max_sessions), chunk) for rows in (1, 8)
                                for chunk in (default_chunk, longest_chunk)}
                               | {(min(32, engine_cfg.max_sessions), default_chunk)}))
    scheduler = RealtimeScheduler(programs, engine_cfg, cfg, tokenizer, prefill_buckets=buckets)
    if warm_up:
        _warm_up(scheduler)
    return scheduler
