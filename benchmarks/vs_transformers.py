"""The engine side by side with transformers: the same Hugging Face-format Voxtral Realtime directory, the same
audio, B streams at once, float32 greedy on both sides.

    pip install -e ".[bench]"       # torch, transformers and mistral-common[audio]: this script's extras only
    python benchmarks/vs_transformers.py --build-tiny /tmp/vt_tiny --batch 8,32 --seconds 4 --repeats 3
    python benchmarks/vs_transformers.py --build-mid /tmp/vt_mid --batch 8,32 --seconds 4 --repeats 3
    python benchmarks/vs_transformers.py --model DIR     # any HF-format Voxtral Realtime directory + tekken.json

transformers runs its streaming `generate`: the processor's streaming mode makes the first chunk's features
(prompt + 9000 samples at 480 ms) and then one 80 ms chunk (1680 samples, 8 mel frames) per decoding step
for all B streams in lock-step, pulled from a generator; the decoder and encoder caches are transformers'
defaults (dynamic, sliding). The engine runs B concurrent `start_transcription` sessions of the public
API, each fed the same audio in 80 ms appends as fast as it takes them; it computes whatever audio is
queued (several 80 ms steps per dispatch, `--steps-per-dispatch`). Both sides stream the same padded audio
(the engine's end-of-stream right padding is appended to transformers' chunks), so both generate the same
number of tokens, and both timings include the front end (log-mel) and every token of the stream.

x real time = B x audio seconds / wall seconds. Runs alternate between the engine and transformers (the
first side alternates too) in one process, each side warmed up first; the table shows the median over
`--repeats` and the ratio of medians. Token agreement compares stream 0's greedy tokens (and counts the
streams whose tokens are identical on both sides). The built models are random (every parameter perturbed
after transformers' init, the tekken vocabulary of tests/fixtures/voxtral_tiny: 1100 ids): their timings
are real, their transcripts meaningless. The CPU is shared: the load average is printed with the table. On
an oversubscribed machine torch's OpenMP threads wait on each other at every operator (a tiny model's step
was 20x slower with 2 threads than with 1 at a load average of 16); `--threads 1` gives transformers its
best case there.
"""
import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from jaxstream import allocator
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.transcription_session import TranscriptionDone
from jaxstream.models.audio import (
    SAMPLES_PER_SLOT, SAMPLING_RATE, SLOT_SECONDS, left_pad_samples, n_delay_from_ms, prompt_length,
    right_pad_samples,
)

ROOT = Path(__file__).resolve().parents[1]
TEKKEN = ROOT / "tests" / "fixtures" / "voxtral_tiny" / "tekken.json"  # v13 format, 1000 specials + 100 pieces
VOCAB = 1100
# Added to every parameter after transformers' init (norms 1, biases 0, weights std 0.02), as the reference
# fixtures do: at the init alone the tied-embedding decoder mostly repeats its input token.
PERTURB_STD = 0.2
ROPE = {"rope_type": "default", "rope_theta": 1e6}
# (encoder, decoder) shapes of the models --build-tiny / --build-mid write.
SHAPES = {
    # tests/fixtures/voxtral_tiny's shapes: narrow windows (12 encoder frames, 96 decoder positions).
    "tiny": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=12,
                  sliding_window=12),
             dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, sliding_window=96)),
    # 24.1 M parameters with the real model's windows (750 encoder frames, 8192 decoder positions).
    "mid": (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
                 sliding_window=750),
            dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, sliding_window=8192)),
}


def _torch():
    try:
        import torch
        import transformers
    except ImportError as exc:
        sys.exit(f"vs_transformers.py needs torch and transformers ({exc}): pip install -e '.[bench]'")
    transformers.logging.set_verbosity_error()  # generate's per-call notes about pad ids and lengths
    # Streaming generate sets max_length itself (it stops when the chunks run out), then warns about it.
    warnings.filterwarnings("ignore", message="Using the model-agnostic default `max_length`")
    return torch, transformers


