"""SVOX Pico, the third training engine, and the suffix alignment that gives its words their times: the aligner's
dynamic programme against a plain one, its word times against espeak-ng's own word events, Pico sentences,
corpora and the CLI."""
import importlib.util
import os

import numpy as np
import pytest

from jaxstream.synth import CorpusSpec, VoiceSpec, alignment, generate_corpus, sentences
from jaxstream.synth.engines import speak_espeak
from jaxstream.synth.pico import PICO_VOICES, PicoVoice, speak_pico


def _plain_open_end_alignment(prefix: np.ndarray, whole: np.ndarray) -> int:
    """The textbook symmetric recursion with slope constraint 1/2..2 (steps (1, 1) weighted 2, (1, 2) and (2, 1)
    through their middle cell weighted 2 + 1), cell by cell in float64."""
    rows, columns = prefix.shape[0], whole.shape[0]
    d = np.array([[np.linalg.norm(prefix[i].astype(np.float64) - whole[j]) for j in range(columns)]
                  for i in range(rows)])
    cost = np.full((rows, columns), np.inf)
    cost[0, 0] = 2 * d[0, 0]
    for i in range(1, rows):
        for j in range(1, columns):
            options = [cost[i - 1, j - 1] + 2 * d[i, j]]
            if j >= 2:
                options.append(cost[i - 1, j - 2] + 2 * d[i, j - 1] + d[i, j])
            if i >= 2:
                options.append(cost[i - 2, j - 1] + 2 * d[i - 1, j] + d[i, j])
            cost[i, j] = min(options)
    return int(np.argmin(cost[-1] / (np.arange(1, columns + 1) + rows)))


@pytest.mark.parametrize("seed", range(6))
def test_open_end_alignment_is_the_textbook_recursion(seed):
    rng = np.random.default_rng(seed)
    whole = rng.standard_normal((int(rng.integers(12, 30)), 5)).astype(np.float32)
    # A warped, noisy copy of a start of `whole`, so the answer is not at an edge.
    end = int(rng.integers(4, whole.shape[0] - 2))
    prefix = np.repeat(whole[:end], rng.integers(1, 3, size=end), axis=0)
    prefix = prefix + 0.3 * rng.standard_normal(prefix.shape).astype(np.float32)
    found = alignment.open_end_alignment(prefix, whole)
    assert found == _plain_open_end_alignment(prefix, whole)
    assert abs(found - (end - 1)) <= 1


def test_suffix_alignment_finds_espeak_ngs_word_times():
    """Oracle: espeak-ng reports where each word starts (its WORD events; `speak_espeak` ends a word with its
    last sound before the next); the aligner sees only audio. Words espeak-ng speaks as one group ("in the")
    share its times and are left out. The aligner's starts come ~20 ms after the events (it starts a word at its
    first sound, an event comes with the word's first phoneme, often a stop's silent closure)."""
    rng = np.random.default_rng(5)
    starts, ends = [], []
    for index in range(8):
        words = sentences.training_sentence(rng).split()
        voice = VoiceSpec(accent="en-us", variant=("m3", "f2", "klatt")[index % 3],
                          speed_wpm=int(rng.integers(130, 190)))
        reference = speak_espeak(words, voice)
        if reference is None:
            continue
        spans = alignment.word_spans_from_suffixes(words, lambda suffix: speak_espeak(suffix, voice).audio,
                                                   reference.audio)
        assert spans is not None and len(spans) == len(words)
        alone = [k for k in range(len(words)) if reference.words.count(reference.words[k]) == 1]
        starts += [spans[k][0] - reference.words[k][0] for k in alone if k > 0]
        ends += [spans[k][1] - reference.words[k][1] for k in alone]
    assert len(starts) > 40
    for errors in (np.abs(starts), np.abs(ends)):
        assert np.median(errors) <= 0.04  # seconds; 20 ms alignment frames
        assert np.mean(errors <= 0.08) >= 0.9  # one decoder slot


def test_pico_speaks_each_voice_with_ordered_word_times():
    words = "please turn off the lights in the kitchen".split()
    for language in PICO_VOICES:
        spoken = speak_pico(words, PicoVoice(language))
        assert spoken is not None and len(spoken.words) == len(words)
        audio = spoken.audio
        previous = 0.0
        for start, end in spoken.words:
            assert previous <= start < end <= audio.size / 16000
            assert np.abs(audio[int(start * 16000) : int(end * 16000)]).max() > 0.02 * np.abs(audio).max()
            previous = end
        # No sound before the first word or after the last (Pico writes digital silence there).
        assert np.abs(audio[: round(spoken.words[0][0] * 16000)]).max(initial=0) <= alignment.SILENCE_LEVEL
        assert np.abs(audio[round(spoken.words[-1][1] * 16000) :]).max(initial=0) <= alignment.SILENCE_LEVEL
    slow = speak_pico(words, PicoVoice("en-US", rate=70))
    assert slow.words[-1][1] > 1.2 * speak_pico(words, PicoVoice("en-US")).words[-1][1]
    with pytest.raises(ValueError, match="Pico voice"):
        PicoVoice("de-DE")


def test_a_pico_corpus_is_timed_training_data(tmp_path):
    records = generate_corpus(os.fspath(tmp_path), CorpusSpec(6, seed=3, text="sentences", engines=(("pico", 1.0),)))
    picos = [record for record in records if record["engine"] == "pico"]
    assert len(picos) >= 5  # the rare sentence whose words do not align is spoken by espeak-ng instead
    for record in picos:
        assert record["voice"] in PICO_VOICES
        assert record["id"].startswith(f"{7100 + PICO_VOICES.index(record['voice'])}-0-")  # one speaker a voice
        assert 75 <= record["rate_percent"] <= 130 and 60 <= record["pitch_percent"] <= 130
        assert [w["word"] for w in record["words"]] == record["text"].split()
        times = [t for w in record["words"] for t in (w["start"], w["end"])]
        assert times == sorted(times) and 0 < times[0] and times[-1] < record["duration"]


def test_the_cli_names_a_missing_pico(tmp_path, monkeypatch, capsys):
    from jaxstream.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ttspico" else real(name, *a))
    assert main(["synth", os.fspath(tmp_path / "x"), "--engines", "espeak,pico"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "pip install ttspico" in error
    assert not (tmp_path / "x").exists()
