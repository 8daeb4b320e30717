"""benchmarks/serve_chaos.py and its client behaviours (benchmarks/serve_chaos_*.py) against in-process servers, so
that the soak cannot rot unnoticed: every behaviour, run once, ends as it expects (a protocol change that breaks one,
or an expectation that drifted from the protocol, fails here rather than in a soak run now and then), those that wait
for a limit or need a key against a keyed server with short limits; an answer other than the expected one, or none,
is reported with its reason; and a one-round soak counts its runs, the server's RSS and the tracebacks of a log,
names the behaviours it could not run, and exits 1 for a traceback."""
import asyncio
import importlib
import os
import sys
from pathlib import Path

import pytest

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from serve_fixtures import engine, engine_returns_to_baseline, server  # noqa: F401 - pytest fixtures
from test_serve_http_completions import text_engine

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
KEY = "chaos-key"
OTHER_KEYS = ("flood-key", "lone-key")  # the text flood's: one floods the request queue, one must be served
# Short enough that a behaviour waiting for each takes seconds; the idle timeout long enough that the slow reader's
# wait for its first delta, under a loaded CI machine, is not taken for silence.
LIMITS = Limits(idle_timeout_s=4.0, max_session_seconds=8.0, send_timeout_s=2.0)
WAITS = {"limits_idle": "idle_timeout_s", "limits_max_duration": "max_session_seconds",
         "limits_slow_reader": "send_timeout_s"}
LANES = 4  # the default server's behaviours run in this many sequences side by side, as a soak's workers do


@pytest.fixture(scope="module")
def chaos():
    """(serve_chaos, serve_chaos_clients), imported as the script imports them: from its directory."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("serve_chaos"), importlib.import_module("serve_chaos_clients")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def limited_server(engine):
    server = ServerThread(engine, ServerConfig(api_keys=(KEY,), limits=LIMITS))
    yield server
    server.close()


async def test_every_behaviour_ends_as_it_expects(server, limited_server, chaos):
    """The behaviours that wait for a limit or need a key against the keyed server with short limits (beside a few
    others, which then present the key on every route), every other one against the default server. There the
    former do not run, and say what they need."""
    soak, clients = chaos
    speech = clients.of_kind("speech")
    routes = {"realtime", "sagemaker", "openai", "kyutai", "envelope", "http", "midway", "limits", "auth"}
    assert {name.split("_")[0] for name in speech} == routes
    assert {"realtime_vad", "openai_vad", "http_session_resume", "http_sse_slow_reader",
            "http_routing_refusals"} < set(speech)
    assert set(clients.NEEDS) == {*WAITS, "auth_keys", "text_key_flood"}  # (the last a text server's)
    plain = sorted(set(speech) - set(clients.NEEDS))
    limited = [["limits_max_duration"], ["limits_idle", "auth_keys"],
               ["limits_slow_reader", "realtime_utterances", "http_session", "kyutai_stream", "envelope_utterance"]]
    runs = await asyncio.gather(
        *(soak.run_each(server.url("", "http"), plain[lane::LANES], seed=1) for lane in range(LANES)),
        *(soak.run_each(limited_server.url("", "http"), names, seed=1, key=KEY, limits=LIMITS) for names in limited))
    results = {name: reason for ran, _ in runs for name, reason in ran.items()}
    assert set(results) == set(speech)
    assert {name: reason for name, reason in results.items() if reason is not None} == {}
    _, skipped = await soak.run_each(server.url("", "http"), sorted(clients.NEEDS), limits=Limits(send_timeout_s=90))
    assert skipped == {"auth_keys": "a keyed server (--api-key)",
                       **{name: f"{limit} <= 60 s (the server's is {getattr(Limits(send_timeout_s=90), limit):g} s)"
                          for name, limit in WAITS.items()}}


async def test_every_text_behaviour_ends_as_it_expects(chaos, tmp_path):
    """Against a text LM's server (serve_chaos_text's model, keyed with three keys and a small request queue) the soak
    runs the text behaviours, and only those: greedy answers equal across routes, logprobs, stop strings, seeded
    sampling, /tokenize, Mode A and B text, refusals, dropped streams, structured outputs and forced tool calls,
    allowed ids and bad words, and one key's flood of the queue beside another key's request. Two lanes side by side,
    so that streams share the engine's batches."""
    soak, clients = chaos
    text = clients.of_kind("text")
    assert {"text_completion", "text_chat", "text_mode_a", "text_mode_b", "text_refusals", "text_drops",
            "text_structured", "text_tool_choice", "text_constraint_refusals", "text_allowed_tokens", "text_bad_words",
            "text_guided_drops", "text_key_flood"} < set(text)
    engine = text_engine(importlib.import_module("serve_chaos_text").make_model(tmp_path / "llama"))
    limits = Limits(max_connections=4)
    server = ServerThread(engine, ServerConfig(api_keys=(KEY, *OTHER_KEYS), limits=limits))
    try:
        runs = await asyncio.gather(*(soak.run_each(server.url("", "http"), sorted(clients.BEHAVIOURS), seed=lane,
                                                    key=KEY, limits=limits, other_keys=OTHER_KEYS)
                                      for lane in range(2)))
        await wait_engine_baseline(engine)
    finally:
        server.close()
        engine.close()
    assert [set(ran) for ran, _ in runs] == [set(text)] * 2 and [skipped for _, skipped in runs] == [{}, {}]
    assert {name: reason for ran, _ in runs for name, reason in ran.items() if reason is not None} == {}


async def test_an_answer_other_than_the_expected_one_is_not_ok(server, engine, chaos, monkeypatch):
    """A wrong expectation is reported with what came instead, and a server that never sends the awaited event (vLLM's
    compat mode acknowledges no session.update) with the wait that ran out: neither passes as ok."""
    soak, clients = chaos
    monkeypatch.setattr(clients, "BEHAVIOURS", dict(clients.BEHAVIOURS))
    clients.refused_input("wrong_expectation", ("{not json",), "unknown_event")
    (reason,) = (await soak.run_each(server.url("", "http"), ["wrong_expectation"]))[0].values()
    assert reason.startswith("expected error unknown_event, got") and "invalid_json" in reason
    # Told a key that the server does not check: the key behaviour's refusals do not come.
    (reason,) = (await soak.run_each(server.url("", "http"), ["auth_keys"], key=KEY))[0].values()
    assert reason.startswith("GET /v1/models with no key: HTTP 200"), reason
    monkeypatch.setattr(clients, "WAIT_S", 1.0)
    vllm_server = ServerThread(engine, ServerConfig(compat="vllm"))
    try:
        (reason,) = (await soak.run_each(vllm_server.url("", "http"), ["realtime_utterances"]))[0].values()
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
    # Told neither the server's limits nor its key, the soak leaves out what needs them, and says so.
    assert "not run: auth_keys (needs a keyed server (--api-key))" in out
    assert "not run: limits_idle (needs the server's limits (--server-config))" in out


def test_a_key_file_gives_the_soak_its_keys(limited_server, chaos, tmp_path, capsys):
    """--api-key-file: its first key presents every request, as --api-key's (the key behaviour then checks the keyed
    server's refusals without it)."""
    soak, _ = chaos
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n{OTHER_KEYS[0]}\n\n{OTHER_KEYS[1]}\n")
    status = soak.main(["--url", limited_server.url("", "http"), "--api-key-file", str(keys), "--once", "auth_keys"])
    assert (status, capsys.readouterr().out.split()) == (0, ["auth_keys", "ok"])
