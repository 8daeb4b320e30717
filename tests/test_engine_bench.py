"""`jaxstream bench` end to end on the tiny Voxtral fixture (a smoke run; no timing assertions)."""
import json
from pathlib import Path

from jaxstream.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "voxtral_tiny"


def test_bench_runs_streams_and_reports(capsys):
    code = main(["bench", "--model", str(FIXTURE), "--streams", "2", "--seconds", "1.2", "--fast", "--json",
                 "--steps-per-dispatch", "4", "--page-size", "4", "--encoder-page-size", "4"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["streams"] == 2 and not result["paced"] and result["ticks"] >= 1
    assert result["tick_ms_p50"] <= result["tick_ms_p90"] <= result["tick_ms_p99"]
    # 1.2 s of audio at 480 ms delay: 15 real slots + 32 left + 17 right padding slots - 39 prompt = 25 tokens.
    assert abs(result["output_tokens_per_s"] * result["wall_seconds"] - 2 * 25) < 1e-6
    assert result["floor_ms"] > 0


def test_bench_user_errors(capsys):
    assert main(["bench", "--config", "tiny", "--streams", "2"]) == 2
    assert main(["bench", "--streams", "0,x"]) == 2
    assert "error" in capsys.readouterr().err