def build_model_dir(shape: str, directory: Path, seed: int) -> None:
    """Writes a random Voxtral Realtime of `shape` as a transformers directory (config.json, model.safetensors,
    preprocessor_config.json) with a tekken.json, loadable by both the engine and transformers."""
    torch, transformers = _torch()
    encoder, decoder = SHAPES[shape]
    config = transformers.VoxtralRealtimeConfig(
        audio_config=dict(num_mel_bins=128, rms_norm_eps=1e-5, rope_parameters=ROPE, **encoder),
        text_config=dict(vocab_size=VOCAB, rms_norm_eps=1e-5, rope_parameters=ROPE, tie_word_embeddings=True,
                         **decoder),
        downsample_factor=4, audio_length_per_tok=8, default_num_delay_tokens=6)
    torch.manual_seed(seed)
    model = transformers.VoxtralRealtimeForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(PERTURB_STD * torch.randn(param.shape, generator=generator))
        # A zero row of the tied embedding gives end-of-text a logit of 0, below the maximum of the other
        # ~1100, so no random stream ends early and every run does the same work on both sides.
        model.model.language_model.embed_tokens.weight[config.text_config.eos_token_id] = 0.0
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    transformers.VoxtralRealtimeFeatureExtractor().save_pretrained(directory)
    shutil.copyfile(TEKKEN, directory / "tekken.json")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote a random {shape} Voxtral Realtime ({params:.1f} M parameters) to {directory}", flush=True)


def synthetic_audio(streams: int, slots: int, seed: int) -> np.ndarray:
    """[streams, slots * 1280] float32: tones, a chirp and noise, different for every stream."""
    rng = np.random.default_rng(seed)
    t = np.arange(slots * SAMPLES_PER_SLOT) / SAMPLING_RATE
    rows = []
    for _ in range(streams):
        f0, f1 = rng.uniform(150, 600, 2)
        tone = 0.3 * np.sin(2 * np.pi * f0 * t) * (np.sin(2 * np.pi * rng.uniform(0.3, 1.0) * t) > 0)
        chirp = 0.3 * np.sin(2 * np.pi * (f1 * t + 150 * t**2))
        rows.append(tone + chirp + 0.05 * rng.standard_normal(t.size))
    return np.stack(rows).astype(np.float32)


# ------------------------------------------------------------------------------------------------- engine

async def engine_run(engine: AsyncEngine, audio: np.ndarray) -> tuple[float, list[list[int]]]:
    """Wall seconds and every stream's generated ids for `audio` [B, N] through B concurrent sessions."""
    await engine.wait_until_idle()
    start = time.perf_counter()
    sessions = [await engine.start_transcription() for _ in audio]

    async def feed(session, pcm):
        for offset in range(0, pcm.size, SAMPLES_PER_SLOT):
            await session.append(pcm[offset : offset + SAMPLES_PER_SLOT])
        await session.finish()

    async def result(session):
        done = [event async for event in session if isinstance(event, TranscriptionDone)]
        return done[0].token_ids

    feeders = [asyncio.create_task(feed(s, pcm)) for s, pcm in zip(sessions, audio)]
    tokens = await asyncio.gather(*(result(s) for s in sessions))
    await asyncio.gather(*feeders)
    return time.perf_counter() - start, list(tokens)


# ------------------------------------------------------------------------------------------- transformers

