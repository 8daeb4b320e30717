"""benchmarks/vs_transformers.py without torch (CI has none): its help and argument errors need neither torch
nor transformers, and its report (table, token agreement) is right on given timings and tokens."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_transformers.py"
spec = importlib.util.spec_from_file_location("vs_transformers", SCRIPT)
vs_transformers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_transformers)

# Runs the script with torch and transformers unimportable (as on CI, whatever this machine has installed).
_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
                  "sys.argv = [sys.argv[1], *sys.argv[2:]]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_help_needs_no_torch():
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(SCRIPT), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--model", "--build-tiny", "--build-mid", "--batch", "--seconds", "--repeats"):
        assert flag in result.stdout


def test_building_without_torch_says_what_to_install(tmp_path):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(SCRIPT), "--build-tiny", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "pip install -e '.[bench]'" in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--batch", "8,0"], "--batch must be positive integers"),
    (["--batch", "x"], "--batch must be positive integers"),
    (["--steps-per-dispatch", ""], "--steps-per-dispatch must be positive integers"),
])
def test_bad_lists_are_one_line_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        vs_transformers._positive_ints(argv[1], argv[0])


def test_arguments_need_exactly_one_model_source(capsys, tmp_path):
    for argv in ([], ["--model", str(tmp_path), "--build-mid", str(tmp_path)], ["--model", str(tmp_path),
                                                                                 "--seconds", "0"]):
        with pytest.raises(SystemExit) as exc:
            vs_transformers.parse_args(argv)
        assert exc.value.code == 2
    assert vs_transformers.parse_args(["--build-mid", str(tmp_path)]).batch == "8,32"


def test_table_reports_medians_and_their_ratio():
    times = {("engine", 8): [2.0, 1.0, 4.0], ("hf", 8): [8.0, 6.0, 7.0], ("engine", 32): [4.0], ("hf", 32): [16.0]}
    rows = vs_transformers.table([8, 32], 2.0, times)[2:]
    # batch 8: 16 s of audio over the median walls 2.0 (engine) and 7.0 (transformers) -> 8.0 and 2.3 x.
    assert rows == ["| 8 | 8.0 | 2.3 | 3.50 |", "| 32 | 16.0 | 4.0 | 4.00 |"]


def test_agreement_finds_the_first_difference():
    line, same = vs_transformers.agreement([[5, 6, 7], [1]], [[5, 6, 7], [1]])
    assert line == "stream 0: the same 3 greedy tokens from both" and same == 2
    line, same = vs_transformers.agreement([[5, 9, 7, 8], [1]], [[5, 6, 7], [2]])
    assert "differ from index 1" in line and "(2/4 equal; engine 4 tokens, transformers 3)" in line and same == 0
