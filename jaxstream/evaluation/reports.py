"""Evaluation reports: JSON (machine-readable), Markdown, a terminal table and a per-utterance CSV.

JSON schema `jaxstream-eval/1` (fractions, not percentages; times in seconds or in `*_ms` milliseconds):

    {
      "schema": "jaxstream-eval/1",
      "complete": bool,            # false while a run is in progress or after it was interrupted
      "updated": "2026-01-01T12:00:00+00:00",
      "model": str,
      "corpus": {"path": str, "layout": str, "utterances": int,     # in the corpus
                 "selected": int,                                   # after --limit / --shard
                 "limit": int | null, "shard": "i/N" | null,
                 "excluded": [id, ...]},                            # empty normalized references, not run
      "settings": {"concurrency": int, "realtime": bool, "normalizer": "english" | "basic" | "none",
                   "quantization": null | "int8", "kv_cache_dtype": "auto" | "bfloat16" | "fp8" | ...},
      "runs": [{                                                    # one per --delay-ms value
        "delay_ms": int | null,                                     # null: the model's default
        "complete": bool,
        "wall_seconds": float,                                      # summed over resumed/merged parts
        "rtfx": float | null,                                       # audio_seconds / wall_seconds
        "streams": {"peak": int, "mean": float,                     # sessions in flight (time-weighted mean)
                    "sustained": int | null},                       # --realtime only, see runner.py
        "summary": {"utterances", "transcribed", "errors": int,
                    "wer", "cer": float | null,
                    "words" | "characters": {"reference", "hits", "substitutions", "deletions", "insertions"},
                    "audio_seconds": float,
                    "latency": {"first_token_ms" | "finalize_ms" | "word_emission_ms" |
                                "word_emission_wall_ms" | "max_lag_ms":
                                {"count", "mean", "p50", "p90", "p99", "max"} | null}},
        "speakers": {speaker: {"utterances", "reference_words", "wer", "cer"}},
        "errors": [{"id", "audio", "error"}],
        "utterances": [UtteranceResult as a dict, see metrics.py]
      }]
    }

`--resume` reads a report back (`load_report`), keeps its successful utterances and runs the rest;
`merge_reports` joins the reports of the shards of one corpus into the report of the whole.
"""
import csv
import datetime
import io
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from jaxstream.errors import UserError
from jaxstream.evaluation.corpora import parse_shard
from jaxstream.evaluation.metrics import UtteranceResult, speaker_breakdown, summarize

SCHEMA = "jaxstream-eval/1"
_MARKDOWN_SPEAKERS = 20
_MARKDOWN_ERRORS = 50
_CSV_COLUMNS = (
    "delay_ms", "id", "speaker", "audio", "audio_seconds", "wer", "cer", "hits", "substitutions", "deletions",
    "insertions", "first_token_ms", "finalize_ms", "max_lag_ms", "reference", "hypothesis", "reference_normalized",
    "hypothesis_normalized", "error",
)


def run_entry(delay_ms: int | None, results: list[UtteranceResult], wall_seconds: float, streams: dict,
              complete: bool) -> dict:
    """The report entry of one delay's run over `results`."""
    summary = summarize(results)
    return {
        "delay_ms": delay_ms,
        "complete": complete,
        "wall_seconds": wall_seconds,
        "rtfx": summary["audio_seconds"] / wall_seconds if wall_seconds > 0 and summary["transcribed"] else None,
        "streams": streams,
        "summary": summary,
        "speakers": speaker_breakdown(results),
        "errors": [{"id": r.id, "audio": r.audio, "error": r.error} for r in results if not r.ok],
        "utterances": [r.to_dict() for r in results],
    }


def build_report(*, model: str, corpus: dict, settings: dict, runs: list[dict]) -> dict:
    return {
        "schema": SCHEMA,
        "complete": bool(runs) and all(run["complete"] for run in runs),
        "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "corpus": corpus,
        "settings": settings,
        "runs": runs,
    }


def companion_paths(json_path: str | os.PathLike) -> tuple[Path, Path]:
    """The Markdown and CSV files written next to a JSON report: `report.json` -> `report.md`, `report.csv`."""
    path = Path(json_path)
    return path.with_suffix(".md"), path.with_suffix(".csv")


