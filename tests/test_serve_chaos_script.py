"""benchmarks/serve_chaos.py and its client behaviours (benchmarks/serve_chaos_clients.py) against an in-process
server, so that the soak cannot rot unnoticed: every behaviour, run once, ends as it expects (a protocol change that
breaks one, or an expectation that drifted from the protocol, fails here rather than in a soak run now and then); an
answer other than the expected one, or none, is reported with its reason; and a one-round soak counts its runs, the
server's RSS and the tracebacks of a log, and exits 1 for a traceback."""
import importlib
import os
import sys
from pathlib import Path

import pytest

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine, engine_returns_to_baseline, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def chaos():
    """(serve_chaos, serve_chaos_clients), imported as the script imports them: from its directory."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("serve_chaos"), importlib.import_module("serve_chaos_clients")
    finally:
        sys.path.remove(str(BENCHMARKS))


async def test_every_behaviour_ends_as_it_expects(server, chaos):
    soak, clients = chaos
    routes = {"realtime", "sagemaker", "openai", "kyutai", "envelope", "http", "midway"}
    assert {name.split("_")[0] for name in clients.BEHAVIOURS} == routes
    results = await soak.run_each(server.url("", "http"), list(clients.BEHAVIOURS), seed=1)
    assert {name: reason for name, reason in results.items() if reason is not None} == {}


async def test_an_answer_other_than_the_expected_one_is_not_ok(server, engine, chaos, monkeypatch):
    """A wrong expectation is reported with what came instead, and a server that never sends the awaited event (vLLM's
    compat mode acknowledges no session.update) with the wait that ran out: neither passes as ok."""
    soak, clients = chaos
    monkeypatch.setattr(clients, "BEHAVIOURS", dict(clients.BEHAVIOURS))
    clients.refused_input("wrong_expectation", ("{not json",), "unknown_event")
    (reason,) = (await soak.run_each(server.url("", "http"), ["wrong_expectation"])).values()
    assert reason.startswith("expected error unknown_event, got") and "invalid_json" in reason
    monkeypatch.setattr(clients, "WAIT_S", 1.0)
    vllm_server = ServerThread(engine, ServerConfig(compat="vllm"))
    try:
        (reason,) = (await soak.run_each(vllm_server.url("", "http"), ["realtime_utterances"])).values()
    finally:
        vllm_server.close()
    assert reason == "no event within 1 s"


def test_a_soak_round_reports_its_runs_rss_and_log(server, chaos, tmp_path, capsys):
    soak, _ = chaos
    log = tmp_path / "server.log"
    log.write_text("2026-01-01 00:00:00,000 ERROR jaxstream.serving.websocket: ws-1: protocol handler failed\n"
                   "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    status = soak.main(["--url", server.url("", "http"), "--rounds", "1", "--round-s", "1", "--workers", "2",
                        "--pid", str(os.getpid()), "--log", str(log)])
    out = capsys.readouterr().out
    assert status == 1, out  # the log's traceback
    round_line = next(line for line in out.splitlines() if line.startswith("round 1:"))
    assert " 0 not ok, server RSS " in round_line and "log: 1 tracebacks, 1 ERROR lines" in round_line, out
    assert "still held" not in round_line
    runs = int(round_line.split()[2])
    assert runs >= 2 and f"{'all':32} {runs:6} {runs:6} {0:6}" in out
    assert "log: 2026-01-01 00:00:00,000 ERROR" in out
