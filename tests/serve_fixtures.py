"""Fixtures every `tests/test_serve_*.py` module shares: one engine per process, a server over it, the
model id it serves, the bundled sample, and the check that each test leaves the engine at its baseline.
A module imports the ones it uses (pytest finds fixtures among a module's names) and may override any."""
import openai
import pytest
from hypothesis import strategies as st

from jaxstream.errors import UserError
from jaxstream.serving.testing import RealtimeClient, ServerThread, sample_audio, shared_engine, wait_engine_baseline


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
def client(server):
    """The openai SDK over the module's `server`."""
    return openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def audio():
    return sample_audio()


@pytest.fixture(autouse=True)
async def engine_returns_to_baseline(engine):
    yield
    await wait_engine_baseline(engine)
    assert engine.healthy


def captured_server_configs(monkeypatch) -> list:
    """The ServerConfig of every `jaxstream serve` run from now on in the test, each of which then stops with a
    UserError instead of serving (its app is never built)."""
    from jaxstream.serving import app

    configs = []

    def create_app(config, **kwargs):
        configs.append(config)
        raise UserError("this test serves nothing")

    monkeypatch.setattr(app, "create_app", create_app)
    return configs


def fuzz_text(max_size: int):
    """Text for fuzzed JSON values: any characters, lone UTF-16 surrogates included (valid JSON as "\\ud800";
    a server that echoes one back must still be able to send its frame)."""
    return st.text(st.characters() | st.characters(categories=["Cs"]), max_size=max_size)


# What every dialect answers to an exception in its own code: a fuzzed frame must never get it.
INTERNAL_ERRORS = ("Internal error while handling the event", "Internal error while handling the message")


# -- realtime clients -----------------------------------------------------------------------------------------
async def connected(server, model=None, **update):
    client = await RealtimeClient.connect(server.url())
    if model is not None:
        await client.update(model, **update)
        if not server.state.config.vllm_compat:
            assert (await client.event())["type"] == "session.updated"
    return client


async def expect_error(client, code, contains=""):
    event = await client.event()
    assert event["type"] == "error" and event["code"] == code, event
    assert contains in event["error"]
    return event