def write_reports(report: dict, json_path: str | os.PathLike) -> None:
    """Writes the JSON report and its Markdown and CSV companions, each atomically (never half-written)."""
    markdown_path, csv_path = companion_paths(json_path)
    _write_atomic(Path(json_path), json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    _write_atomic(markdown_path, format_markdown(report))
    _write_atomic(csv_path, format_csv(report))


def load_report(path: str | os.PathLike) -> dict:
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"report not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read report {path}: {exc}") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise UserError(f"{path} is not a jaxstream eval report (schema {SCHEMA})")
    return report


# The settings every report of one evaluation shares, each as the flags that set it: a mismatch is told as what to
# pass, not as the report's values ("different realtime: True vs False"). The corpus is compared by folder name
# only, so shards run on hosts with different mount points still merge.
_SHARED_SETTINGS = (
    lambda report: f"with --model {report['model']}",
    lambda report: f"on corpus folder {Path(report['corpus']['path']).name!r}",
    lambda report: f"with --layout {report['corpus']['layout']}",
    lambda report: "with --realtime" if report["settings"]["realtime"] else "without --realtime",
    lambda report: f"with --normalizer {report['settings']['normalizer']}",
    # Reports written before --quantization existed ran float weights.
    lambda report: (f"with --quantization {report['settings']['quantization']}"
                    if report["settings"].get("quantization") else "without --quantization"),
    # And before --kv-cache-dtype, the compute dtype's KV (auto).
    lambda report: (f"with --kv-cache-dtype {report['settings']['kv_cache_dtype']}"
                    if report["settings"].get("kv_cache_dtype", "auto") != "auto" else "without --kv-cache-dtype"),
)


def shard_flag(report: dict) -> str:
    shard = report["corpus"]["shard"]
    return "without --shard" if shard is None else f"with --shard {shard}"


def limit_flag(report: dict) -> str:
    limit = report["corpus"]["limit"]
    return "without --limit" if limit is None else f"with --limit {limit}"


def setting_differences(report: dict, other: dict) -> tuple[str, str] | None:
    """How two reports' shared settings differ, as the flags each was run with ("with --model tiny and without
    --realtime", ...), or None when they are the same evaluation's."""
    differing = [(describe(report), describe(other)) for describe in _SHARED_SETTINGS
                 if describe(report) != describe(other)]
    if not differing:
        return None
    return " and ".join(mine for mine, _ in differing), " and ".join(theirs for _, theirs in differing)


def resume_mismatch(report_flags: str, run_flags: str) -> str:
    """What to do about a report `--resume` cannot continue: the flags it was run with, or another report."""
    return (f"the report was run {report_flags}, this run {run_flags}: run {report_flags} to continue it, or give "
            "another --report PATH to start a new run")


def find_run(report: dict, delay_ms: int | None) -> dict | None:
    return next((run for run in report["runs"] if run["delay_ms"] == delay_ms), None)


def run_results(run: dict) -> list[UtteranceResult]:
    return [UtteranceResult.from_dict(item) for item in run["utterances"]]


