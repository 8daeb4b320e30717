"""`jaxstream bench`: concurrent realtime transcription streams through the engine (step-time percentiles,
streams sustainable at real time, tokens/s, host overhead per tick, memory-bound floor)."""
import argparse
import json

from jaxstream.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="engine benchmark: N concurrent realtime transcription streams",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model source (built-in name, directory or hub id)")
    source.add_argument("--config", help="random-weight model shape: voxtral-4b, tiny, or a training TOML")
    parser.add_argument("--random-weights", action="store_true", help="required with --config")
    parser.add_argument("--streams", default="16", help="comma-separated stream counts to run, e.g. 16,64,256")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per stream")
    parser.add_argument("--fast", action="store_true", help="feed all audio at once instead of at real time")
    parser.add_argument("--delay-ms", type=int, default=None, help="transcription delay (default: the model's)")
    parser.add_argument("--page-size", type=int, default=64, help="decoder KV positions per page")
    parser.add_argument("--encoder-page-size", type=int, default=64, help="encoder KV frames per page")
    parser.add_argument("--steps-per-dispatch", default="1,4", help="realtime step buckets (catch-up)")
    parser.add_argument("--batch-buckets", default=None,
                        help="decode batch buckets to compile (default: the --streams values)")
    parser.add_argument("--dtype", default=None, help="compute and KV dtype (default: bf16 on accelerators)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    parser.set_defaults(func=run)


def _stream_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--streams must be positive integers separated by commas, got {text!r}")
    return counts


def run(args) -> int:
    import asyncio

    counts = _stream_counts(args.streams)
    steps = tuple(_stream_counts(args.steps_per_dispatch))
    buckets = tuple(_stream_counts(args.batch_buckets)) if args.batch_buckets else tuple(counts)
    if args.config and not args.random_weights:
        raise UserError("--config builds a model with random weights; add --random-weights")
    if args.random_weights and not args.config:
        raise UserError("--random-weights needs --config (voxtral-4b, tiny or a training TOML)")
    if args.seconds <= 0:
        raise UserError("--seconds must be positive")
    return asyncio.run(_run(args, counts, steps, buckets))


async def _run(args, counts, steps, buckets) -> int:
    import dataclasses

    from jaxstream.engine import benchmark
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig

    max_streams = max(counts)
    config = EngineConfig(max_sessions=max_streams, page_size=args.page_size,
                          encoder_page_size=args.encoder_page_size, realtime_step_buckets=steps, dtype=args.dtype,
                          batch_buckets=buckets, max_queued_audio_seconds=max(600.0, 2 * args.seconds))
    if args.config:
        model, tokenizer = _random_model(args.config, config, args.seed)
        config = _pools_for(config, model.cfg, args.seconds, max_streams)
        engine = AsyncEngine(model, config=config, tokenizer=tokenizer)
    else:
        engine = AsyncEngine.from_pretrained(args.model or "tiny", config=config)
    if engine.kind != "realtime":
        raise UserError("jaxstream bench runs realtime transcription streams: it needs a Voxtral Realtime model")
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


def _pools_for(config, model_cfg, seconds: float, streams: int):
    """Page pools sized for `streams` sessions of `seconds` of audio (plus prompt and end padding), not for
    full windows: the paged rings let short sessions hold only what they use."""
    import dataclasses
    import math

    slots = math.ceil(seconds / 0.08) + model_cfg.n_left_pad_tokens + 2 * 30 + 11  # prompt + flush, any delay
    frames = slots * model_cfg.downsample_factor
    dec = math.ceil(min(slots, model_cfg.text.attention_window) / config.page_size) + 1
    enc = math.ceil(min(frames, model_cfg.encoder.sliding_window) / config.encoder_page_size) + 1
    return dataclasses.replace(config, num_pages=streams * dec + 1, encoder_num_pages=streams * enc + 1)


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

    return create(), SyntheticTokenizer(cfg.text.vocab_size)
