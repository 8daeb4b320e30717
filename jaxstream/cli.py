"""`jaxstream` command line: a thin dispatcher over one module per subcommand in `jaxstream.commands`.

Each command module exposes `register(subparsers)` (adds its parser, sets `func`) and keeps heavy imports
(jax, the model) inside the function it runs, so `jaxstream --help` stays fast.
"""
import argparse
import importlib
import logging
import os
import sys

from threadpoolctl import threadpool_limits

from jaxstream import __version__, allocator
from jaxstream.errors import UserError

DESCRIPTION = """\
Realtime streaming speech-to-text on JAX (TPU, GPU or CPU): audio streams in, text streams back every 80 ms.
Transcribe audio files, measure WER and latency on speech corpora, serve a realtime WebSocket API, convert
checkpoints, benchmark the engine, and generate speech to train models. Models: the embedded `tiny` (the
default), a checkpoint directory, or a Hugging Face id such as mistralai/Voxtral-Mini-4B-Realtime-2602."""
EPILOG = """\
example: jaxstream transcribe models/assets/samples/sample.wav
Run `jaxstream COMMAND --help` for a command's options."""

COMMANDS = ("serve", "transcribe", "eval", "convert", "bench", "train", "synth")
# The commands that run compiled programs again and again, and so run faster on TCMalloc (jaxstream/allocator.py).
PROGRAM_COMMANDS = ("serve", "transcribe", "eval", "bench", "train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxstream", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxstream {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"jaxstream.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"jaxstream.commands.{name}":
                continue  # that command is not part of this build
            raise
        module.register(subparsers)
    for subparser in subparsers.choices.values():
        # `jaxstream transcribe -v ...` as well as `jaxstream -v transcribe ...`; SUPPRESS keeps the top-level
        # count when the subcommand is not given -v.
        if "-v" not in subparser._option_string_actions:  # noqa: SLF001 - argparse has no public lookup
            subparser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    return parser


_VERBOSE_HELP = "log what the engine does to stderr: -v start-up, evictions, rejected input; -vv everything"


def _configure_logging(verbosity: int) -> None:
    """Quiet by default (only warnings and errors reach stderr). -v / -vv turn on jaxstream's own INFO / DEBUG
    records, not those of the libraries underneath (orbax, absl), which would drown them."""
    if not verbosity:
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxstream").setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)


def use_compilation_cache() -> str | None:
    """Keeps compiled XLA programs on disk between runs, so a command's second start skips compiling:
    `jaxstream transcribe` of the sample took 11.1 s, then 3.9 s (tiny model, 2-core CPU). The folder is
    JAX's `JAX_COMPILATION_CACHE_DIR` when set, else `$XDG_CACHE_HOME/jaxstream/xla` (~/.cache/...);
    `JAXSTREAM_XLA_CACHE=off` turns the cache off. Returns the folder in use, or None."""
    import jax

    if os.environ.get("JAXSTREAM_XLA_CACHE", "").lower() == "off":
        return None
    if not jax.config.jax_compilation_cache_dir:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "jaxstream", "xla"))
    # JAX keeps only programs that took a second or more to compile; the engine's CPU programs often take
    # less, and a start-up compiles a dozen of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return jax.config.jax_compilation_cache_dir


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in PROGRAM_COMMANDS:  # the process's own command line, not a caller's
        try:
            allocator.reexecute_with_tcmalloc()
        except ValueError as exc:
            print(f"jaxstream {args.command}: error: {exc}", file=sys.stderr)
            return 2
        use_compilation_cache()
    _configure_logging(getattr(args, "verbose", 0))
    logger = logging.getLogger("jaxstream")
    if logger.isEnabledFor(logging.INFO):  # reading the process's mappings is for -v only
        logger.info("memory allocator: %s", allocator.loaded_allocator())
    try:
        # numpy's BLAS only multiplies small matrices here (the mel filterbank, on the host). Its worker
        # threads wait for cores that XLA's threads hold: beside a training step the filterbank product took
        # 9.6 ms on two threads against 0.6 ms on one, and feature extraction was a quarter of a core.
        with threadpool_limits(limits=1, user_api="blas"):
            return args.func(args) or 0
    except UserError as exc:
        print(f"jaxstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxstream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
