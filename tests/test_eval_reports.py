"""Reports: JSON round trip, merging shard reports, the per-utterance CSV and the Markdown/terminal tables."""
import csv
import io
import json

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
    other = dict(shards[0], model="another")
    with pytest.raises(UserError, match="different model"):
        merge_reports([shards[1], other])


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
