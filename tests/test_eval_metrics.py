"""Scoring against jiwer + Whisper's normalizer computed independently, latency pairing, empty references."""
import jiwer
import numpy as np
import pytest
from whisper_normalizer.basic import BasicTextNormalizer
from whisper_normalizer.english import EnglishTextNormalizer

from jaxstream.errors import UserError
from jaxstream.evaluation import (
    NORMALIZERS, Corpus, Evaluation, RunOptions, Utterance, UtteranceResult, WordTiming, summarize,
)
from jaxstream.evaluation.metrics import (
    emitted_words, make_normalizer, score, speaker_breakdown, word_emission_latencies,
)

PAIRS = [  # (speaker, reference, hypothesis): case, punctuation, numbers, spelling, fillers differ
    ("a", "Mr. Quilter is the apostle of the middle classes.", "mister quilter is the apostle of the middle class"),
    ("a", "He paid twenty dollars in 1990, didn't he?", "he paid 20 dollars in nineteen ninety did not he"),
    ("b", "The COLOUR of the sky, uh, was grey.", "the color of sky was gray today"),
    ("b", "Nothing was said", ""),
    ("c", "one two three four five", "one too three for five six"),
]


def _results(normalizer_name="english"):
    normalizer = make_normalizer(normalizer_name)
    results = []
    for index, (speaker, reference, hypothesis) in enumerate(PAIRS):
        result = UtteranceResult(f"u{index}", f"u{index}.wav", reference, speaker=speaker,
                                 reference_normalized=normalizer(reference), audio_seconds=1.0 + index)
        score(result, hypothesis, normalizer)
        results.append(result)
    return results


