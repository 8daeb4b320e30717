"""`jaxstream bench` end to end on the tiny Voxtral fixture (a smoke run; no timing assertions), and the
report's logic on synthetic timings: latency percentiles, "no samples", and what counts as keeping up."""
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from jaxstream import allocator
from jaxstream.cli import main
from jaxstream.engine.benchmark import BenchResult, SteadyStart, keeps_up, percentiles
from jaxstream.engine.residency import LatencyHistogram

FIXTURE = Path(__file__).parent / "fixtures" / "voxtral_tiny"


def test_bench_runs_streams_and_reports(capsys):
    code = main(["bench", "--model", str(FIXTURE), "--streams", "2", "--seconds", "1.2", "--fast", "--json",
                 "--steps-per-dispatch", "4", "--page-size", "4", "--encoder-page-size", "4"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["streams"] == 2 and not result["paced"] and result["ticks"] >= 1
    assert result["tick_ms_p50"] <= result["tick_ms_p90"] <= result["tick_ms_p99"]
    assert result["host_ms_p50"] <= result["host_ms_p99"] and result["host_cpu_ms_p50"] <= result["host_cpu_ms_p99"]
    # Per 80 ms of audio: a tick runs at least one step (four here, in the dispatch), so at most the tick's.
    assert 0 < result["host_ms_per_step"] <= result["host_ms_mean"]
    # The engine thread's CPU split: inside the device's calls, and its own work.
    assert result["device_call_cpu_ms_p50"] > 0 and result["own_cpu_ms_p50"] > 0
    # 1.2 s of audio at 480 ms delay: 15 real slots + 32 left + 17 right padding slots - 39 prompt = 25 tokens.
    assert abs(result["output_tokens_per_s"] * result["wall_seconds"] - 2 * 25) < 1e-6
    # Every generated id (control ids included) is a latency sample, over the whole run.
    assert result["latency_samples"] == 2 * 25
    assert 0 < result["latency_ms_p50"] <= result["latency_ms_p99"]
    # The steady state's own latency (what "keeps up" judges): here everything after the prompts.
    assert result["steady"] and 0 < result["steady_latency_ms_p50"] <= result["steady_latency_ms_p99"]
    assert result["floor_ms"] > 0


def test_a_run_that_never_catches_up_reports_its_whole_run(capsys):
    """0.4 s streams end before their 39-slot prompt can be computed (it needs 0.48 s of audio), so the
    streams never all catch up: the ticks reported are the whole run's, said to be so, and the run does
    not keep up (it used to print no tick figures at all)."""
    code = main(["bench", "--model", str(FIXTURE), "--streams", "2", "--seconds", "0.4", "--json",
                 "--steps-per-dispatch", "1", "--page-size", "4", "--encoder-page-size", "4"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not result["steady"] and result["ticks"] >= 1 and result["tick_ms_p50"] is not None
    assert not result["keeps_up"]
    assert "never steady" in "\n".join(BenchResult(**result).lines())


def test_bench_user_errors(capsys):
    assert main(["bench", "--config", "tiny", "--streams", "2"]) == 2
    assert main(["bench", "--streams", "0,x"]) == 2
    assert main(["bench", "--batch-wait-ms", "-5"]) == 2  # values the engine rejects: one line, not a traceback
    assert main(["bench", "--page-size", "0"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["bench", "--planned-stream-seconds", "0"]) == 2
    assert "planned_stream_seconds must be a finite number > 0" in capsys.readouterr().err


def test_latency_histogram_percentiles_match_numpy_within_a_bin():
    samples = np.random.default_rng(0).lognormal(np.log(0.05), 1.0, 5000)
    histogram = LatencyHistogram()
    for chunk in np.array_split(samples, 7):  # recorded tick by tick
        histogram.record(chunk)
    assert histogram.counts.sum() == samples.size
    for q in (50, 90, 99):
        exact = np.percentile(samples, q, method="inverted_cdf")
        assert exact <= LatencyHistogram.percentile(histogram.counts, q) <= exact * 1.0101


def test_no_latency_samples_is_reported_as_such_and_never_keeps_up():
    assert LatencyHistogram.percentile(LatencyHistogram().counts, 99) is None
    assert percentiles([], (50, 99)) == [None, None]
    assert not keeps_up(paced=True, tick_ms_p99=10.0, latency_ms_p99=None, wall_seconds=1, audio_seconds=10)
    assert not keeps_up(paced=True, tick_ms_p99=None, latency_ms_p99=100.0, wall_seconds=1, audio_seconds=10)
    assert not keeps_up(paced=False, tick_ms_p99=10.0, latency_ms_p99=None, wall_seconds=1, audio_seconds=10)
    result = BenchResult(streams=4, paced=True, audio_seconds=1.0, wall_seconds=1.5, ticks=0, rows_p50=None,
                         tick_ms_p50=None, tick_ms_p90=None, tick_ms_p99=None, step_ms_p50=None, host_ms_mean=None,
                         host_ms_p50=None, host_ms_p99=None, host_cpu_ms_p50=None, host_cpu_ms_p99=None,
                         device_call_cpu_ms_p50=None, own_cpu_ms_p50=None, latency_samples=0, latency_ms_p50=None,
                         latency_ms_p99=None, output_tokens_per_s=0.0, realtime_factor=2.7, keeps_up=False,
                         floor_ms=1.0, step_over_floor=None)
    text = "\n".join(result.lines())
    assert "latency" in text and "p50/p99: no samples / no samples" in text
    assert " 0 ms" not in text and "falls behind" in text
    # Which malloc the numbers came from (10-25 % apart on CPU): this process's, read from its mappings.
    assert result.allocator == allocator.loaded_allocator() and f"memory allocator {result.allocator}" in text


@pytest.mark.parametrize("tick_p99, latency_p99, expected", [
    (79.0, 390.0, True),
    (81.0, 100.0, False),  # a tick over the 80 ms slot
    (50.0, 401.0, False),  # tokens later than five slots after their audio: a backlog is building
])
def test_paced_keeps_up_needs_both_the_tick_and_the_latency_criterion(tick_p99, latency_p99, expected):
    assert keeps_up(paced=True, tick_ms_p99=tick_p99, latency_ms_p99=latency_p99, wall_seconds=99.0,
                    audio_seconds=10.0) is expected


def test_as_fast_as_possible_keeps_up_when_every_stream_ends_within_its_duration():
    assert keeps_up(paced=False, tick_ms_p99=500.0, latency_ms_p99=4000.0, wall_seconds=8.0, audio_seconds=10.0)
    assert not keeps_up(paced=False, tick_ms_p99=500.0, latency_ms_p99=4000.0, wall_seconds=12.0, audio_seconds=10.0)


def test_a_paced_steady_state_starts_after_the_tick_in_flight_when_the_streams_catch_up():
    """Looks at two paced streams' audio counters (slots consumed, slots queued) as `jaxstream bench` takes
    them, with the ticks recorded so far: the steady state waits for every prompt, for at most one queued
    slot per stream, and then for the tick that was in flight at that look (it carries catch-up work)."""
    start = SteadyStart(paced=True, prompt_slots=39)
    assert not start.observe([39, 31], [0, 0], 3)  # one stream still in its prompt
    assert not start.observe([45, 41], [2, 1], 4)  # two slots queued: 160 ms behind, still catching up
    assert not start.observe([47, 43], [1, 0], 5)  # caught up, while the 6th tick is in flight
    assert not start.observe([47, 44], [1, 1], 5) and start.tick is None
    assert start.observe([48, 44], [0, 1], 6) and start.tick == 6
    assert not start.observe([49, 45], [6, 6], 7) and start.tick == 6  # it starts once


def test_an_unpaced_steady_state_starts_once_every_prompt_is_computed():
    start = SteadyStart(paced=False, prompt_slots=39)
    assert not start.observe([39, 16], [200, 223], 1)
    assert start.observe([39, 39], [200, 180], 2) and start.tick == 2  # all the audio queued at once


def _long_windows_config(tmp_path) -> Path:
    """configs/tiny.toml with windows much longer than the streams (encoder 256 frames, decoder 512 slots) and one
    layer a side (what these tests count is pages, and a layer compiles in a fraction of the time of six)."""
    toml = (Path(__file__).parents[1] / "configs" / "tiny.toml").read_text()
    encoder, text = toml.split("[model.text]")  # the encoder's window is above [model.text], the decoder's below
    recipe = tomllib.loads(toml)["model"]
    assert recipe["encoder"]["sliding_window"] < 256 and recipe["text"]["sliding_window"] < 512
    encoder = re.sub(r"^sliding_window = \d+", "sliding_window = 256", encoder, count=1, flags=re.M)
    text = re.sub(r"^sliding_window = \d+", "sliding_window = 512", text, count=1, flags=re.M)
    encoder, text = (re.sub(r"^num_layers = \d+", "num_layers = 1", side, count=1, flags=re.M)
                     for side in (encoder, text))
    toml = encoder + "[model.text]" + text
    model = tomllib.loads(toml)["model"]
    assert model["encoder"]["sliding_window"] == 256 and model["text"]["sliding_window"] == 512
    assert model["encoder"]["num_layers"] == model["text"]["num_layers"] == 1
    config = tmp_path / "long_windows.toml"
    config.write_text(toml)
    return config


def test_bench_of_a_config_holds_every_stream_at_once(tmp_path, capsys):
    """`--config` with windows much longer than the streams: window admission commits each stream's full
    windows, so pools sized for short streams (as bench once made them) held one stream at a time and rotated
    the others through host memory, 8x slower than real time for the 4B model on an H200."""
    code = main(["bench", "--config", str(_long_windows_config(tmp_path)), "--random-weights", "--streams", "3",
                 "--seconds", "0.8", "--steps-per-dispatch", "1", "--admission", "window", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["streams"] == 3 and result["paced"]
    assert result["evictions"] == 0


def test_bench_streams_that_do_not_all_fit_never_take_turns_through_host_memory(tmp_path, capsys):
    """`--num-pages` one decoder window (8 pages of 64) and `--encoder-num-pages` 13: under window admission
    the pools commit fewer than the three paced streams, and the last one waits for a stream to end (a
    stream whose next chunk is due never gives way to a newer one: before that rule they took turns through
    host memory every 80 ms); under demand admission all three run in the pages they use. Neither evicts."""
    for admission in ("window", "demand"):
        code = main(["bench", "--config", str(_long_windows_config(tmp_path)), "--random-weights", "--streams", "3",
                     "--seconds", "0.8", "--steps-per-dispatch", "1", "--num-pages", "9", "--encoder-num-pages",
                     "13", "--admission", admission, "--json"])
        assert code == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["streams"] == 3 and result["evictions"] == 0, (admission, result)
