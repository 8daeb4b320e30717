"""Test configuration: CPU only, float32 matmuls, 4 fake CPU devices for sharding tests."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "float32")


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