class TransformersStreams:
    """transformers' streaming `generate` over B streams in lock-step, one 80 ms chunk per step."""

    def __init__(self, directory: Path, threads: int | None):
        torch, transformers = _torch()
        if threads is not None:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.VoxtralRealtimeForConditionalGeneration.from_pretrained(
            directory, dtype=torch.float32).eval()
        self.processor = transformers.VoxtralRealtimeProcessor.from_pretrained(directory)
        self.n_delay = self.processor.num_delay_tokens
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def run(self, audio: np.ndarray) -> tuple[float, list[list[int]]]:
        """Wall seconds and every stream's generated ids (up to and including an end-of-text)."""
        processor = self.processor
        extractor = processor.feature_extractor
        # The engine appends this right padding at the end of a stream; the extra chunk of zeros covers the
        # last chunk's look-ahead (the engine's front end treats the samples past the padding as zeros).
        pad = right_pad_samples(audio.shape[1], self.n_delay)
        stream = np.concatenate([audio, np.zeros((len(audio), pad + processor.num_samples_per_audio_chunk),
                                                 np.float32)], axis=1)
        # Chunks after the first (the prompt's slots): every slot but the last, whose token would describe
        # audio past the end; the engine (like transformers' offline generate) never feeds it.
        total_slots = (left_pad_samples() + audio.shape[1] + pad) // SAMPLES_PER_SLOT
        steps = total_slots - prompt_length(self.n_delay) - 1
        start = time.perf_counter()
        first = processor(list(stream[:, : processor.num_samples_first_audio_chunk]), is_streaming=True,
                          is_first_audio_chunk=True, sampling_rate=SAMPLING_RATE, return_tensors="pt")

        def chunks():
            yield first["input_features"]
            for step in range(steps):
                mel = processor.num_mel_frames_first_audio_chunk + step * processor.audio_length_per_tok
                offset = mel * extractor.hop_length - extractor.win_length // 2
                yield processor(list(stream[:, offset : offset + processor.num_samples_per_audio_chunk]),
                                is_streaming=True, is_first_audio_chunk=False, sampling_rate=SAMPLING_RATE,
                                return_tensors="pt")["input_features"]

        with self.torch.inference_mode():
            out = self.model.generate(input_ids=first["input_ids"], attention_mask=first["attention_mask"],
                                      input_features=chunks(), num_delay_tokens=first["num_delay_tokens"],
                                      do_sample=False)
        wall = time.perf_counter() - start
        return wall, [self._until_eos(row) for row in out[:, first["input_ids"].shape[1]:].tolist()]

    def _until_eos(self, row: list[int]) -> list[int]:
        """A finished row of a batch is padded to the longest one; the engine's stream ends at its EOS."""
        ends = [i for i, token in enumerate(row) if token in self.eos_ids]
        return row[: ends[0] + 1] if ends else row


# ------------------------------------------------------------------------------------------------- report

def agreement(engine_tokens: list[list[int]], hf_tokens: list[list[int]]) -> tuple[str, int]:
    """A sentence on stream 0's tokens, and the number of streams whose tokens are identical."""
    ours, theirs = engine_tokens[0], hf_tokens[0]
    if ours == theirs:
        line = f"stream 0: the same {len(ours)} greedy tokens from both"
    else:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        same = sum(a == b for a, b in zip(ours, theirs))
        line = (f"stream 0: tokens differ from index {first} on ({same}/{max(len(ours), len(theirs))} equal; "
                f"engine {len(ours)} tokens, transformers {len(theirs)})")
    return line, sum(a == b for a, b in zip(engine_tokens, hf_tokens))


