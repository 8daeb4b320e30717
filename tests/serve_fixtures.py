"""Fixtures every `tests/test_serve_*.py` module shares: one engine per process, a server over it, the
model id it serves, the bundled sample, and the check that each test leaves the engine at its baseline.
A module imports the ones it uses (pytest finds fixtures among a module's names) and may override any."""
import pytest

from jaxstream.serving.testing import ServerThread, sample_audio, shared_engine, wait_engine_baseline


@pytest.fixture(scope="module")
def engine():
    return shared_engine()


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine)
    yield server
    server.close()


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_id


@pytest.fixture(scope="module")
def audio():
    return sample_audio()


@pytest.fixture(autouse=True)
async def engine_returns_to_baseline(engine):
    yield
    await wait_engine_baseline(engine)
    assert engine.healthy