def merge_reports(reports: list[dict]) -> dict:
    """One report from the reports of the shards (`--shard i/N`) of one evaluation, or of partial runs of it.

    Every part must have the same `--limit` and shard count N (no `--shard`: N = 1). A shard may be given
    more than once (a rerun, or a resumed report beside the one it continued): its utterances are joined per
    delay (a later report's result replaces an earlier failed one) and of its timings those of the part with
    the longest wall time are kept, as a resumed report's already include the run it continued. Wall time is
    summed over shards, so the merged RTFx is the throughput of one process; streams keep the peak and the
    smallest sustained count. A run is complete only when every shard ran it and every selected utterance has
    a result; what is missing is said on stderr.
    """
    if not reports:
        raise UserError("nothing to merge")
    first = reports[0]
    for report in reports[1:]:
        if (differences := setting_differences(first, report)) is not None:
            raise UserError("cannot merge reports of different evaluations: one was run {}, another {}".format(
                *differences))
        if _shard(report)[1] != _shard(first)[1]:
            mine, theirs = (f"--shard {r['corpus']['shard']}" if r["corpus"]["shard"] else "no --shard"
                            for r in (first, report))
            raise UserError(f"cannot merge reports of a different shard count: {mine} vs {theirs}")
        for what, key in (("--limit", "limit"), ("corpus size", "utterances")):
            if first["corpus"][key] != report["corpus"][key]:
                raise UserError(f"cannot merge reports of a different {what}: {first['corpus'][key]!r} vs "
                                f"{report['corpus'][key]!r}")
    count = _shard(first)[1]
    by_shard: dict[int, list[dict]] = {}  # shard index -> its reports, in the order given
    for report in reports:
        by_shard.setdefault(_shard(report)[0], []).append(report)
    selected = 0
    for index, group in sorted(by_shard.items()):
        sizes = sorted({report["corpus"]["selected"] for report in group})
        if len(sizes) > 1:
            raise UserError(f"cannot merge reports of shard {index}/{count} that select different numbers of "
                            f"utterances: {', '.join(map(str, sizes))}")
        selected += sizes[0]
    excluded = sorted({item for report in reports for item in report["corpus"]["excluded"]})
    missing = [f"{index}/{count}" for index in range(count) if index not in by_shard]
    gaps = [f"shard {', '.join(missing)} not given"] if missing else []
    runs = []
    for delay_ms in dict.fromkeys(run["delay_ms"] for report in reports for run in report["runs"]):
        by_id: dict[str, UtteranceResult] = {}
        timed, not_run = [], []  # one timed part per shard that ran this delay; the shards that did not
        for index, group in sorted(by_shard.items()):
            parts = [run for report in group if (run := find_run(report, delay_ms)) is not None]
            if not parts:
                not_run.append(f"{index}/{count}")
                continue
            for part in parts:
                for result in run_results(part):
                    if result.ok or result.id not in by_id:
                        by_id[result.id] = result
            timed.append(max(parts, key=lambda part: part["wall_seconds"]))
        results = [by_id[key] for key in sorted(by_id)]
        delay = "the default delay" if delay_ms is None else f"delay {delay_ms} ms"
        if not_run:
            gaps.append(f"{delay} not run by shard {', '.join(not_run)}")
        elif not missing and len(results) < selected - len(excluded):
            gaps.append(f"{delay}: {len(results)} of {selected - len(excluded)} utterances run")
        complete = not missing and not not_run and len(results) >= selected - len(excluded)
        runs.append(run_entry(delay_ms, results, sum(part["wall_seconds"] for part in timed),
                              combine_streams([part["streams"] for part in timed]), complete))
    if gaps:
        print(f"warning: the merged report is incomplete: {'; '.join(gaps)}", file=sys.stderr)
    corpus = dict(first["corpus"], selected=selected, shard=None, excluded=excluded)
    return build_report(model=first["model"], corpus=corpus, settings=first["settings"], runs=runs)


def _shard(report: dict) -> tuple[int, int]:
    """(i, N) of a report's `--shard i/N`; (0, 1) for a report of the whole selection."""
    shard = report["corpus"]["shard"]
    return (0, 1) if shard is None else parse_shard(shard)


def combine_streams(parts: list[dict]) -> dict:
    """The streams entry of a run made of several parts (shards, resumed runs): peak, mean, the least sustained."""
    if not parts:
        return {"peak": 0, "mean": 0.0, "sustained": None}
    sustained = [part["sustained"] for part in parts if part["sustained"] is not None]
    return {"peak": max(part["peak"] for part in parts), "mean": sum(part["mean"] for part in parts) / len(parts),
            "sustained": min(sustained) if sustained else None}


# ---------------------------------------------------------------------------------------------- formats


