"""Reports: JSON round trip, merging shard reports, the per-utterance CSV and the Markdown/terminal tables."""
import copy
import csv
import io
import json
from pathlib import Path

import jiwer
import pytest

from jaxstream.errors import UserError
from jaxstream.evaluation import (
    Corpus, Evaluation, RunOptions, Utterance, UtteranceResult, format_table, load_report, merge_reports,
    parse_shard, write_reports,
)
from jaxstream.evaluation.metrics import make_normalizer, score

TEXTS = [("the quick brown fox", "the quick brown box"), ("jumps over", "jumps over the"), ("a lazy dog", "lazy dog"),
         ("hello world", "hello word"), ("one more line", "one more line"), ("it failed", None)]


def _evaluation(tmp_path, shard=None):
    corpus = Corpus(str(tmp_path), "manifest", tuple(
        Utterance(f"u{i}", f"u{i}.wav", reference, speaker=f"s{i % 2}") for i, (reference, _) in enumerate(TEXTS)))
    evaluation = Evaluation(corpus, model="tiny", delays=[480], options=RunOptions(concurrency=2),
                            normalizer_name="english", shard=None if shard is None else parse_shard(shard))
    normalizer = make_normalizer("english")
    hypotheses = dict(TEXTS)
    for utterance in evaluation.utterances:
        index = int(utterance.id[1:])
        result = UtteranceResult(utterance.id, utterance.audio, utterance.text, speaker=utterance.speaker,
                                 reference_normalized=normalizer(utterance.text), audio_seconds=2.0,
                                 first_token_ms=100.0 + index, word_latencies_ms=[480.0 + index])
        if hypotheses[utterance.text] is None:
            result.error = f"cannot decode audio {utterance.audio}"
        else:
            score(result, hypotheses[utterance.text], normalizer)
        evaluation.add(480, result)
    return evaluation


def test_json_round_trip_and_companion_files(tmp_path):
    report = _evaluation(tmp_path).report()
    path = tmp_path / "out" / "report.json"
    write_reports(report, path)
    assert load_report(path) == json.loads(json.dumps(report))
    run = report["runs"][0]
    assert report["complete"] and run["summary"]["errors"] == 1
    assert run["errors"] == [{"id": "u5", "audio": "u5.wav", "error": "cannot decode audio u5.wav"}]
    ok = [(r, h) for r, h in TEXTS if h is not None]
    assert run["summary"]["wer"] == pytest.approx(jiwer.wer([r for r, _ in ok], [h for _, h in ok]))

    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "report.csv").read_text())))
    assert [row["id"] for row in rows] == [f"u{i}" for i in range(len(TEXTS))]
    for row, (reference, hypothesis) in zip(rows, TEXTS):
        if hypothesis is None:
            assert row["error"] and row["wer"] == ""
        else:
            assert float(row["wer"]) == pytest.approx(jiwer.wer(reference, hypothesis), rel=1e-5)
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert f"{100 * run['summary']['wer']:.2f}" in markdown and "u5" in markdown
    assert f"{100 * run['summary']['wer']:.2f}" in format_table(report)


def test_merged_shard_reports_equal_the_full_report(tmp_path):
    full = _evaluation(tmp_path).report()
    shards = [_evaluation(tmp_path, f"{i}/3").report() for i in range(3)]
    merged = merge_reports(shards)
    for key in ("summary", "speakers", "errors", "utterances"):
        assert merged["runs"][0][key] == full["runs"][0][key]
    assert merged["corpus"]["selected"] == full["corpus"]["selected"]
    other = dict(shards[0], model="another", settings=dict(shards[0]["settings"], realtime=True))
    with pytest.raises(UserError) as mismatch:
        merge_reports([shards[1], other])
    # Said as the flags each part was run with (it was "a different model: 'tiny' vs 'another'").
    assert str(mismatch.value) == ("cannot merge reports of different evaluations: one was run with --model tiny and "
                                   "without --realtime, another with --model another and with --realtime")


