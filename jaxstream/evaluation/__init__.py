"""Offline evaluation over audio corpora: readers, WER/CER and latency metrics, reports (`jaxstream eval`).

`read_corpus` reads a corpus in any supported layout; `Evaluation` + `run_evaluation` transcribe it through
the engine's realtime sessions; `write_reports` / `format_table` present the results.
"""
from jaxstream.evaluation.corpora import (
    LAYOUTS, Corpus, Utterance, WordTiming, detect_layout, parse_shard, read_corpus, select_utterances,
)
from jaxstream.evaluation.metrics import NORMALIZERS, UtteranceResult, make_normalizer, summarize
from jaxstream.evaluation.reports import (
    SCHEMA, format_csv, format_markdown, format_table, load_report, merge_reports, write_reports,
)
from jaxstream.evaluation.runner import Evaluation, RunOptions, StreamRecord, run_evaluation, stream_audio

__all__ = [
    "LAYOUTS", "NORMALIZERS", "SCHEMA", "Corpus", "Evaluation", "RunOptions", "StreamRecord", "Utterance",
    "UtteranceResult", "WordTiming", "detect_layout", "format_csv", "format_markdown", "format_table",
    "load_report", "make_normalizer", "merge_reports", "parse_shard", "read_corpus", "run_evaluation",
    "select_utterances", "stream_audio", "summarize", "write_reports",
]
