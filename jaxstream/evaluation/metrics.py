"""Scoring: text normalization, word/character error counts (jiwer), latency distributions, summaries.

Conventions (those of the Open ASR Leaderboard, `huggingface/open_asr_leaderboard`, `normalizer/`):

- Whisper's `EnglishTextNormalizer` (package `whisper-normalizer`) is applied to the reference **and** the
  hypothesis before scoring (`basic` = Whisper's `BasicTextNormalizer` for other languages, `none` only
  collapses whitespace).
- Utterances whose *normalized* reference is empty or reads "ignore time segment in scoring" (or TED-LIUM's
  raw `ignore_time_segment_in_scoring`, which `none` leaves as it is) are not evaluated at all (the
  leaderboard's `is_target_text_in_range` filter): they are listed in the report as excluded and never
  transcribed, so they affect neither WER nor RTFx.
- WER and CER are corpus-level: total (substitutions + deletions + insertions) over total reference words
  (characters, spaces included, for CER) — what `jiwer.wer(list_of_refs, list_of_hyps)` computes. Each
  utterance's counts are kept, so summing them reproduces the corpus figure exactly.
- Utterances that failed (unreadable audio, engine error) are reported as errors and left out of WER.

Latency (see `runner.py` for the clocks): per-word emission latency pairs each hypothesis word with the
reference word it matches in a word alignment and takes (emission time - reference word end time); words
without a match (substitutions, insertions) have no latency.
"""
import dataclasses
import re
from collections.abc import Callable, Iterable

import numpy as np

from jaxstream.errors import UserError

NORMALIZERS = ("english", "basic", "none")
IGNORED_REFERENCE = "ignore time segment in scoring"
# TED-LIUM writes the marker with underscores; the english/basic normalizers turn them into spaces, `none` does not.
_IGNORED_REFERENCES = (IGNORED_REFERENCE, IGNORED_REFERENCE.replace(" ", "_"))