def table(batches: list[int], seconds: float, times: dict) -> list[str]:
    lines = ["| batch | engine x real time | transformers x real time | engine / transformers |",
             "|---:|---:|---:|---:|"]
    for batch in batches:
        ours, theirs = (batch * seconds / statistics.median(times[side, batch]) for side in ("engine", "hf"))
        lines.append(f"| {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    return lines


async def compare(args, directory: Path) -> None:
    batches = _positive_ints(args.batch, "--batch")
    steps = _positive_ints(args.steps_per_dispatch, "--steps-per-dispatch")
    slots = max(1, round(args.seconds / SLOT_SECONDS))
    seconds = slots * SLOT_SECONDS
    audio = synthetic_audio(max(batches), slots, args.seed)
    warm = audio[:, : min(audio.shape[1], round(1.0 / SLOT_SECONDS) * SAMPLES_PER_SLOT)]
    hf = TransformersStreams(directory, args.threads)
    engine = AsyncEngine.from_pretrained(directory, config=EngineConfig(
        max_sessions=max(batches), batch_buckets=tuple(batches), realtime_step_buckets=tuple(steps),
        dtype="float32"))
    if engine.kind != "realtime" or n_delay_from_ms(engine.default_delay_ms) != hf.n_delay:
        raise SystemExit(f"{directory}: needs a Voxtral Realtime model whose tekken.json delay matches its config")
    times = {(side, batch): [] for side in ("engine", "hf") for batch in batches}
    tokens = {}
    try:
        for batch in batches:  # first calls pay one-off costs (allocations, lazy initialisation) on both sides
            await engine_run(engine, warm[:batch])
            hf.run(warm[:batch])
        for repeat in range(args.repeats):
            for batch in batches:
                for side in ("engine", "hf") if repeat % 2 == 0 else ("hf", "engine"):
                    if side == "engine":
                        wall, ids = await engine_run(engine, audio[:batch])
                    else:
                        wall, ids = hf.run(audio[:batch])
                    times[side, batch].append(wall)
                    tokens.setdefault((side, batch), ids)
                    print(f"  repeat {repeat + 1} batch {batch} {side}: {wall:.2f} s "
                          f"({batch * seconds / wall:.1f} x real time)", file=sys.stderr, flush=True)
    finally:
        await engine.shutdown()
    load = os.getloadavg()
    print(f"\n{directory}: {args.repeats} repeats of {seconds:g} s of audio per stream, float32 greedy, "
          f"delay {hf.n_delay * 80} ms; engine steps per dispatch {','.join(map(str, steps))}; "
          f"torch {hf.torch.__version__} ({hf.torch.get_num_threads()} threads); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("\n".join(table(batches, seconds, times)))
    line, _ = agreement(tokens["engine", batches[0]], tokens["hf", batches[0]])
    print(f"\nToken agreement (batch {batches[0]}): {line}")
    for batch in batches:
        _, same = agreement(tokens["engine", batch], tokens["hf", batch])
        print(f"  batch {batch}: {same}/{batch} streams with identical tokens")


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} must be positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="DIR", help="a Hugging Face-format Voxtral Realtime "
                        "directory with its tekken.json and preprocessor_config.json")
    source.add_argument("--build-tiny", type=Path, metavar="DIR", help="write a random tiny model (the "
                        "reference fixture's shapes, narrow windows) to DIR, then compare on it")
    source.add_argument("--build-mid", type=Path, metavar="DIR", help="write a random mid-size model (encoder "
                        "256 wide x 4 layers, decoder 512 wide x 6 layers, windows 750 and 8192) to DIR, then "
                        "compare on it")
    parser.add_argument("--batch", default="8,32", metavar="B[,B...]", help="concurrent streams (default: 8,32)")
    parser.add_argument("--seconds", type=float, default=4.0, metavar="S",
                        help="seconds of audio per stream, rounded to 80 ms (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="measured runs per side and batch, alternating the sides (default: 3)")
    parser.add_argument("--steps-per-dispatch", default=",".join(map(str, EngineConfig.realtime_step_buckets)),
                        metavar="K[,K...]", help="the engine's realtime_step_buckets: 80 ms steps one dispatch "
                        "may run when audio is queued; 1 alone mirrors transformers' step per chunk (default: "
                        "the engine's)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch's intra-op threads (default: torch's, one per core); on a loaded machine 1 "
                        "avoids OpenMP's collapse under oversubscription")
    parser.add_argument("--seed", type=int, default=0, help="seed of the audio and of built weights (default: 0)")
    args = parser.parse_args(argv)
    if argv is None:  # a process of its own: on the allocator the jaxstream commands use
        allocator.reexecute_with_tcmalloc()
    if args.seconds <= 0 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--seconds must be positive, --repeats and --threads at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    for shape, directory in (("tiny", args.build_tiny), ("mid", args.build_mid)):
        if directory is not None:
            build_model_dir(shape, directory, args.seed)
    directory = args.model or args.build_tiny or args.build_mid
    if not (directory / "config.json").is_file():
        raise SystemExit(f"{directory}: no config.json (a Hugging Face-format model directory is needed)")
    asyncio.run(compare(args, directory))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
