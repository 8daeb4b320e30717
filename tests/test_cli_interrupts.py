"""Ctrl-C at any moment of a command's start-up stops it with one line: SIGINT is held back while native libraries
initialise (cli._interrupts_held) and, for `serve`, until its event loop takes the signal. Before, a SIGINT in
jaxlib's start-up killed the process with SIGSEGV/SIGABRT, and one that fell into jaxlib's garbage-collection
callback was dropped by Python: the server went on to serve (found by sending SIGINT 0.1-2 s after start)."""
import signal
import subprocess
import sys
import textwrap

import pytest


def run_script(body: str) -> subprocess.CompletedProcess:
    """Runs `body` with SIGINT at its default, as a terminal's Ctrl-C finds it: a suite started as a background job
    of a non-interactive shell has SIGINT ignored, every child inherits that, and no interrupt would arrive."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_sigint_during_the_parsers_imports_stops_the_command_after_them():
    done = run_script("""
        import os, signal, sys
        from jaxstream import cli

        build_parser = cli.build_parser
        def interrupted_build_parser():
            os.kill(os.getpid(), signal.SIGINT)  # as though Ctrl-C landed in numpy's or mistral-common's start-up
            print("the imports went on", flush=True)
            return build_parser()
        cli.build_parser = interrupted_build_parser
        sys.exit(cli.main(["transcribe", "a.wav"]))
    """)
    assert done.returncode == 130, done.stderr
    assert done.stdout == "the imports went on\n" and done.stderr == "jaxstream: interrupted\n", done


@pytest.mark.parametrize("where", ["gc", "plain"])
def test_serve_holds_a_sigint_until_its_event_loop_takes_it(where):
    """A SIGINT before the loop's handlers exist is kept, not raised where Python would drop it (a garbage
    collection callback, as jaxlib's is) and not lost: it comes out once serve's start-up gives it back."""
    done = run_script(f"""
        import gc, os, signal, sys
        from jaxstream.commands import serve

        def starting(args):
            if {where!r} == "gc":  # it lands while a collection runs Python code, as jaxlib's callback is
                def callback(phase, info):
                    gc.callbacks.remove(callback)
                    os.kill(os.getpid(), signal.SIGINT)
                gc.callbacks.append(callback)
                gc.collect()
            else:
                os.kill(os.getpid(), signal.SIGINT)
            print("start-up went on", flush=True)
            return 0
        serve._run = starting
        try:
            serve.run(None)
        except KeyboardInterrupt:
            print("interrupted after start-up", flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "start-up went on\ninterrupted after start-up\n", done
    assert "Exception ignored" not in done.stderr, done.stderr


def test_parsing_a_command_line_imports_no_jax():
    """The command modules' parsers imported jaxstream.evaluation, and through it the engine and jax (0.4 s):
    before the CLI re-executes itself with TCMalloc, which must come before jax, and for `jaxstream --help`."""
    done = run_script("""
        import sys
        from jaxstream import cli

        cli.parse_args(cli.build_parser(), ["eval", "corpus"])
        print(sorted(name for name in ("jax", "jaxlib", "flax") if name in sys.modules))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n", done.stdout
