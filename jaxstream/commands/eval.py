"""`jaxstream eval`: WER/CER, latency and throughput of a model over an audio corpus.

    jaxstream eval [--model MODEL] CORPUS [--concurrency N] [--limit N] [--shard i/N|auto] [--delay-ms 240,480]
                   [--realtime] [--report PATH [--resume]] [--layout L] [--normalizer english|basic|none]
    jaxstream eval --merge REPORT... [--report PATH]

Every utterance streams through the engine's realtime sessions, N at a time. `--report PATH` writes the
JSON report (schema in `jaxstream.evaluation.reports`) plus PATH with `.md` and `.csv` suffixes, and keeps
it up to date while the run goes, so `--resume` after an interruption runs only what is missing. Failed
utterances (unreadable audio, say) are listed on stderr with their reasons, and in the report.

`--shard auto` runs one part per process of a multi-process job (`jaxstream.distributed`: the same command on
every process, with --coordinator/--num-processes/--process-id or the job's environment); process 0 gathers
the parts and prints and writes the merged report. With --report each process also keeps its own part beside
it (PATH.part-I-of-N.json), which --resume continues. A process that fails hands its error to process 0, which
reports it. A shard may be empty (more shards than utterances): it is an empty part, and merges as any other.
"""
import logging
import sys

from jaxstream import distributed
from jaxstream.commands.transcribe import (
    add_precision_arguments, checked_delay_ms, model_source, speech_model_config,
)
from jaxstream.errors import UserError

logger = logging.getLogger(__name__)
_ERRORS_SHOWN = 5  # failed utterances listed on stderr; the report has them all
_NARROWBAND_SHOWN = 3  # files named per narrowband reason


def register(subparsers) -> None:
    from jaxstream.evaluation import LAYOUTS, NORMALIZERS
    from jaxstream.models.audio import ALLOWED_DELAYS_TEXT

    parser = subparsers.add_parser(
        "eval", help="evaluate a model on an audio corpus (WER, CER, latency, RTFx)",
        description=__doc__.split("\n\n")[0], epilog="Layouts: librispeech, manifest (JSONL/CSV/TSV), commonvoice, "
        "fleurs, folder (audio + same-name .txt); detected automatically unless --layout is given.")
    parser.add_argument("corpus", nargs="?", metavar="CORPUS", help="corpus directory or manifest/TSV file")
    parser.add_argument("--model", default=None, help="model name, directory or Hugging Face id (default: the "
                        "embedded tiny model)")
    parser.add_argument("--layout", default=None, choices=LAYOUTS, help="corpus layout (default: detected)")
    parser.add_argument("--concurrency", type=_positive_int, default=8, metavar="N",
                        help="sessions in flight at once (default 8)")
    parser.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="first N utterances only")
    parser.add_argument("--shard", default=None, metavar="i/N|auto",
                        help="evaluate the i-th of N deterministic parts (merge the reports with --merge); auto: "
                        "one part per process of a multi-process job, merged on process 0")
    parser.add_argument("--delay-ms", default=None, metavar="MS[,MS...]",
                        help=f"transcription delay(s) in ms, each {ALLOWED_DELAYS_TEXT}; a comma list sweeps "
                        "them (default: the model's, 480 for tiny)")
    parser.add_argument("--realtime", action="store_true",
                        help="append 80 ms of audio every 80 ms (latency as a live user sees it)")
    parser.add_argument("--normalizer", default="english", choices=NORMALIZERS,
                        help="text normalizer applied to both sides: english (default, Whisper's "
                        "EnglishTextNormalizer), basic (other languages) or none")
    parser.add_argument("--report", default=None, metavar="PATH",
                        help="write the JSON report to PATH, a Markdown summary and a per-utterance CSV beside it "
                        "(PATH with .md and .csv suffixes: report.json -> report.md, report.csv), updated while "
                        "the run goes")
    parser.add_argument("--resume", action="store_true", help="continue the run recorded in --report")
    parser.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                        help="join the reports of the shards of one corpus instead of running")
    add_precision_arguments(parser)
    distributed.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from jaxstream.evaluation import load_report, merge_reports
    from jaxstream.evaluation.reports import unwritable_reason

    if args.report is not None and args.report.endswith((".md", ".csv")):
        raise UserError("--report names the JSON report; the .md and .csv files are written next to it")
    if args.report is not None and (problem := unwritable_reason(args.report)) is not None:
        raise UserError(f"--report {args.report}: {problem}")  # now, not after the whole run
    if args.merge is not None:
        if args.corpus is not None:
            raise UserError("--merge joins existing reports; do not give a CORPUS with it")
        report = merge_reports([load_report(path) for path in args.merge])
        _finish(report, args.report)
        return 0
    if args.corpus is None:
        raise UserError("give a CORPUS to evaluate (or --merge REPORT...)")
    if args.resume and args.report is None:
        raise UserError("--resume needs --report PATH (the report of the run to continue)")

    group = distributed.ProcessGroup()
    if args.shard == "auto":
        group = distributed.initialize(args)
    elif distributed.settings(args, environ={}) is not None:  # flags only: a job's environment is no error
        raise UserError("the multi-process flags go with --shard auto")
    try:
        report = _evaluate_part(args, group)
    except BaseException as exc:
        if not group.leader:  # process 0 waits for this part: send it the error, or the whole job hangs
            _send_failure(exc)
        raise
    if group.count > 1:
        parts = distributed.gather_json("eval-report", {"report": report})
        if not group.leader:
            return 0
        failures = [f"process {index}: {part['error']}" for index, part in enumerate(parts) if "error" in part]
        if failures:
            raise UserError(f"{len(failures)} of {group.count} processes failed; {'; '.join(failures)}")
        report = merge_reports([part["report"] for part in parts])
    _finish(report, args.report)
    # An empty shard failed nothing: only a run whose every utterance failed is a failure.
    failed_everything = all(run["summary"]["transcribed"] == 0 < run["summary"]["errors"] for run in report["runs"])
    return 1 if failed_everything else 0