def _timed(report, wall_seconds):
    """`report` as if each of its runs had taken `wall_seconds`."""
    report = copy.deepcopy(report)
    for run in report["runs"]:
        run["wall_seconds"] = wall_seconds
    return report


def test_a_merge_with_a_shard_missing_is_incomplete_and_says_so(tmp_path, capsys):
    half = merge_reports([_evaluation(tmp_path, "0/2").report()])
    assert not half["complete"] and not half["runs"][0]["complete"]
    assert half["corpus"]["selected"] == 3
    assert "incomplete: shard 1/2 not given" in capsys.readouterr().err
    whole = merge_reports([_evaluation(tmp_path, f"{i}/2").report() for i in (1, 0)])
    assert whole["complete"] and capsys.readouterr().err == ""


def test_a_shard_given_twice_counts_once(tmp_path, capsys):
    """Once `--merge s0 s0 s1` reported 9 selected of 6 and the RTFx of 1.5 corpora of work."""
    full = _evaluation(tmp_path).report()
    s0, s1 = (_timed(_evaluation(tmp_path, f"{i}/2").report(), wall) for i, wall in ((0, 1.0), (1, 3.0)))
    merged = merge_reports([s0, s0, s1])
    (run,) = merged["runs"]
    assert merged["complete"] and merged["corpus"]["selected"] == full["corpus"]["selected"] == len(TEXTS)
    assert run["summary"] == full["runs"][0]["summary"] and run["utterances"] == full["runs"][0]["utterances"]
    assert run["wall_seconds"] == 4.0
    assert run["rtfx"] == pytest.approx(run["summary"]["audio_seconds"] / 4.0)
    ok = [(r, h) for r, h in TEXTS if h is not None]
    assert run["summary"]["wer"] == pytest.approx(jiwer.wer([r for r, _ in ok], [h for _, h in ok]))
    assert capsys.readouterr().err == ""


def test_a_resumed_shard_replaces_its_earlier_part(tmp_path):
    """A later report's result replaces an earlier failed one; the resumed report's wall time already holds the
    earlier part's, so it is not added again."""
    earlier = _timed(_evaluation(tmp_path, "1/2").report(), 2.0)  # u5 failed in it
    resumed = copy.deepcopy(earlier)
    (u5,) = [u for u in resumed["runs"][0]["utterances"] if u["id"] == "u5"]
    u5.update(error=None, hypothesis="it failed", hypothesis_normalized="it failed", word_counts=[2, 0, 0, 0],
              char_counts=[9, 0, 0, 0])
    resumed["runs"][0]["wall_seconds"] = 2.5
    merged = merge_reports([_timed(_evaluation(tmp_path, "0/2").report(), 1.0), earlier, resumed])
    (run,) = merged["runs"]
    assert merged["complete"] and run["summary"]["errors"] == 0 and run["summary"]["transcribed"] == len(TEXTS)
    assert run["wall_seconds"] == 3.5


def test_a_delay_only_some_shards_ran_is_incomplete(tmp_path, capsys):
    s0 = _evaluation(tmp_path, "0/2").report()
    s1 = _evaluation(tmp_path, "1/2").report()
    other_delay = copy.deepcopy(s0["runs"][0])
    other_delay["delay_ms"] = 960
    s0["runs"].append(other_delay)
    merged = merge_reports([s0, s1])
    assert [(run["delay_ms"], run["complete"]) for run in merged["runs"]] == [(480, True), (960, False)]
    assert not merged["complete"]
    assert "delay 960 ms not run by shard 1/2" in capsys.readouterr().err
    interrupted = _evaluation(tmp_path, "1/2").report()
    del interrupted["runs"][0]["utterances"][0]
    assert not merge_reports([_evaluation(tmp_path, "0/2").report(), interrupted])["complete"]
    assert "delay 480 ms: 5 of 6 utterances run" in capsys.readouterr().err


