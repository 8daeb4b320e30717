"""The suite's own XLA compilation cache (tests/conftest.py): one folder per run, removed by the run at exit, and
the folders of killed runs removed by the next run."""
import fcntl
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_run_removes_its_cache_folder_and_those_of_dead_runs(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    stale = tmp_path / f"jaxstream-tests-xla-{os.getpid()}-abc123"  # a run killed before its atexit: unlocked
    # A run going on now, in another PID namespace (a container sharing /tmp): its pid is gone here, its lock held.
    alive = tmp_path / f"jaxstream-tests-xla-{dead_pid}-def456"
    unlocked_dead = tmp_path / f"jaxstream-tests-xla-{dead_pid}-ghi789"  # killed before it took its lock
    unlocked_alive = tmp_path / f"jaxstream-tests-xla-{os.getpid()}-jkl012"  # about to take it
    other = tmp_path / "jaxstream-tests-xla-notarun"
    for folder in (stale, alive, unlocked_dead, unlocked_alive, other):
        folder.mkdir()
        (folder / "program").write_bytes(b"x")
    (stale / ".lock").touch()
    with open(alive / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
    assert not stale.exists() and not unlocked_dead.exists()
    assert alive.exists() and unlocked_alive.exists() and other.exists()


def test_a_run_holds_its_folders_lock_while_it_lives(tmp_path):
    """The lock is what a later run reads: taken by the run, under its folder's own name, released at its end."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("JAX_COMPILATION_CACHE_DIR", "JAXSTREAM_TESTS_XLA_CACHE")}
    env["TMPDIR"] = str(tmp_path)
    script = ("import os, sys, conftest; print(os.environ['JAX_COMPILATION_CACHE_DIR'], flush=True); "
              "sys.stdin.readline()")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=TESTS, env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        own = Path(run.stdout.readline().strip())
        assert sorted(path.name for path in own.iterdir()) == [".lock"]
        with open(own / ".lock") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
        assert held
    finally:
        run.communicate("\n", timeout=120)
    assert run.returncode == 0 and not own.exists()
