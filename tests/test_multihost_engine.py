"""One engine over two processes: jax.distributed on loopback, 2 processes x 2 CPU devices, one 4-device
tensor-parallel mesh across the process boundary (jaxstream/engine/multihost.py). Process 0 leads, process 1
follows its dispatches.

- Through the engine API: a text LM gives transformers' greedy tokens for a plain prompt and the
  single-process engine's tokens for streamed sessions; the tiny Voxtral gives transformers' tokens for two
  concurrent sessions with different delays.
- Voxtral through `jaxstream serve` on process 0 gives the engine API's transcript (whose tokens equal
  transformers'); a follower lost mid-stream ends the leader's session with a clear error and turns
  its health to 503.

Each launch is two real processes; this file is also the program of the engine-API launch (`python
tests/test_multihost_engine.py COORDINATOR INDEX OUT`).
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from test_engine_text_model import ENGINE_CFG, random_chunks, stream_session, tiny_lm

FIXTURES = Path(__file__).parent / "fixtures"
VOXTRAL = FIXTURES / "voxtral_tiny"
# Two CPU devices per process; the 4-device mesh spans both processes.
# A lost follower is noticed after 5 s of silence (10 by default), which the serve tests wait out.
JOB_ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAXSTREAM_FOLLOWER_TIMEOUT_S": "5"}
STREAMED = 3  # streamed text sessions, run concurrently


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job_flags(coordinator: str, index: int) -> list[str]:
    return ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(index)]


def _stop(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(30)


# -- a text LM through the engine API -------------------------------------------------------------------

async def _text_requests(engine, prompt: list[int], max_tokens: int) -> dict:
    from test_engine_text_model import greedy

    plain = [t async for out in engine.generate(prompt, greedy(max_tokens), request_id="plain")
             for t in out.outputs[0].token_ids]
    vocab = engine.model_config.vocab_size
    streamed = await asyncio.gather(*(stream_session(engine, random_chunks(10 + i, vocab), f"t{i}")
                                      for i in range(STREAMED)))
    return {"plain": plain, "streamed": [[tokens for tokens, _ in session] for session in streamed]}


VOXTRAL_CFG = dict(max_sessions=2, page_size=4, encoder_page_size=4, batch_buckets=(2,), realtime_step_buckets=(4,),
                   realtime_prefill_buckets=((2, 40),))
DELAYS_MS = (480, 160)  # two concurrent transcription sessions with different delays


def _engine_api_job(coordinator: str, index: int, out: str) -> None:
    """One process of the engine-API launch: the text LM's engine, then the tiny Voxtral's, each over the
    4-device mesh. Process 0 runs the requests through `AsyncEngine` and writes what they gave to `out`;
    process 1 follows each engine until process 0 shuts it down."""
    import jax
    from jax.sharding import Mesh

    from jaxstream import distributed
    from jaxstream.engine import builders, multihost
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig

    args = Namespace(coordinator=coordinator, num_processes=2, process_id=index, distributed=None)
    group = distributed.initialize(args, environ={}, recoverable=True)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    text_config = EngineConfig(**{**ENGINE_CFG.__dict__, "mesh": mesh})
    voxtral_config = EngineConfig(**VOXTRAL_CFG, mesh=mesh)
    if not group.leader:
        multihost.follow(builders.build_core(tiny_lm(), text_config).programs)
        multihost.follow_pretrained(VOXTRAL, voxtral_config, dtype="float32")
        distributed.leave()
        return
    reference = np.load(FIXTURES / "mistral_tiny_reference.npz")
    prompt = reference["prompt_ids"][0].tolist()
    audio = np.load(FIXTURES / "voxtral_tiny_reference.npz")["audio"]

    async def run():
        engine = AsyncEngine(tiny_lm(), config=text_config)
        try:
            spec = engine.core.programs.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...].sharding
            crosses = {device.process_index for device in spec.device_set} == {0, 1}
            text = {**await _text_requests(engine, prompt, reference["generate"].shape[1] - len(prompt)),
                    "q_proj_spec": str(spec.spec), "spans_both_processes": crosses}
        finally:
            await engine.shutdown()
        engine = AsyncEngine.from_pretrained(VOXTRAL, config=voxtral_config, dtype="float32")
        try:
            done = await asyncio.gather(*(engine.transcribe(audio, delay_ms=delay) for delay in DELAYS_MS))
        finally:
            await engine.shutdown()
        return {"text": text, "voxtral": {str(delay): d.token_ids for delay, d in zip(DELAYS_MS, done)},
                "transcripts": {str(delay): d.text for delay, d in zip(DELAYS_MS, done)}}

    Path(out).write_text(json.dumps(asyncio.run(run())))
    distributed.leave()


@pytest.fixture(scope="module")
def engine_api_launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_api") / "leader.json"
    coordinator = f"127.0.0.1:{_free_port()}"
    processes = [subprocess.Popen([sys.executable, __file__, coordinator, str(index), str(out)],
                                  env=JOB_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index in range(2)]
    try:
        logs = [process.communicate(timeout=600)[0] for process in processes]
    finally:
        _stop(processes)
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-4000:]  # the follower too: released by each engine's shutdown
    return json.loads(out.read_text())


async def test_text_lm_over_two_processes_equals_transformers_and_one_process(engine_api_launch):
    from jaxstream.engine.async_engine import AsyncEngine

    text_launch = engine_api_launch["text"]
    assert text_launch["spans_both_processes"] and "tp" in text_launch["q_proj_spec"]
    reference = np.load(FIXTURES / "mistral_tiny_reference.npz")
    prompt = reference["prompt_ids"][0].tolist()
    assert text_launch["plain"] == reference["generate"][0, len(prompt):].tolist()
    engine = AsyncEngine(tiny_lm(), config=ENGINE_CFG)
    try:
        single = await _text_requests(engine, prompt, len(text_launch["plain"]))
    finally:
        await engine.shutdown()
    assert text_launch["streamed"] == single["streamed"]


def _assert_voxtral_equals_transformers(launch) -> None:
    from jaxstream.models.audio import n_delay_from_ms, prompt_length

    reference = dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))
    for delay in DELAYS_MS:
        n_delay = n_delay_from_ms(delay)
        expected = reference[f"generate_d{n_delay}"][0, prompt_length(n_delay):].tolist()
        assert launch["voxtral"][str(delay)] == expected


def test_voxtral_over_two_processes_equals_transformers(engine_api_launch):
    _assert_voxtral_equals_transformers(engine_api_launch)


# -- Voxtral through `jaxstream serve` on process 0 ------------------------------------------------------

SERVER_TOML = """
[engine]
max_sessions = 2
page_size = 4
encoder_page_size = 4
batch_buckets = [2]
realtime_step_buckets = [4]
realtime_prefill_buckets = [[2, 40]]
"""


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`jaxstream serve` of the tiny Voxtral on two processes; yields (base URL, [leader, follower], the
    time it became ready)."""
    config = tmp_path_factory.mktemp("serve") / "server.toml"
    config.write_text(SERVER_TOML)
    port, coordinator = _free_port(), f"127.0.0.1:{_free_port()}"
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxstream", "serve", str(VOXTRAL), "--host", "127.0.0.1", "--port", str(port),
         "--config", str(config), *_job_flags(coordinator, index)],
        env=JOB_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in range(2)]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while _status(base) != 200:
            for process in processes:
                assert process.poll() is None, process.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the two-process server never became ready"
            time.sleep(0.5)
        yield base, processes, time.monotonic()
    finally:
        _stop(processes)