def test_empty_shards_are_empty_parts_that_merge_normally(tmp_path, capsys):
    shards = [_evaluation(tmp_path, f"{i}/8").report() for i in range(8)]
    assert [len(shard["runs"][0]["utterances"]) for shard in shards[len(TEXTS):]] == [0, 0]
    assert all(shard["complete"] for shard in shards)
    merged, full = merge_reports(shards), _evaluation(tmp_path).report()
    assert merged["complete"] and merged["corpus"]["selected"] == len(TEXTS)
    assert merged["runs"][0]["summary"] == full["runs"][0]["summary"]
    assert not merge_reports(shards[:len(TEXTS)])["complete"]
    assert "shard 6/8, 7/8 not given" in capsys.readouterr().err


def test_only_parts_of_one_sharding_merge(tmp_path):
    s0 = _evaluation(tmp_path, "0/2").report()
    for other, message in [(_evaluation(tmp_path, "1/3").report(), r"shard count: --shard 0/2 vs --shard 1/3"),
                           (_evaluation(tmp_path).report(), "shard count: --shard 0/2 vs no --shard"),
                           (dict(s0, corpus=dict(s0["corpus"], shard="1/2", limit=4)), "different --limit"),
                           (dict(s0, corpus=dict(s0["corpus"], selected=2)), "shard 0/2 that select different")]:
        with pytest.raises(UserError, match=message):
            merge_reports([s0, other])


def test_load_report_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(UserError, match="not a jaxstream eval report"):
        load_report(path)
    with pytest.raises(UserError, match="report not found"):
        load_report(tmp_path / "missing.json")


def test_eval_cli_merges_shard_reports_and_reports_mistakes_in_one_line(tmp_path, capsys):
    from jaxstream import cli

    paths = []
    for index in range(2):
        paths.append(tmp_path / f"shard{index}.json")
        write_reports(_evaluation(tmp_path, f"{index}/2").report(), paths[-1])
    assert cli.main(["eval", "--merge", *map(str, paths), "--report", str(tmp_path / "all.json")]) == 0
    merged = load_report(tmp_path / "all.json")
    assert merged["runs"][0]["summary"] == _evaluation(tmp_path).report()["runs"][0]["summary"]
    assert f"{100 * merged['runs'][0]['summary']['wer']:.2f}" in capsys.readouterr().out

    (tmp_path / "empty").mkdir()
    for args, message in [([str(tmp_path / "empty")], "cannot tell the layout"),
                          ([str(tmp_path), "--resume"], "--resume needs --report"),
                          ([str(tmp_path), "--shard", "2/2"], "--shard must be"),
                          ([str(tmp_path), "--delay-ms", "500"], "multiple of 80"),
                          ([str(tmp_path), "--report", "r.md"], "--report names the JSON report")]:
        assert cli.main(["eval", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_report_path_that_cannot_be_written_fails_before_the_run(tmp_path, capsys):
    """`--report DIR` ran the whole evaluation, then ended in an IsADirectoryError traceback (the report's atomic
    write); now the path is checked before the corpus is even read."""
    import shutil

    from jaxstream import cli

    sample = Path(__file__).resolve().parents[1] / "models" / "assets" / "samples" / "sample.wav"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(sample, corpus / "sample.wav")
    shutil.copy(sample.with_suffix(".txt"), corpus / "sample.txt")
    folder = tmp_path / "reports"
    folder.mkdir()
    (tmp_path / "r.md").mkdir()
    for report, problem in [(folder, f"it is a directory; name the JSON file, e.g. {folder / 'report.json'}"),
                            (tmp_path / "r.json", f"{tmp_path / 'r.md'}, written beside it, is a directory"),
                            (Path("/proc/jaxstream-eval-test/r.json"),
                             "cannot write in /proc/jaxstream-eval-test: No such file or directory")]:
        assert cli.main(["eval", str(corpus), "--report", str(report)]) == 2
        assert capsys.readouterr().err == f"jaxstream eval: error: --report {report}: {problem}\n"


def test_a_report_that_cannot_be_replaced_leaves_no_partial_copy(tmp_path):
    from jaxstream.evaluation import reports

    taken = tmp_path / "report.json"
    taken.mkdir()  # written after the up-front check, say: the rename fails
    with pytest.raises(OSError):
        reports._write_atomic(taken, "{}")
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]