def _evaluate_part(args, group) -> dict:
    """This process's report: its shard of the corpus evaluated, resumed from its own report if asked."""
    from jaxstream.evaluation import write_reports

    evaluation = _plan(args, group)
    own_report = args.report
    if args.report is not None and group.count > 1:
        own_report = _part_path(args.report, group)
    if args.resume:
        _resume(evaluation, own_report)
    save = None if own_report is None else (lambda state: write_reports(state.report(), own_report))
    if any(evaluation.todo(delay) for delay in evaluation.delays):
        try:
            _run(evaluation, args, save)
        except BaseException:
            if save is not None:
                save(evaluation)  # what is done so far, so --resume can continue from here
            raise
    report = evaluation.report()
    if own_report is not None and group.count > 1:
        write_reports(report, own_report)  # this process's part, complete: --resume skips it all
    return report


def _send_failure(exc: BaseException) -> None:
    """Hands process 0, in place of this process's part, why it failed."""
    if isinstance(exc, UserError):
        reason = str(exc)
    elif isinstance(exc, KeyboardInterrupt):
        reason = "interrupted"
    else:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
    try:
        distributed.gather_json("eval-report", {"error": reason})
    except Exception as send_error:  # noqa: BLE001 - the job is going down; the original error is the one to raise
        print(f"warning: could not tell process 0 that this process failed: {send_error}", file=sys.stderr)


def _part_path(report_path: str, group) -> str:
    stem = report_path[:-len(".json")] if report_path.endswith(".json") else report_path
    return f"{stem}.part-{group.index}-of-{group.count}.json"


def _plan(args, group):
    from jaxstream.evaluation import Evaluation, RunOptions, parse_shard, read_corpus

    if args.shard == "auto":
        shard = (group.index, group.count) if group.count > 1 else None
    else:
        shard = None if args.shard is None else parse_shard(args.shard)
    requested = _parse_delays(args.delay_ms)
    corpus = read_corpus(args.corpus, args.layout)
    how = "detected" if corpus.detected else "--layout"
    print(f"corpus {corpus.path}: {corpus.layout} layout ({how}), read from {corpus.source}", file=sys.stderr)
    model = model_source(args.model)
    default_delay = _default_delay_ms(model)  # also checks, before any loading, that the model transcribes
    delays = requested or [default_delay]
    evaluation = Evaluation(corpus, model=model, delays=delays,
                            options=RunOptions(concurrency=args.concurrency, realtime=args.realtime,
                                               quantization=args.quantization,
                                               kv_cache_dtype=args.kv_cache_dtype or "auto"),
                            normalizer_name=args.normalizer, limit=args.limit, shard=shard)
    excluded = evaluation.corpus["excluded"]
    note = f" ({len(excluded)} with an empty reference excluded)" if excluded else ""
    print(f"{len(corpus.utterances)} utterances; evaluating {len(evaluation.utterances)}{note}", file=sys.stderr)
    for warning in corpus.warnings[:5]:
        print(f"  {warning}", file=sys.stderr)
    if len(corpus.warnings) > 5:
        print(f"  ... and {len(corpus.warnings) - 5} more skipped", file=sys.stderr)
    if not evaluation.utterances:
        _check_something_to_evaluate(corpus, args.limit, evaluation.normalizer)
        why = "has only empty references" if evaluation.corpus["selected"] else "selects no utterance"
        print(f"shard {evaluation.corpus['shard']} {why}: its part of the report is empty", file=sys.stderr)
    return evaluation


