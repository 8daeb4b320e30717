"""The memory allocator the program-running commands re-execute themselves with (jaxstream/allocator.py)."""
import os
import subprocess
import sys

import pytest

from jaxstream import allocator

LIBRARY = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_the_default_preloads_tcmalloc_once_and_keeps_the_users_preloads():
    environ = {"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"}
    plan = allocator.preload_environment(environ, LIBRARY, loaded="system")
    assert plan["LD_PRELOAD"] == f"{LIBRARY} /opt/mine.so"
    assert plan["PATH"] == "/bin" and plan[allocator.REEXECUTED_VARIABLE] == "1"
    assert int(plan["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert environ == {"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"}  # the caller's mapping is left alone
    # The re-executed process does not go round again, even when the loader ignored the preload.
    assert allocator.preload_environment(plan, LIBRARY, loaded="system") is None
    # A user's own report threshold wins over ours.
    mine = allocator.preload_environment({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, LIBRARY, loaded="system")
    assert mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5" and mine["LD_PRELOAD"] == LIBRARY


@pytest.mark.parametrize("environ, library, loaded", [
    ({allocator.CHOICE_VARIABLE: "system"}, LIBRARY, "system"),   # the user's choice
    ({allocator.CHOICE_VARIABLE: " System "}, LIBRARY, "system"),
    ({}, LIBRARY, "tcmalloc"),                                    # already loaded (e.g. by the user's LD_PRELOAD)
    ({}, None, "system"),                                         # not installed: glibc's malloc, as before
])
def test_no_reexecution_when_it_is_not_wanted_or_not_possible(environ, library, loaded):
    assert allocator.preload_environment(environ, library, loaded) is None


def test_an_unknown_choice_is_a_clear_error():
    with pytest.raises(ValueError, match="JAXSTREAM_ALLOCATOR must be 'tcmalloc' or 'system', got 'jemalloc'"):
        allocator.preload_environment({allocator.CHOICE_VARIABLE: "jemalloc"}, LIBRARY, "system")


def test_the_library_is_found_where_the_distribution_puts_it(tmp_path):
    assert allocator.find_tcmalloc([tmp_path]) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc([tmp_path / "missing", tmp_path]) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build is preferred
    assert allocator.find_tcmalloc([tmp_path]) == str(tmp_path / "libtcmalloc_minimal.so.4")


def test_the_loaded_allocator_is_read_from_the_process_mappings(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded_allocator(str(maps)) == "system"
    maps.write_text(maps.read_text() + f"7f02-7f03 r-xp 00000000 00:00 0 {LIBRARY}\n")
    assert allocator.loaded_allocator(str(maps)) == "tcmalloc"
    assert allocator.loaded_allocator(str(tmp_path / "no-proc")) == "system"


def _command_allocator(choice: str) -> tuple[str, str]:
    """(the allocator a real `jaxstream -v eval` process logs, what it printed), run until its input error."""
    code = ("import os, sys; from jaxstream import cli; print('pid', os.getpid(), flush=True); "
            "sys.argv = ['jaxstream', '-v', 'eval', '/nonexistent/corpus']; sys.exit(cli.main())")
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("JAXSTREAM_ALLOC", "LD_PRE"))}
    result = subprocess.run([sys.executable, "-c", code], env={**environ, allocator.CHOICE_VARIABLE: choice},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr  # the missing corpus, after the allocator's decision
    [line] = [line for line in result.stderr.splitlines() if "memory allocator:" in line]
    return line.rsplit(" ", 1)[-1], result.stdout


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="TCMalloc is not installed (.ci/run installs it)")
def test_a_program_command_runs_on_tcmalloc_in_the_same_process():
    name, stdout = _command_allocator("tcmalloc")
    assert name == "tcmalloc"
    # os.execve keeps the pid (a supervisor's or a test's handle on `jaxstream serve` stays valid): the code
    # before the re-execution printed the same pid as the code after it would.
    assert stdout.count("pid") == 2 and len(set(stdout.split())) == 2
    name, stdout = _command_allocator("system")
    assert name == "system" and stdout.count("pid") == 1


def test_commands_called_in_process_never_reexecute(monkeypatch):
    """`cli.main(argv)` from Python (tests, notebooks) must not replace the caller's process."""
    monkeypatch.setattr(allocator.os, "execve", lambda *args: pytest.fail("re-executed an in-process call"))
    from jaxstream import cli

    assert cli.main(["eval", "/nonexistent/corpus"]) == 2