@pytest.mark.parametrize("name,oracle", [("english", EnglishTextNormalizer()), ("basic", BasicTextNormalizer())])
def test_corpus_wer_and_cer_equal_jiwer_on_normalized_text(name, oracle):
    summary = summarize(_results(name))
    references = [oracle(reference) for _, reference, _ in PAIRS]
    hypotheses = [oracle(hypothesis) for _, _, hypothesis in PAIRS]
    expected = jiwer.process_words(references, hypotheses)
    assert summary["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
    assert summary["cer"] == pytest.approx(jiwer.cer(references, hypotheses), abs=1e-12)
    assert summary["words"] == {"reference": expected.hits + expected.substitutions + expected.deletions,
                                "hits": expected.hits, "substitutions": expected.substitutions,
                                "deletions": expected.deletions, "insertions": expected.insertions}
    assert summary["audio_seconds"] == pytest.approx(sum(1.0 + i for i in range(len(PAIRS))))


def test_speaker_breakdown_equals_jiwer_per_speaker():
    oracle = EnglishTextNormalizer()
    breakdown = speaker_breakdown(_results())
    assert sorted(breakdown) == ["a", "b", "c"]
    for speaker, entry in breakdown.items():
        references = [oracle(r) for s, r, _ in PAIRS if s == speaker]
        hypotheses = [oracle(h) for s, _, h in PAIRS if s == speaker]
        assert entry["utterances"] == len(references)
        assert entry["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
        assert entry["reference_words"] == sum(len(r.split()) for r in references)


def test_failed_utterances_are_left_out_of_scores():
    results = _results()
    failed = UtteranceResult("x", "x.wav", "some words", reference_normalized="some words",
                             error="audio file not found")
    with_failure = summarize([*results, failed])
    assert with_failure["errors"] == 1 and with_failure["transcribed"] == len(results)
    assert with_failure["wer"] == summarize(results)["wer"]


def test_emitted_words_take_the_time_of_their_last_piece():
    deltas = [("Hel", 0.5), ("lo wor", 0.8), ("ld", 1.2), (" again.", 1.6), (" ", 2.0)]
    assert emitted_words(deltas) == [("Hello", 0.8), ("world", 1.2), ("again.", 1.6)]


def test_word_latency_pairs_only_matching_words():
    reference = [WordTiming("the", 0.1, 0.3), WordTiming("cat", 0.4, 0.7), WordTiming("sat", 0.8, 1.0),
                 WordTiming("on", 1.1, 1.2), WordTiming("the", 1.3, 1.4), WordTiming("mat", 1.5, 1.9)]
    # "sat" is substituted by "sang", "really" is inserted; case and punctuation do not matter.
    emitted = [("The", 0.9), ("cat,", 1.1), ("sang", 1.5), ("really", 1.6), ("on", 1.7), ("THE", 1.9), ("mat.", 2.4)]
    matched = {0: 0, 1: 1, 3: 4, 4: 5, 5: 6}  # reference index -> emitted index, by construction
    expected = [emitted[h][1] - reference[r].end for r, h in sorted(matched.items())]
    assert word_emission_latencies(reference, emitted) == pytest.approx(expected)
    assert word_emission_latencies(reference, []) == []


def test_empty_references_are_excluded_like_the_leaderboard(tmp_path):
    texts = ["A real sentence.", "", "[noise]", "uh um", "Ignore time segment in scoring", "Another one"]
    corpus = Corpus(str(tmp_path), "manifest", tuple(Utterance(f"u{i}", f"u{i}.wav", t) for i, t in enumerate(texts)))
    evaluation = Evaluation(corpus, model="m", delays=[None], options=RunOptions(), normalizer_name="english")
    oracle = EnglishTextNormalizer()
    kept = [f"u{i}" for i, t in enumerate(texts) if oracle(t).strip() not in ("", "ignore time segment in scoring")]
    assert [u.id for u in evaluation.utterances] == kept == ["u0", "u5"]
    assert evaluation.corpus["excluded"] == ["u1", "u2", "u3", "u4"]


@pytest.mark.parametrize("normalizer_name", NORMALIZERS)
def test_the_ted_lium_marker_is_excluded_under_every_normalizer(tmp_path, normalizer_name):
    """`--normalizer none` keeps TED-LIUM's underscores, so its marker once was scored as a three-word reference."""
    texts = ["ignore_time_segment_in_scoring", " ignore_time_segment_in_scoring ", "keep this one"]
    corpus = Corpus(str(tmp_path), "manifest", tuple(Utterance(f"u{i}", f"u{i}.wav", t) for i, t in enumerate(texts)))
    evaluation = Evaluation(corpus, model="m", delays=[None], options=RunOptions(), normalizer_name=normalizer_name)
    assert [u.id for u in evaluation.utterances] == ["u2"]
    assert evaluation.corpus["excluded"] == ["u0", "u1"]


def test_resume_keeps_successes_and_retries_failures(tmp_path):
    corpus = Corpus(str(tmp_path), "manifest", tuple(Utterance(f"u{i}", f"u{i}.wav", f"word {i}") for i in range(5)))
    first = Evaluation(corpus, model="m", delays=[480], options=RunOptions(), normalizer_name="english")
    normalizer = make_normalizer("english")
    for utterance in first.utterances[:3]:
        result = UtteranceResult(utterance.id, utterance.audio, utterance.text,
                                 reference_normalized=normalizer(utterance.text), first_token_ms=float(np.pi))
        if utterance.id == "u1":
            result.error = "cannot decode audio u1.wav"
        else:
            score(result, utterance.text, normalizer)
        first.add(480, result)
    report = first.report()
    assert not report["complete"]
    second = Evaluation(corpus, model="m", delays=[480, 960], options=RunOptions(), normalizer_name="english")
    assert second.resume_from(report) == 2
    assert [u.id for u in second.todo(480)] == ["u1", "u3", "u4"]
    assert len(second.todo(960)) == 5
    other = Evaluation(corpus, model="other", delays=[480], options=RunOptions(), normalizer_name="english")
    with pytest.raises(UserError, match="the report was run with --model m, this run with --model other: run with "
                                        "--model m to continue it"):
        other.resume_from(report)
    smaller = Evaluation(corpus, model="m", delays=[480], options=RunOptions(), normalizer_name="english", limit=1)
    with pytest.raises(UserError, match="the report was run without --limit, this run with --limit 1"):
        smaller.resume_from(report)
