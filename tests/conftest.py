"""Test configuration: CPU only, float32 matmuls, 4 fake CPU devices for sharding tests, and one XLA
compilation cache for the whole run."""
import atexit
import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


def _held(folder: Path) -> bool:
    """Whether a live run holds `folder`'s lock. A folder with no lock (made by a run before runs took locks)
    counts as held unless its pid is gone."""
    try:
        with open(folder / ".lock") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except FileNotFoundError:
        try:
            os.kill(int(folder.name.split("-")[3]), 0)
        except ProcessLookupError:
            return False
        except OSError:  # alive, another user's
            pass
        return True
    except OSError:  # another user's folder: not ours to judge
        return True


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Most test modules build their own tiny engine, and every new engine compiles the same programs again
    # (JAX's in-memory cache is per jitted function object). On disk, a program compiled once is loaded by
    # every later engine, in this process, in the other xdist worker (workers start after this module is
    # imported in the controller and inherit the variable) and in the CLI subprocesses tests start. A fresh
    # folder per run keeps runs independent; the process that made it removes it at exit, and a run that was
    # killed first leaves it to the next run. A run holds a lock on its folder while it lives: a pid alone cannot
    # tell (a run in another PID namespace sharing /tmp, a CI container's, has a pid that looks dead here).
    for folder in Path(tempfile.gettempdir()).glob("jaxstream-tests-xla-*"):
        if re.fullmatch(r"jaxstream-tests-xla-(\d+)-\w+", folder.name) and not _held(folder):
            shutil.rmtree(folder, ignore_errors=True)
    # Made under a name the sweep passes over and locked before it takes its own, so that no other run finds it
    # unlocked; the lock is held until the process ends.
    _new = tempfile.mkdtemp(prefix="jaxstream-tests-xla-new-")
    _RUN_LOCK = open(os.path.join(_new, ".lock"), "w")
    fcntl.flock(_RUN_LOCK, fcntl.LOCK_EX)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _new.replace("-xla-new-", f"-xla-{os.getpid()}-")
    os.rename(_new, os.environ["JAX_COMPILATION_CACHE_DIR"])
    os.environ["JAXSTREAM_TESTS_XLA_CACHE"] = "run"  # this run's own folder (the workers see it too)
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "float32")
if os.environ.get("JAXSTREAM_TESTS_XLA_CACHE") == "run":
    # JAX keeps only programs that took a second to compile; the tiny engines' take less, and there are many. (A
    # cache folder of the developer's own keeps JAX's rule: it outlives the run.)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture
async def engine_returns_to_baseline(engine):
    """For engine test modules (`pytestmark = pytest.mark.usefixtures(...)`): after each test, the module's
    `engine` fixture is idle and back at its baseline. Sessions a failed test left behind are aborted
    either way, so the next test starts clean instead of failing for this one."""
    yield
    await engine.wait_until_idle()
    leftover = list(engine.core.sessions)  # request ids only; aborting goes through the engine thread
    try:
        assert engine.core.at_baseline(), "a session leaked pages, a slot or host memory"
    finally:
        for request_id in leftover:
            await engine.abort(request_id)
        await engine.wait_until_idle()


@pytest.fixture
def soundfile_reads(monkeypatch) -> list:
    """The frame counts of every `soundfile.SoundFile.read` the test makes: how much of a file was decoded."""
    import soundfile

    requested, read = [], soundfile.SoundFile.read

    def recording_read(self, frames=-1, *args, **kwargs):
        requested.append(frames)
        return read(self, frames, *args, **kwargs)

    monkeypatch.setattr(soundfile.SoundFile, "read", recording_read)
    return requested