def _summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The header and one row per delay of the summary table shown in the terminal and in Markdown."""
    header = ["delay ms", "utts", "errors", "WER %", "CER %", "sub", "del", "ins", "RTFx", "first token ms p50",
              "word latency ms p50/p90", "streams"]
    rows = []
    for run in report["runs"]:
        summary, latency = run["summary"], run["summary"]["latency"]
        words = latency["word_emission_wall_ms"] or latency["word_emission_ms"]
        streams = run["streams"]
        rows.append([
            "default" if run["delay_ms"] is None else str(run["delay_ms"]),
            str(summary["transcribed"]), str(summary["errors"]),
            _percent(summary["wer"]), _percent(summary["cer"]),
            str(summary["words"]["substitutions"]), str(summary["words"]["deletions"]),
            str(summary["words"]["insertions"]),
            "-" if run["rtfx"] is None else f"{run['rtfx']:.1f}",
            _number(latency["first_token_ms"] and latency["first_token_ms"]["p50"]),
            "-" if words is None else f"{words['p50']:.0f}/{words['p90']:.0f}",
            str(streams["peak"]) if streams["sustained"] is None else f"{streams['sustained']}/{streams['peak']}",
        ])
    return header, rows


def format_table(report: dict) -> str:
    """A plain-text table for the terminal, one row per delay."""
    header, rows = _summary_rows(report)
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    corpus, settings = report["corpus"], report["settings"]
    mode = "real time" if settings["realtime"] else "as fast as possible"
    lines = [
        f"# jaxstream eval: {Path(corpus['path']).name}",
        "",
        f"- model: `{report['model']}`",
        f"- corpus: `{corpus['path']}` ({corpus['layout']}), {corpus['selected']} of {corpus['utterances']} "
        f"utterances" + (f", shard {corpus['shard']}" if corpus["shard"] else "")
        + (f", {len(corpus['excluded'])} excluded (empty reference)" if corpus["excluded"] else ""),
        f"- {settings['concurrency']} concurrent sessions, audio {mode}; normalizer `{settings['normalizer']}`"
        + (f"; weights `{settings['quantization']}`" if settings.get("quantization") else "")
        + (f"; KV cache `{settings['kv_cache_dtype']}`" if settings.get("kv_cache_dtype", "auto") != "auto" else ""),
        f"- status: {'complete' if report['complete'] else 'partial'} (updated {report['updated']})",
        "",
    ]
    header, rows = _summary_rows(report)
    lines += _markdown_table(header, rows)
    lines.append("")
    lines.append("WER/CER are corpus-level after normalization; `streams` is sustained/peak concurrent sessions "
                 "(real-time runs) or the peak in flight.")
    for run in report["runs"]:
        delay = "default delay" if run["delay_ms"] is None else f"delay {run['delay_ms']} ms"
        if run["speakers"]:
            worst = sorted(run["speakers"].items(), key=lambda item: -(item[1]["wer"] or 0.0))[:_MARKDOWN_SPEAKERS]
            lines += ["", f"## Speakers, {delay} ({len(run['speakers'])}; highest WER first)", ""]
            lines += _markdown_table(["speaker", "utts", "words", "WER %", "CER %"], [
                [speaker, str(entry["utterances"]), str(entry["reference_words"]), _percent(entry["wer"]),
                 _percent(entry["cer"])] for speaker, entry in worst])
        if run["errors"]:
            lines += ["", f"## Errors, {delay} ({len(run['errors'])})", ""]
            lines += [f"- `{error['id']}`: {error['error']}" for error in run["errors"][:_MARKDOWN_ERRORS]]
    return "\n".join(lines) + "\n"


def format_csv(report: dict) -> str:
    """One row per utterance and delay."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(_CSV_COLUMNS)
    for run in report["runs"]:
        for result in run_results(run):
            counts = result.word_counts or ("",) * 4
            writer.writerow([
                "" if run["delay_ms"] is None else run["delay_ms"], result.id, result.speaker or "", result.audio,
                f"{result.audio_seconds:.3f}", _optional(result.wer), _optional(result.cer), *counts,
                _optional(result.first_token_ms), _optional(result.finalize_ms), _optional(result.max_lag_ms),
                result.reference, result.hypothesis or "", result.reference_normalized, result.hypothesis_normalized,
                result.error or "",
            ])
    return buffer.getvalue()


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(escape, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(escape, row)) + " |" for row in rows]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _optional(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def unwritable_reason(json_path: str | os.PathLike) -> str | None:
    """Why `write_reports` could not write at `json_path` (one of its files is a directory, or its folder
    cannot be made or written in), or None. Asked before a run, which otherwise failed after all its work;
    makes the folder, as writing would."""
    path = Path(json_path)
    if path.is_dir():
        return f"it is a directory; name the JSON file, e.g. {path / 'report.json'}"
    for companion in companion_paths(path):
        if companion.is_dir():
            return f"{companion}, written beside it, is a directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):  # where _write_atomic writes first
            pass
    except OSError as exc:
        return f"cannot write in {path.parent}: {exc.strerror or exc}"
    return None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # one per writer
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except BaseException:  # a report that could not be written leaves no hidden partial copy beside it
        temporary.unlink(missing_ok=True)
        raise
