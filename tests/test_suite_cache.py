"""The suite's own XLA compilation cache (tests/conftest.py): one folder per run, removed by the run at exit, and
the folders of killed runs removed by the next run."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_run_removes_its_cache_folder_and_those_of_dead_runs(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    stale = tmp_path / f"jaxstream-tests-xla-{dead_pid}-abc123"  # a run killed before its atexit
    alive = tmp_path / f"jaxstream-tests-xla-{os.getpid()}-def456"  # a run going on now
    other = tmp_path / "jaxstream-tests-xla-notarun"
    for folder in (stale, alive, other):
        folder.mkdir()
        (folder / "program").write_bytes(b"x")
    env = {key: value for key, value in os.environ.items()
           if key not in ("JAX_COMPILATION_CACHE_DIR", "JAXSTREAM_TESTS_XLA_CACHE")}
    env["TMPDIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", "import os, conftest; print(os.environ['JAX_COMPILATION_CACHE_DIR'])"],
        cwd=TESTS, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    own = Path(result.stdout.strip())
    assert own.parent == tmp_path and own.name.startswith("jaxstream-tests-xla-")
    assert not own.exists()  # removed at the run's exit
    assert not stale.exists() and alive.exists() and other.exists()