@dataclasses.dataclass
class UtteranceResult:
    """What one utterance contributes to a report (one row of the per-utterance CSV)."""

    id: str
    audio: str
    reference: str
    speaker: str | None = None
    hypothesis: str | None = None  # None when the utterance failed
    reference_normalized: str = ""
    hypothesis_normalized: str = ""
    # (hits, substitutions, deletions, insertions) against the normalized reference; None when failed.
    word_counts: tuple[int, int, int, int] | None = None
    char_counts: tuple[int, int, int, int] | None = None
    audio_seconds: float = 0.0
    first_token_ms: float | None = None
    finalize_ms: float | None = None
    max_lag_ms: float | None = None
    word_latencies_ms: list[float] = dataclasses.field(default_factory=list)
    word_latencies_wall_ms: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def wer(self) -> float | None:
        return _error_rate(self.word_counts)

    @property
    def cer(self) -> float | None:
        return _error_rate(self.char_counts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "UtteranceResult":
        fields = {field.name for field in dataclasses.fields(cls)}
        result = cls(**{key: value for key, value in data.items() if key in fields})
        result.word_counts = _counts_tuple(result.word_counts)
        result.char_counts = _counts_tuple(result.char_counts)
        return result


def make_normalizer(name: str) -> Callable[[str], str]:
    """The text normalizer applied to both sides before scoring."""
    if name == "english":
        from whisper_normalizer.english import EnglishTextNormalizer

        return EnglishTextNormalizer()
    if name == "basic":
        from whisper_normalizer.basic import BasicTextNormalizer

        return BasicTextNormalizer()
    if name == "none":
        return lambda text: " ".join(text.split())
    raise UserError(f"unknown normalizer {name!r}; expected one of {', '.join(NORMALIZERS)}")


def is_scored_reference(normalized_reference: str) -> bool:
    """False for references the leaderboard filters out (empty or an ignore-time-segment marker)."""
    stripped = normalized_reference.strip()
    return bool(stripped) and stripped not in _IGNORED_REFERENCES


def word_counts(reference: str, hypothesis: str) -> tuple[int, int, int, int]:
    """(hits, substitutions, deletions, insertions) of the word alignment of two normalized texts."""
    import jiwer

    output = jiwer.process_words(reference, hypothesis)
    return output.hits, output.substitutions, output.deletions, output.insertions


def char_counts(reference: str, hypothesis: str) -> tuple[int, int, int, int]:
    import jiwer

    output = jiwer.process_characters(reference, hypothesis)
    return output.hits, output.substitutions, output.deletions, output.insertions


def score(result: UtteranceResult, hypothesis: str, normalizer: Callable[[str], str]) -> None:
    """Sets `result`'s hypothesis and its word/character error counts against the normalized reference."""
    result.hypothesis = hypothesis
    result.hypothesis_normalized = normalizer(hypothesis)
    result.word_counts = word_counts(result.reference_normalized, result.hypothesis_normalized)
    result.char_counts = char_counts(result.reference_normalized, result.hypothesis_normalized)


def emitted_words(deltas: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    """Words of a streamed transcript, each with the time of the delta that carried its last character.

    `deltas` are (text, time) in emission order; a word spanning several deltas is emitted by the last.
    """
    text, ends, times = "", [], []
    for piece, time in deltas:
        text += piece
        ends.append(len(text))
        times.append(time)
    words = []
    for match in re.finditer(r"\S+", text):
        last_char = match.end() - 1
        delta_index = next(i for i, end in enumerate(ends) if end > last_char)
        words.append((match.group(), times[delta_index]))
    return words


def word_emission_latencies(reference_words, emitted: list[tuple[str, float]]) -> list[float]:
    """Emission time - reference end time (seconds) of every hypothesis word that matches a reference word.

    `reference_words` are `WordTiming`s. Words are matched after lowercasing and dropping punctuation, in
    a minimum-edit word alignment, so repeated words pair with the right occurrence.
    """
    import jiwer

    reference = [(key, word.end) for word in reference_words if (key := _match_key(word.word))]
    hypothesis = [(key, time) for word, time in emitted if (key := _match_key(word))]
    if not reference or not hypothesis:
        return []
    output = jiwer.process_words(" ".join(k for k, _ in reference), " ".join(k for k, _ in hypothesis))
    latencies = []
    for chunk in output.alignments[0]:
        if chunk.type == "equal":
            for offset in range(chunk.ref_end_idx - chunk.ref_start_idx):
                emission = hypothesis[chunk.hyp_start_idx + offset][1]
                latencies.append(emission - reference[chunk.ref_start_idx + offset][1])
    return latencies


def distribution(values: Iterable[float]) -> dict | None:
    """count, mean, p50, p90, p99, max of a sample; None when it is empty."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return None
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"count": int(array.size), "mean": float(array.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(array.max())}


def summarize(results: Iterable[UtteranceResult]) -> dict:
    """Corpus-level quality and latency of a run's utterance results (timing of the run is added by the caller)."""
    results = list(results)
    done = [r for r in results if r.ok]
    words, chars = _sum_counts(r.word_counts for r in done), _sum_counts(r.char_counts for r in done)
    return {
        "utterances": len(results),
        "transcribed": len(done),
        "errors": len(results) - len(done),
        "wer": _error_rate(words),
        "cer": _error_rate(chars),
        "words": _counts_dict(words),
        "characters": _counts_dict(chars),
        "audio_seconds": float(sum(r.audio_seconds for r in done)),
        "latency": {
            "first_token_ms": distribution(r.first_token_ms for r in done if r.first_token_ms is not None),
            "finalize_ms": distribution(r.finalize_ms for r in done if r.finalize_ms is not None),
            "word_emission_ms": distribution(v for r in done for v in r.word_latencies_ms),
            "word_emission_wall_ms": distribution(v for r in done for v in r.word_latencies_wall_ms),
            "max_lag_ms": distribution(r.max_lag_ms for r in done if r.max_lag_ms is not None),
        },
    }


def speaker_breakdown(results: Iterable[UtteranceResult]) -> dict[str, dict]:
    """Per-speaker utterance count, reference words, WER and CER (speakers the corpus names only)."""
    by_speaker: dict[str, list[UtteranceResult]] = {}
    for result in results:
        if result.ok and result.speaker is not None:
            by_speaker.setdefault(result.speaker, []).append(result)
    breakdown = {}
    for speaker in sorted(by_speaker):
        members = by_speaker[speaker]
        words = _sum_counts(r.word_counts for r in members)
        chars = _sum_counts(r.char_counts for r in members)
        breakdown[speaker] = {"utterances": len(members), "reference_words": words[0] + words[1] + words[2],
                              "wer": _error_rate(words), "cer": _error_rate(chars)}
    return breakdown


def _match_key(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def _sum_counts(counts: Iterable[tuple[int, int, int, int] | None]) -> tuple[int, int, int, int]:
    total = np.zeros(4, dtype=np.int64)
    for item in counts:
        if item is not None:
            total += item
    return tuple(int(v) for v in total)


def _error_rate(counts: tuple[int, int, int, int] | None) -> float | None:
    if counts is None:
        return None
    hits, substitutions, deletions, insertions = counts
    reference = hits + substitutions + deletions
    return (substitutions + deletions + insertions) / reference if reference else None


def _counts_dict(counts: tuple[int, int, int, int]) -> dict:
    hits, substitutions, deletions, insertions = counts
    return {"reference": hits + substitutions + deletions, "hits": hits, "substitutions": substitutions,
            "deletions": deletions, "insertions": insertions}


def _counts_tuple(value) -> tuple[int, int, int, int] | None:
    return None if value is None else tuple(int(v) for v in value)
