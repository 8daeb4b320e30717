"""`jaxstream transcribe`: transcribe audio files through the engine's realtime sessions.

    jaxstream transcribe [--model MODEL] AUDIO... [--delay-ms MS] [--json] [--concurrency N] [--quantization int8]
                         [--kv-cache-dtype fp8]

Prints the transcript of each file (`FILE: text` when there are several), or with `--json` one JSON object
per line: {"file", "text", "token_ids", "words": [{"word", "start", "end"}], "audio_seconds", "delay_ms"};
token_ids are the raw generated ids (specials included), in order. Files are transcribed concurrently and
printed in the order given.

A file that cannot be read (missing, not audio, no samples) is skipped: its one-line error goes to stderr when it
is met, and the other files are transcribed. Exit status: 0 when every file was transcribed, 1 when some were
and some were not, 2 when none was (one bad file given alone included)."""
import json
import logging
import os
import sys

from jaxstream.errors import UserError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    from jaxstream.models.audio import ALLOWED_DELAYS_TEXT

    parser = subparsers.add_parser("transcribe", help="transcribe audio files",
                                   description=__doc__.split("\n\n")[0],
                                   epilog=__doc__.split("\n\n")[-1])  # how a bad file is told, the exit status
    parser.add_argument("audio", nargs="+", metavar="AUDIO", help="audio files (wav, flac, ogg, mp3, ...)")
    parser.add_argument("--model", default=None, help="model name, directory or Hugging Face id (default: the "
                        "embedded tiny model)")
    parser.add_argument("--delay-ms", type=int, default=None, metavar="MS",
                        help=f"transcription delay in ms, {ALLOWED_DELAYS_TEXT} (default: the model's, 480 for "
                        "tiny)")
    parser.add_argument("--json", action="store_true", help="one JSON object per file")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N",
                        help="files transcribed at once (default 8)")
    add_precision_arguments(parser)
    parser.set_defaults(func=run)


# models/quantization.py's QUANTIZATION_METHODS and engine/config.py's KV_CACHE_DTYPES, written out: the parsers are
# built without importing jax (tests/test_quantization.py and tests/test_kv_cache_dtype.py check that they agree).
QUANTIZATION_CHOICES = ("int8",)
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def add_precision_arguments(parser) -> None:
    """`--quantization` and `--kv-cache-dtype` (vLLM's flags), as EngineConfig takes them."""
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="int8: weights stored as int8 with one scale per output channel, quantized as they load "
                        "(half the weight memory of bfloat16, left to more streams' KV; slower on a CPU; default: "
                        "the weights as stored)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default=None,
                        help="dtype of the KV cache: fp8 (= fp8_e4m3) or fp8_e5m2 store keys and values in 8 bits "
                        "(twice the streams of bfloat16 in the same memory; attention still computed in the "
                        "model's dtype); default auto: the compute dtype")


def run(args) -> int:
    import asyncio

    if args.concurrency < 1:
        raise UserError(f"--concurrency must be at least 1, got {args.concurrency}")
    checked_delay_ms(args.delay_ms)
    readable = []
    for path in args.audio:  # before loading the model, so a typo is told in a second
        try:
            _check_audio_file(path)
        except UserError as exc:
            if len(args.audio) == 1:  # a bad file alone is the command's mistake: its one line, exit 2
                raise
            _skip(exc)
        else:
            readable.append(path)
    failed = len(args.audio) - len(readable)
    if readable:
        speech_model_config(model_source(args.model), "transcribe")
        from jaxstream.models.audio_checks import engine_narrowband_warnings_muted

        with engine_narrowband_warnings_muted():  # each file's band is judged here, where its name is known
            failed += asyncio.run(_transcribe_all(args, readable))
    if not failed:
        return 0
    print(f"jaxstream transcribe: error: {failed} of {len(args.audio)} files not transcribed", file=sys.stderr)
    return 2 if failed == len(args.audio) else 1


def _skip(exc: Exception) -> None:
    """The one-line error of a file left out of a batch (the message names the file)."""
    print(f"jaxstream transcribe: error: {exc} (skipped)", file=sys.stderr, flush=True)


