"""`jaxstream` command line: a thin dispatcher over one module per subcommand in `jaxstream.commands`.

Each command module exposes `register(subparsers)` (adds its parser, sets `func`) and keeps heavy imports
(jax, the model) inside the function it runs, so `jaxstream --help` stays fast.
"""
import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys

from threadpoolctl import threadpool_limits

from jaxstream import __version__, allocator
from jaxstream.errors import UserError

DESCRIPTION = """\
Realtime streaming speech-to-text on JAX (TPU, GPU or CPU): audio streams in, text streams back every 80 ms.
Transcribe audio files, measure WER and latency on speech corpora, serve realtime WebSocket and HTTP APIs, convert
checkpoints, benchmark the engine, and generate speech to train models. Models: the embedded `tiny` (the
default), a checkpoint directory, or a Hugging Face id such as mistralai/Voxtral-Mini-4B-Realtime-2602."""
EPILOG = """\
example: jaxstream transcribe models/assets/samples/sample.wav
Run `jaxstream COMMAND --help` for a command's options."""

COMMANDS = ("serve", "transcribe", "eval", "convert", "bench", "train", "synth")
# The commands that run compiled programs again and again, and so run faster on TCMalloc (jaxstream/allocator.py).
PROGRAM_COMMANDS = ("serve", "transcribe", "eval", "bench", "train")
OWN_LOG_FORMAT = ("serve",)  # a server's log lines carry times and logger names


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


XLA_CACHE_VARIABLE = "JAXSTREAM_XLA_CACHE"  # "on" (default) or "off"


def xla_cache_enabled(environ=os.environ) -> bool:
    """Whether $JAXSTREAM_XLA_CACHE leaves the compilation cache on. Raises ValueError for a value that is
    neither on nor off: a typo (`=of`, `=maybe`) silently kept the cache on."""
    value = environ.get(XLA_CACHE_VARIABLE, "").strip().lower()
    if value not in ("", "on", "off"):
        raise ValueError(f"{XLA_CACHE_VARIABLE} must be 'on' or 'off', got {environ[XLA_CACHE_VARIABLE]!r}")
    return value != "off"


def use_compilation_cache() -> str | None:
    """Keeps compiled XLA programs on disk between runs, so a command's second start skips compiling:
    `jaxstream transcribe` of the sample took 11.1 s, then 3.9 s (tiny model, 2-core CPU). The folder is
    JAX's `JAX_COMPILATION_CACHE_DIR` when set, else `$XDG_CACHE_HOME/jaxstream/xla` (~/.cache/...);
    `JAXSTREAM_XLA_CACHE=off` turns the cache off. Returns the folder in use, or None."""
    import jax

    if not xla_cache_enabled():
        return None
    if not jax.config.jax_compilation_cache_dir:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "jaxstream", "xla"))
    # JAX keeps only programs that took a second or more to compile; the engine's CPU programs often take
    # less, and a start-up compiles a dozen of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return jax.config.jax_compilation_cache_dir


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`parser.parse_args`, except that arguments no option takes are reported against the subcommand's usage
    (`jaxstream serve: error: ...`), not the top-level one, which shows no option of the command."""
    args, extras = parser.parse_known_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    if extras and words.index(extras[0]) < words.index(args.command):  # `jaxstream --bogus serve`: the top level's
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if extras:
        (action,) = [a for a in parser._actions if a.dest == "command"]  # noqa: SLF001 - no public lookup
        subparser = action.choices[args.command]
        subparser.error(f"unrecognized arguments: {' '.join(extras)}{_model_hint(subparser, args, extras)}")
    return args


def _model_hint(subparser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> str:
    """For `jaxstream serve --model X`: serve takes MODEL positionally, where the other commands have --model."""
    given = [extra for extra in extras if extra.split("=", 1)[0] == "--model"]
    positional = any(a.dest == "model" and not a.option_strings for a in subparser._actions)  # noqa: SLF001
    if not given or not positional:
        return ""
    model = given[0].partition("=")[2] or getattr(args, "model", None) or "MODEL"
    return f" ({subparser.prog} takes MODEL as a positional argument, without --model: {subparser.prog} {model})"


class _CommandFormatter(logging.Formatter):
    """`jaxstream transcribe: warning: ...`, as the command's own errors read."""

    def __init__(self, command: str):
        super().__init__()
        self._prefix = f"jaxstream {command}"

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return f"{self._prefix}: {record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def _command_style_warnings(command: str, verbosity: int):
    """Without -v, jaxstream's warnings (the engine's narrowband or untrained-delay input, say) read like the
    command's errors, instead of the root logger's `WARNING:jaxstream.engine.async_engine:...` that importing
    jax sets up. `serve` keeps its own timestamped log format, and -v the one with logger names."""
    if verbosity or command in OWN_LOG_FORMAT:
        yield
        return
    logger = logging.getLogger("jaxstream")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter(command))
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # the root logger's handler would repeat each line
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def main(argv=None) -> int:
    args = None
    try:
        with _interrupts_held():  # the commands' parsers import numpy and mistral-common
            parser = build_parser()
        args = parse_args(parser, argv)
        if argv is None and args.command in PROGRAM_COMMANDS:  # the process's own command line, not a caller's
            try:
                xla_cache_enabled()  # checked before the re-execution, which would only repeat the mistake
                allocator.reexecute_with_tcmalloc()
            except ValueError as exc:
                _stderr_line(f"jaxstream {args.command}: error: {exc}")
                return 2
            with _interrupts_held():
                importlib.import_module("jax")  # jaxlib's native start-up
            use_compilation_cache()
        verbosity = getattr(args, "verbose", 0)
        _configure_logging(verbosity)
        logger = logging.getLogger("jaxstream")
        if logger.isEnabledFor(logging.INFO):  # reading the process's mappings is for -v only
            logger.info("memory allocator: %s", allocator.loaded_allocator())
        # numpy's BLAS only multiplies small matrices here (the mel filterbank, on the host). Its worker
        # threads wait for cores that XLA's threads hold: beside a training step the filterbank product took
        # 9.6 ms on two threads against 0.6 ms on one, and feature extraction was a quarter of a core.
        with threadpool_limits(limits=1, user_api="blas"), _command_style_warnings(args.command, verbosity):
            return args.func(args) or 0
    except UserError as exc:
        _stderr_line(f"jaxstream {args.command}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _stderr_line(f"jaxstream{f' {args.command}' if args else ''}: interrupted")
        return 130


def _stderr_line(text: str) -> None:
    """One write, newline included: `print` writes the text and its newline apart, and a library thread's
    traceback (Orbax's abandoned reads after a failed restore) once landed between the two, on the error's line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _interrupts_held():
    """Holds SIGINT back while native libraries initialise. A Ctrl-C that landed inside jaxlib's (or numpy's,
    or pydantic-core's) start-up raised KeyboardInterrupt in the middle of it: the process died with SIGSEGV or
    SIGABRT, or with "ImportError: Encountered an error while initializing the extension", or the exception fell
    into the garbage-collection callback jaxlib installs, where Python drops it, and the command went on as if
    never interrupted (0.15-0.2 s after start on the 2-core CPU). Held back, it is delivered after the import,
    and the command stops as at any other moment ("interrupted", 130)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


if __name__ == "__main__":
    sys.exit(main())
