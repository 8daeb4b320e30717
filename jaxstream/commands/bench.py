"""`jaxstream bench`: concurrent realtime transcription streams through the engine (step-time percentiles,
host work per tick p50/p99, token latency of every generated id over the whole run, whether the streams
keep up with real time, tokens/s, memory-bound floor)."""
import json

from jaxstream.commands.transcribe import add_precision_arguments, checked_delay_ms, model_source
from jaxstream.errors import InvalidRequestError, UserError


def register(subparsers) -> None:
    from jaxstream.models.audio import ALLOWED_DELAYS_TEXT

    parser = subparsers.add_parser(
        "bench", help="engine benchmark: N concurrent realtime transcription streams", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model name, directory or Hugging Face id (default: the embedded tiny "
                        "model)")
    source.add_argument("--config", metavar="SHAPE", help="benchmark a model of this shape with random weights "
                        "instead: voxtral-4b, tiny, or a training TOML (needs --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help="confirm that --config builds random "
                        "weights: the timings are real, the transcripts meaningless")
    parser.add_argument("--streams", default="16", metavar="N[,N...]",
                        help="concurrent stream counts, one run each, e.g. 16,64,256 (default: 16)")
    parser.add_argument("--seconds", type=float, default=10.0, metavar="S",
                        help="seconds of audio per stream (default: 10)")
    parser.add_argument("--fast", action="store_true", help="feed all audio at once instead of at real time")
    parser.add_argument("--delay-ms", type=int, default=None, metavar="MS",
                        help=f"transcription delay in ms, {ALLOWED_DELAYS_TEXT} (default: the model's)")
    parser.add_argument("--page-size", type=int, default=64, metavar="N",
                        help="decoder KV positions per page (default: 64)")
    parser.add_argument("--encoder-page-size", type=int, default=64, metavar="N",
                        help="encoder KV frames per page (default: 64)")
    parser.add_argument("--num-pages", type=int, default=None, metavar="N",
                        help="decoder pool pages (default: every stream's full windows, fitted to device memory)")
    parser.add_argument("--encoder-num-pages", type=int, default=None, metavar="N",
                        help="encoder pool pages (default: as --num-pages)")
    parser.add_argument("--admission", choices=("demand", "window"), default="demand",
                        help="demand: KV pages as streams grow, newer streams moving to host memory for older ones; "
                        "window: each stream is committed its whole windows at admission "
                        "(EngineConfig.realtime_admission; default: demand)")
    parser.add_argument("--planned-stream-seconds", type=float, default=None, metavar="S",
                        help="demand admission, when the pools do not fit whole: split memory between the encoder "
                        "and decoder pools for streams of S seconds (EngineConfig.planned_stream_seconds; default: "
                        "the engine's, 300)")
    parser.add_argument("--steps-per-dispatch", default="1,4", metavar="K[,K...]",
                        help="80 ms steps one dispatch may run per stream when audio is queued (catch-up); each "
                        "value is compiled (default: 1,4)")
    parser.add_argument("--batch-wait-ms", type=float, default=None, metavar="MS",
                        help="how long a tick may wait for paced streams whose next slot is due, to batch them "
                        "together (default: the engine's, EngineConfig.realtime_batch_wait_ms)")
    parser.add_argument("--batch-buckets", default=None, metavar="N[,N...]",
                        help="decode batch sizes to compile (default: the --streams values)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute the 31 silent left-pad slots in every stream instead of copying them from "
                        "the engine's prefix cache (for comparing the two)")
    parser.add_argument("--dtype", default=None, help="compute and KV dtype, e.g. bfloat16 (default: float32 on "
                        "CPU, bfloat16 on accelerators)")
    add_precision_arguments(parser)
    parser.add_argument("--attention", choices=("xla", "cpu", "pallas", "pallas_tpu"), default=None,
                        help="ring attention implementation (default: the best on this backend: pallas_tpu on TPU, "
                        "pallas on GPU, cpu (the C++ kernel) on CPU, xla where none of those can run)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seed of the synthetic audio and of --random-weights (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run instead of text")
    parser.set_defaults(func=run)


def _positive_counts(text: str, flag: str) -> list[int]:
    """`16,64` -> [16, 64]; a UserError naming `flag` unless they are positive integers."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"{flag} must be positive integers separated by commas, got {text!r}")
    return counts


def run(args) -> int:
    import asyncio

    counts = _positive_counts(args.streams, "--streams")
    steps = tuple(_positive_counts(args.steps_per_dispatch, "--steps-per-dispatch"))
    buckets = tuple(_positive_counts(args.batch_buckets, "--batch-buckets")) if args.batch_buckets else tuple(counts)
    if args.config and not args.random_weights:
        raise UserError("--config builds a model with random weights; add --random-weights")
    if args.random_weights and not args.config:
        raise UserError("--random-weights needs --config (voxtral-4b, tiny or a training TOML)")
    if args.seconds <= 0:
        raise UserError("--seconds must be positive")
    checked_delay_ms(args.delay_ms)
    return asyncio.run(_run(args, counts, steps, buckets))


async def _run(args, counts, steps, buckets) -> int:
    import dataclasses

    from jaxstream.engine import benchmark
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.builders import freeze_startup_heap
    from jaxstream.engine.config import EngineConfig

    max_streams = max(counts)
    tuning = {name: value for name, value in (("realtime_batch_wait_ms", args.batch_wait_ms),
                                              ("planned_stream_seconds", args.planned_stream_seconds),
                                              ("kv_cache_dtype", args.kv_cache_dtype))
              if value is not None}
    try:
        config = EngineConfig(max_sessions=max_streams, page_size=args.page_size,
                              encoder_page_size=args.encoder_page_size, realtime_step_buckets=steps, dtype=args.dtype,
                              batch_buckets=buckets, max_queued_audio_seconds=max(600.0, 2 * args.seconds),
                              cache_silent_prefix=not args.no_prefix_cache, attention_impl=args.attention,
                              num_pages=args.num_pages, encoder_num_pages=args.encoder_num_pages,
                              realtime_admission=args.admission, quantization=args.quantization, **tuning)
    except InvalidRequestError as exc:  # a flag's value the engine rejects (--page-size 0, --batch-wait-ms -5)
        raise UserError(str(exc)) from None
    if args.config:
        model, tokenizer = _random_model(args.config, config, args.seed)
        # The engine sizes the pools (full windows for every stream, fitted to device memory): window
        # admission commits a stream's full windows, so pools sized for short streams would hold fewer at once.
        engine = AsyncEngine(model, config=config, tokenizer=tokenizer)
    else:
        engine = AsyncEngine.from_pretrained(model_source(args.model), config=config)
    if engine.kind != "realtime":
        raise UserError("jaxstream bench runs realtime transcription streams: it needs a Voxtral Realtime model")
    freeze_startup_heap()  # as `jaxstream serve` does: no full garbage collection of the engine's objects
    try:
        for streams in counts:
            result = await benchmark.run_streams(engine, streams=streams, seconds=args.seconds, paced=not args.fast,
                                                 delay_ms=args.delay_ms, seed=args.seed)
            if args.json:
                print(json.dumps(dataclasses.asdict(result)), flush=True)
            else:
                print("\n".join(result.lines()), flush=True)
    finally:
        await engine.shutdown()
    return 0


def _random_model(name: str, engine_config, seed: int):
    import dataclasses
    import importlib.resources
    from pathlib import Path

    from flax import nnx

    from jaxstream.engine.benchmark import SyntheticTokenizer
    from jaxstream.engine.builders import engine_dtype
    from jaxstream.models.config import VOXTRAL_MINI_4B
    from jaxstream.models.voxtral import VoxtralRealtime

    if name == "voxtral-4b":
        cfg = VOXTRAL_MINI_4B
    else:
        from jaxstream.training.config import load_train_config

        path = Path(name) if name.endswith(".toml") else importlib.resources.files("jaxstream.configs") / f"{name}.toml"
        if not path.is_file():
            raise UserError(f"unknown --config {name!r}: use voxtral-4b, tiny, or a training TOML file")
        cfg = load_train_config(path).model
    # Random weights would end streams at a random end-of-text token; a benchmark runs them to the end.
    cfg = dataclasses.replace(cfg, eos_id=-1)
    dtype = engine_dtype(engine_config)

    @nnx.jit
    def create():
        return VoxtralRealtime(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)

    if engine_config.quantization:  # here, so that the float weights are gone before the engine sizes its pools
        from jaxstream.models.quantization import quantize_model

        return quantize_model(create(), engine_config.quantization), SyntheticTokenizer(cfg.text.vocab_size)
    return create(), SyntheticTokenizer(cfg.text.vocab_size)
