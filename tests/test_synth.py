"""Synthetic corpus generator: number words, espeak-ng word boundaries, edited voices, layout, held-out split,
CLI."""
import json
import os
import shutil

import numpy as np
import pytest
import soundfile

from jaxstream.synth import (
    HELD_OUT_VARIANTS, TRAIN_VARIANTS, CorpusSpec, SentenceSampler, VoiceSpec, generate_corpus,
    is_held_out_sentence, number_words, read_manifest, synthesize_words,
)
from jaxstream.synth.espeak import _run_espeak
from jaxstream.synth.voices import random_voice_edits

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")


@pytest.mark.parametrize("n", [0, 7, 13, 20, 42, 99, 100, 305, 999, 1000, 1905, 1984, 2007, 2024, 4321])
def test_number_words_read_back_as_digits(n):
    # Oracle: Whisper's English normaliser turns spelled-out numbers back into digits.
    from whisper_normalizer.english import EnglishTextNormalizer

    assert EnglishTextNormalizer()(" ".join(number_words(n))) == str(n)


def test_sentence_sampler_draws_known_words_and_splits_by_hash():
    sampler = SentenceSampler()
    rng = np.random.default_rng(3)
    vocabulary = sampler.vocabulary
    assert len(vocabulary) > 3000
    for held_out in (False, True):
        for _ in range(50):
            words = sampler.sample_split(rng, held_out)
            assert set(words) <= vocabulary
            assert is_held_out_sentence(words) == held_out
    assert not set(TRAIN_VARIANTS) & set(HELD_OUT_VARIANTS)


@needs_espeak
def test_word_segments_are_the_words_between_the_breaks():
    # Oracle: the same sentence with 1.5 s breaks, cut at every run of >= 1 s of exact digital zeros.
    voice = VoiceSpec("en-gb-scotland", "f2", speed_wpm=170, pitch=40)
    words = ["stop", "it", "twenty", "three", "representation"]
    pieces = synthesize_words(words, voice)
    pause = '<break time="1500ms"/>'
    audio = _run_espeak(voice, "<speak>" + pause.join(words) + "</speak>", ssml=True)
    silent = np.concatenate([[True], np.abs(audio) < 1e-3, [True]])
    edges = np.flatnonzero(np.diff(silent.astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    keep = [0] + [i for i in range(1, len(starts)) if starts[i] - ends[i - 1] >= 16000]
    bounds = [(starts[i], ends[j - 1] if k + 1 < len(keep) else ends[-1])
              for k, (i, j) in enumerate(zip(keep, keep[1:] + [len(starts)]))]
    assert len(pieces) == len(bounds) == len(words)
    for piece, (start, end) in zip(pieces, bounds):
        np.testing.assert_allclose(piece, audio[start:end], atol=1e-3)  # resampler edge effects only


@needs_espeak
def test_edited_voice_is_the_base_voice_file_plus_the_edits():
    # Oracle: espeak-ng's own variant. m3's file already says "pitch 80 122", so repeating that line must give
    # m3's audio exactly (the private data directory is complete); changing it must not (the edit is applied,
    # not silently replaced by a default voice, which is what espeak-ng does for an unknown variant name).
    text = "<speak>seven<break time=\"600ms\"/>hundred</speak>"
    base = _run_espeak(VoiceSpec("en-us", "m3"), text, ssml=True)
    same = _run_espeak(VoiceSpec("en-us", "m3", edits=("pitch 80 122",)), text, ssml=True)
    np.testing.assert_array_equal(same, base)
    higher = _run_espeak(VoiceSpec("en-us", "m3", edits=("pitch 160 240",)), text, ssml=True)
    assert higher.shape != base.shape or np.abs(higher - base).max() > 0.1
    edits = random_voice_edits(np.random.default_rng(0))
    assert edits == random_voice_edits(np.random.default_rng(0))
    assert {line.split()[0] for line in edits} >= {"pitch", "consonants", "voicing"}
    assert len(synthesize_words(["seven", "hundred"], VoiceSpec("en-us", "m3", edits=edits))) == 2


@needs_espeak
@pytest.mark.parametrize("voice_edit_fraction", [0.0, 1.0])
def test_corpus_layout_and_exact_word_timings(tmp_path, voice_edit_fraction):
    spec = CorpusSpec(num_utterances=4, seed=5, augment_strength=0.0, max_words=5,
                      voice_edit_fraction=voice_edit_fraction)
    records = generate_corpus(os.fspath(tmp_path), spec)
    assert read_manifest(os.fspath(tmp_path)) == records
    for record in records:
        speaker, chapter, _ = record["id"].split("-")
        assert record["path"] == f"{speaker}/{chapter}/{record['id']}.flac"
        trans = (tmp_path / speaker / chapter / f"{speaker}-{chapter}.trans.txt").read_text().splitlines()
        assert f"{record['id']} {record['text'].upper()}" in trans
        audio, rate = soundfile.read(tmp_path / record["path"], dtype="float32")
        assert rate == 16000 and abs(audio.size / rate - record["duration"]) < 1e-3
        assert [w["word"] for w in record["words"]] == record["text"].split()
        # Without augmentation the gaps are digital silence and every word starts and ends with sound.
        inside = np.zeros(audio.size, bool)
        previous_end = 0.0
        for word in record["words"]:
            start, end = round(word["start"] * rate), round(word["end"] * rate)
            assert previous_end <= word["start"] < word["end"] <= record["duration"]
            previous_end = word["end"]
            inside[start - 2 : end + 2] = True  # timings are rounded to 0.1 ms
            assert np.abs(audio[start : start + 10]).max() > 0 and np.abs(audio[end - 10 : end]).max() > 0
        assert np.abs(audio[~inside]).max() < 1e-4  # FLAC is lossless; 16-bit rounding only
        assert record["voice"].split("+")[1] in TRAIN_VARIANTS
        assert bool(record.get("voice_edits")) == bool(voice_edit_fraction)


@needs_espeak
def test_held_out_corpus_uses_only_held_out_sentences_and_voices(tmp_path):
    spec = CorpusSpec(num_utterances=3, seed=1, held_out=True, max_words=4, voice_edit_fraction=1.0)
    records = generate_corpus(os.fspath(tmp_path), spec)
    for record in records:
        assert is_held_out_sentence(record["text"].split())
        assert record["voice"].split("+")[1] in HELD_OUT_VARIANTS
        assert "voice_edits" not in record  # held-out voices are the variants' own files


@needs_espeak
def test_synth_cli_writes_corpus_and_refuses_non_empty_output(tmp_path):
    from jaxstream.cli import main

    out = tmp_path / "corpus"
    assert main(["synth", os.fspath(out), "--num", "2", "--seed", "9", "--max-words", "3", "--workers", "1"]) == 0
    lines = (out / "manifest.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["words"] for line in lines)
    assert main(["synth", os.fspath(out), "--num", "2"]) == 2
    assert main(["synth", os.fspath(tmp_path / "other"), "--voice-edits", "1.5"]) == 2


def test_synth_cli_explains_an_espeak_ng_without_a_data_directory(tmp_path, monkeypatch, capsys):
    import subprocess

    from jaxstream.cli import main
    from jaxstream.synth import voices

    class Printed:
        stdout = "eSpeak NG text-to-speech: 1.51  (no data line)\n"

    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: Printed())
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    voices.system_data_dir.cache_clear()
    try:
        assert main(["synth", os.fspath(tmp_path / "out"), "--num", "1", "--voice-edits", "0.5"]) == 2
    finally:
        voices.system_data_dir.cache_clear()
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "voices/!v" in error and "no data line" in error