def _check_something_to_evaluate(corpus, limit: int | None, normalizer) -> None:
    """UserError unless some utterance of the whole selection (every shard's) has a reference to score: one
    shard may well be empty (more shards than utterances), and is then a valid empty part."""
    from jaxstream.evaluation import select_utterances
    from jaxstream.evaluation.metrics import is_scored_reference

    selected = select_utterances(corpus.utterances, limit)  # never empty: a corpus has utterances, limit >= 1
    if not any(is_scored_reference(normalizer(utterance.text)) for utterance in selected):
        raise UserError(f"nothing to evaluate: the reference of every selected utterance ({len(selected)}) is "
                        "empty after normalization (or marks a segment not to score)")


def _resume(evaluation, report_path: str) -> None:
    import os

    from jaxstream.evaluation import load_report

    if not os.path.exists(report_path):
        print(f"no report at {report_path} yet: starting from the beginning", file=sys.stderr)
        return
    try:
        kept = evaluation.resume_from(load_report(report_path))
    except UserError as exc:
        raise UserError(f"cannot resume {report_path}: {exc}") from None
    print(f"resuming {report_path}: {kept} utterance results kept", file=sys.stderr)


def _run(evaluation, args, save) -> None:
    import asyncio

    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig
    from jaxstream.evaluation import run_evaluation
    from jaxstream.models.audio import load_audio
    from jaxstream.models.audio_checks import engine_narrowband_warnings_muted, file_narrowband_reason

    bands: dict[str, str | None] = {}  # audio file -> why it is narrowband (None: it is not)

    def load_and_judge(path: str):
        pcm = load_audio(path)
        bands[path] = file_narrowband_reason(path, pcm)
        return pcm

    async def main():
        engine = AsyncEngine.from_pretrained(evaluation.model, config=EngineConfig(
            max_sessions=args.concurrency, quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype or "auto"))
        async with engine:
            await run_evaluation(evaluation, engine, load_audio=load_and_judge, save=save)

    with engine_narrowband_warnings_muted():  # judged here instead, where the files' names are known
        asyncio.run(main())
    _warn_narrowband(bands)


def _warn_narrowband(bands: dict[str, str | None]) -> None:
    """One warning per narrowband reason, naming a few of its files: the engine's own would name none."""
    from jaxstream.models.audio_checks import narrowband_warning

    by_reason: dict[str, list[str]] = {}
    for path, reason in bands.items():
        if reason is not None:
            by_reason.setdefault(reason, []).append(path)
    for reason, paths in by_reason.items():
        paths.sort()
        named = ", ".join(paths[:_NARROWBAND_SHOWN])
        more = f" and {len(paths) - _NARROWBAND_SHOWN} more" if len(paths) > _NARROWBAND_SHOWN else ""
        logger.warning("%d of %d files (%s%s): %s", len(paths), len(bands), named, more, narrowband_warning(reason))


def _finish(report: dict, report_path: str | None) -> None:
    from jaxstream.evaluation import format_table, write_reports
    from jaxstream.evaluation.reports import companion_paths

    print(format_table(report))
    _print_errors(report)
    if report_path is not None:
        write_reports(report, report_path)
        print(f"report: {', '.join(map(str, (report_path, *companion_paths(report_path))))}", file=sys.stderr)


def _print_errors(report: dict) -> None:
    """Why utterances failed, on stderr: the table only counts them."""
    for run in report["runs"]:
        errors = run["errors"]
        if not errors:
            continue
        delay = "the default delay" if run["delay_ms"] is None else f"{run['delay_ms']} ms"
        print(f"{len(errors)} utterance(s) failed at {delay}:", file=sys.stderr)
        for error in errors[:_ERRORS_SHOWN]:
            print(f"  {error['id']}: {error['error']}", file=sys.stderr)
        if len(errors) > _ERRORS_SHOWN:
            print(f"  ... and {len(errors) - _ERRORS_SHOWN} more (the report lists them all)", file=sys.stderr)


def _parse_delays(text: str | None) -> list[int]:
    """The delays of `--delay-ms`, in order, without repeats; none when it is not given."""
    if text is None:
        return []
    delays = []
    for item in text.split(","):
        try:
            delay = int(item.strip())
        except ValueError:
            raise UserError(f"--delay-ms takes milliseconds, e.g. 480 or 240,480,960; got {text!r}") from None
        delay = checked_delay_ms(delay)
        if delay not in delays:
            delays.append(delay)
    return delays


def _default_delay_ms(model: str) -> int:
    """The delay the engine uses for `model` when none is asked for, from the checkpoint's configuration
    (no weights read), so that reports and tables name the delay used instead of "default"."""
    return speech_model_config(model, "eval").default_delay_ms


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