def _status(base: str) -> int | None:
    try:
        return _get(base + "/health")
    except OSError:
        return None  # not listening yet


@pytest.fixture(scope="module")
def transcript(engine_api_launch):
    """The bundled audio and the engine API's transcript of it at 480 ms (its tokens equal transformers')."""
    _assert_voxtral_equals_transformers(engine_api_launch)
    return np.load(FIXTURES / "voxtral_tiny_reference.npz")["audio"], engine_api_launch["transcripts"]["480"]


def _ticks(base: str) -> float:
    """Engine ticks so far, from the server's /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        [line] = [line for line in response.read().decode().splitlines()
                  if line.startswith("jaxstream_tick_seconds_count")]
    return float(line.split()[-1])


async def _connect(base: str):
    from jaxstream.serving.testing import RealtimeClient

    client = await RealtimeClient.connect(base.replace("http", "ws") + "/v1/realtime")
    await client.update(str(VOXTRAL), transcription_delay_ms=480)
    return client


async def test_voxtral_through_serve_on_process_0(served, transcript):
    from jaxstream.serving.testing import stream_utterance

    base, _, ready_at = served
    audio, text = transcript
    for _ in range(2):
        client = await _connect(base)
        try:
            result = await stream_utterance(client, audio)
        finally:
            await client.close()
        assert result["done"]["text"] == text
        # An idle leader keeps its followers: their heartbeats, not dispatches, say they are alive.
        lost_after = float(JOB_ENV["JAXSTREAM_FOLLOWER_TIMEOUT_S"])
        await asyncio.sleep(max(0.0, ready_at + lost_after + 2 - time.monotonic()))
        assert _get(base + "/health") == 200


async def test_a_lost_follower_ends_the_leaders_session_with_an_error(served, transcript):
    """The follower is stopped mid-stream (a hung host: its sockets stay open, so no collective fails and
    only its missing heartbeat can tell), then killed."""
    base, (leader, follower), _ = served
    audio, _ = transcript
    client = await _connect(base)
    try:
        ticks = _ticks(base)
        await client.commit()
        await client.append(audio[: len(audio) // 2])
        while _ticks(base) <= ticks + 2:  # the engine is mid-stream, on both processes
            await asyncio.sleep(0.05)
        follower.send_signal(signal.SIGSTOP)
        await client.append(audio[len(audio) // 2:])
        await client.commit(final=True)
        events = []
        while not events or events[-1]["type"] not in ("error", "transcription.done"):
            events.append(await client.event(timeout=60))
    finally:
        follower.kill()
        await client.close()
    error = events[-1]
    assert error["type"] == "error", events
    assert "multi-host engine lost a process: process 1 sent no heartbeat" in error["error"], error
    assert _get(base + "/health") == 503
    assert leader.poll() is None  # the leader stays up, answering health checks with 503


if __name__ == "__main__":
    _, coordinator, index, out = sys.argv
    _engine_api_job(coordinator, int(index), out)