async def _transcribe_all(args, paths: list[str]) -> int:
    """Transcribes `paths`, printing each result in order; returns how many could not be decoded."""
    import asyncio

    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig
    from jaxstream.evaluation.runner import stream_audio
    from jaxstream.models.audio_checks import file_narrowband_reason, narrowband_warning

    concurrency = min(args.concurrency, len(paths))  # fewer sessions compile fewer batch shapes
    engine = AsyncEngine.from_pretrained(model_source(args.model), config=EngineConfig(
        max_sessions=concurrency, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype or "auto"))
    failed = 0
    async with engine:
        slots = asyncio.Semaphore(concurrency)

        async def transcribe(path: str):
            async with slots:
                pcm = await asyncio.to_thread(_load, path)
                band = await asyncio.to_thread(file_narrowband_reason, path, pcm)
                return pcm.size, band, (await stream_audio(engine, pcm, delay_ms=args.delay_ms)).done

        tasks = [asyncio.create_task(transcribe(path)) for path in paths]
        try:
            for path, task in zip(paths, tasks):
                try:
                    num_samples, band, done = await task
                except UserError as exc:  # what only decoding the file finds (a NaN sample, say)
                    if len(args.audio) == 1:
                        raise
                    _skip(exc)
                    failed += 1
                    continue
                if band is not None:
                    logger.warning("%s: %s", path, narrowband_warning(band))
                _print_result(path, num_samples, done, args.json, several=len(args.audio) > 1)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return failed


def checked_delay_ms(delay_ms: int | None) -> int | None:
    """`--delay-ms` as given, after the front end's check of what the model supports (None: the default)."""
    if delay_ms is None:
        return None
    from jaxstream.models.audio import ALLOWED_DELAYS_TEXT, n_delay_from_ms

    try:
        n_delay_from_ms(delay_ms)
    except ValueError:
        raise UserError(f"--delay-ms {delay_ms}: the delay must be {ALLOWED_DELAYS_TEXT}") from None
    return delay_ms


def model_source(model: str | None) -> str:
    """`--model`, or the built-in default model when none is given."""
    if model is not None:
        return model
    try:
        from jaxstream.models.loading import DEFAULT_MODEL
    except ImportError:
        raise UserError("this installation has no built-in default model; pass --model DIR_OR_HUB_ID") from None
    return DEFAULT_MODEL


def speech_model_config(model: str, command: str):
    """The checkpoint's VoxtralConfig, read without its weights; UserError for a text model, before anything
    loads or compiles."""
    from jaxstream.models import checkpoint_metadata, loading
    from jaxstream.models.config import VoxtralConfig

    config = checkpoint_metadata.inspect_checkpoint(loading.resolve_model_dir(model)).config
    if not isinstance(config, VoxtralConfig):
        raise UserError(f"model {model!r} is a text model; jaxstream {command} needs a speech-to-text (Voxtral "
                        "Realtime) model")
    return config


def _print_result(path: str, num_samples: int, done, as_json: bool, several: bool) -> None:
    from jaxstream.models.audio import SAMPLING_RATE

    if as_json:
        print(json.dumps({
            "file": path, "text": done.text, "token_ids": list(done.token_ids),
            "words": [{"word": w.word, "start": w.start, "end": w.end} for w in done.words],
            "audio_seconds": num_samples / SAMPLING_RATE, "delay_ms": done.delay_ms,
        }, ensure_ascii=False), flush=True)
    else:
        print(f"{path}: {done.text}" if several else done.text, flush=True)


def _check_audio_file(path: str) -> None:
    import soundfile

    if os.path.isdir(path):
        raise UserError(f"{path} is a directory, not an audio file: give its files (a shell glob such as "
                        f"{os.path.join(path, '*.wav')}), or evaluate a corpus folder with `jaxstream eval`")
    if not os.path.isfile(path):
        raise UserError(f"audio file not found: {path}")
    if os.path.getsize(path) == 0:
        raise UserError(f"audio file {path} is empty (0 bytes)")
    from jaxstream.models.audio import decode_failure

    try:
        info = soundfile.info(path)
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        raise UserError(f"unsupported or unreadable audio {path}: {decode_failure(exc)}") from None
    if info.frames == 0:  # a header alone: the transcript would be an empty line, as if nothing were said
        raise UserError(f"audio file {path} holds no samples")


def _load(path: str):
    from jaxstream.models.audio import AudioError, load_audio

    try:
        return load_audio(path)
    except AudioError as exc:
        raise UserError(str(exc)) from None
