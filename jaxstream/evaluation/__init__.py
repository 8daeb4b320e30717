"""Offline evaluation over audio corpora: readers, WER/CER and latency metrics, reports (`jaxstream eval`).

`read_corpus` reads a corpus in any supported layout; `Evaluation` + `run_evaluation` transcribe it through
the engine's realtime sessions; `write_reports` / `format_table` present the results.
"""
from jaxstream.lazy_exports import lazy_exports

# Public name -> module, imported on first use: the CLI's parsers read a few constants without jax.
_LAZY = {
    "Corpus": "jaxstream.evaluation.corpora",
    "Evaluation": "jaxstream.evaluation.runner",
    "LAYOUTS": "jaxstream.evaluation.corpora",
    "NORMALIZERS": "jaxstream.evaluation.metrics",
    "RunOptions": "jaxstream.evaluation.runner",
    "SCHEMA": "jaxstream.evaluation.reports",
    "StreamRecord": "jaxstream.evaluation.runner",
    "Utterance": "jaxstream.evaluation.corpora",
    "UtteranceResult": "jaxstream.evaluation.metrics",
    "WordTiming": "jaxstream.evaluation.corpora",
    "detect_layout": "jaxstream.evaluation.corpora",
    "format_csv": "jaxstream.evaluation.reports",
    "format_markdown": "jaxstream.evaluation.reports",
    "format_table": "jaxstream.evaluation.reports",
    "load_report": "jaxstream.evaluation.reports",
    "make_normalizer": "jaxstream.evaluation.metrics",
    "merge_reports": "jaxstream.evaluation.reports",
    "parse_shard": "jaxstream.evaluation.corpora",
    "read_corpus": "jaxstream.evaluation.corpora",
    "run_evaluation": "jaxstream.evaluation.runner",
    "select_utterances": "jaxstream.evaluation.corpora",
    "stream_audio": "jaxstream.evaluation.runner",
    "summarize": "jaxstream.evaluation.metrics",
    "write_reports": "jaxstream.evaluation.reports",
}

__all__ = [
    "LAYOUTS", "NORMALIZERS", "SCHEMA", "Corpus", "Evaluation", "RunOptions", "StreamRecord", "Utterance",
    "UtteranceResult", "WordTiming", "detect_layout", "format_csv", "format_markdown", "format_table",
    "load_report", "make_normalizer", "merge_reports", "parse_shard", "read_corpus", "run_evaluation",
    "select_utterances", "stream_audio", "summarize", "write_reports",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
