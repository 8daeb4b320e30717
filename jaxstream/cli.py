"""`jaxstream` command line: a thin dispatcher over one module per subcommand in `jaxstream.commands`.

Each command module exposes `register(subparsers)` (adds its parser, sets `func`) and keeps heavy imports
(jax, the model) inside the function it runs, so `jaxstream --help` stays fast.
"""
import argparse
import importlib
import sys

from threadpoolctl import threadpool_limits

from jaxstream.errors import UserError

COMMANDS = ("serve", "transcribe", "eval", "convert", "bench", "train", "synth")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxstream", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"jaxstream.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"jaxstream.commands.{name}":
                continue  # that command is not part of this build
            raise
        module.register(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
