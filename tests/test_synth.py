"""Synthetic corpus generator: number words, espeak-ng word boundaries, edited voices, layout, held-out split,
CLI; sentence corpora: espeak-ng / Festival / flite sentences and their word times, phone lines, microphone
bands and rooms, held-out sets. Festival and flite tests skip where they are not installed (CI has espeak-ng)."""
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import shutil

import numpy as np
import pytest
import soundfile

from jaxstream.evaluation.corpora import read_corpus
from jaxstream.synth import (
    HELD_OUT_VARIANTS, TRAIN_VARIANTS, CorpusSpec, SentenceSampler, VoiceSpec, generate_corpus,
    is_held_out_sentence, number_words, read_manifest, synthesize_words,
)
from jaxstream.synth.engines import Spoken
from jaxstream.synth.espeak import _run_espeak, _trim
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
    # `jaxstream eval` reads the voice as the speaker: its per-speaker WER is the model card's per-voice WER.
    by_id = {record["id"]: record["voice"] for record in records}
    assert {u.id: u.speaker for u in read_corpus(tmp_path).utterances} == by_id


@needs_espeak
def test_synth_cli_writes_corpus_and_refuses_non_empty_output(tmp_path, tiny_pools, capsys):
    """By default the corpus is of sentences, the shipped model's kind (the default was random word sequences);
    `--text words` still writes those."""
    from jaxstream.cli import main

    out = tmp_path / "corpus"
    assert main(["synth", os.fspath(out), "--num", "2", "--seed", "9", "--workers", "1"]) == 0
    assert "utt/s" not in capsys.readouterr().err  # no progress bar into a pipe or a file (pytest's capture)
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    training = {text for kind, texts in tiny_pools.items() if kind != "held-out" for text in texts}
    assert len(records) == 2 and all(r["words"] and r["text"] in training and r["engine"] == "espeak" for r in records)
    words = tmp_path / "words"
    assert main(["synth", os.fspath(words), "--num", "2", "--text", "words", "--max-words", "3", "--workers", "1"]) == 0
    records = [json.loads(line) for line in (words / "manifest.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["words"] and "engine" not in r for r in records)  # espeak-ng's words alone
    assert main(["synth", os.fspath(out), "--num", "2"]) == 2
    assert main(["synth", os.fspath(tmp_path / "other"), "--voice-edits", "1.5"]) == 2


@needs_espeak
def test_synth_cli_an_output_folder_it_cannot_make_is_one_line(tmp_path, tiny_pools, capsys):
    """It was a FileNotFoundError traceback from the corpus writer."""
    from jaxstream.cli import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out, reason in (("/proc/jaxstream-synth-test", "No such file or directory"),
                        (os.fspath(a_file / "corpus"), "Not a directory")):
        assert main(["synth", out, "--num", "1", "--workers", "1"]) == 2
        assert capsys.readouterr().err == f"jaxstream synth: error: cannot create the output folder {out}: {reason}\n"


@needs_espeak
def test_synth_without_sentence_sources_names_their_packages_and_the_word_list(tmp_path, monkeypatch, capsys):
    """Sentences are the default now: a machine without WordNet and fortunes hears what to install, or the flag
    that needs neither."""
    from jaxstream.cli import main
    from jaxstream.synth import sentences

    def not_installed():
        raise RuntimeError(sentences.NOT_INSTALLED)

    monkeypatch.setattr(sentences, "sentence_pools", not_installed)
    assert main(["synth", os.fspath(tmp_path / "x"), "--num", "1"]) == 2
    assert capsys.readouterr().err == (f"jaxstream synth: error: {sentences.NOT_INSTALLED}; or --text words, which "
                                       "needs none\n")
    assert not (tmp_path / "x").exists()


def test_synth_cli_explains_an_espeak_ng_without_a_data_directory(tmp_path, tiny_pools, monkeypatch, capsys):
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


# ---- sentence corpora (v2): engines, timings, phone lines, held-out sets ----

needs_festival = pytest.mark.skipif(shutil.which("festival") is None, reason="festival not installed")
needs_flite = pytest.mark.skipif(shutil.which("flite") is None, reason="flite not installed")


def _check_word_spans(spoken, num_words):
    """Timings against the audio itself: ordered, inside the audio, each word (or group of words spoken as
    one) holds sound, and no sound lies before the first word or after the last (the synthesizers emit
    digital silence there)."""
    audio, rate = spoken.audio, 16000
    assert len(spoken.words) == num_words
    level = 0.02 * np.abs(audio).max()
    previous = 0.0
    groups = [span for k, span in enumerate(spoken.words) if k == 0 or span != spoken.words[k - 1]]  # "in the"
    for start, end in groups:
        assert previous <= start + 1e-6 and start < end <= audio.size / rate + 1e-6
        previous = end
        assert np.abs(audio[int(start * rate) : int(end * rate)]).max() > level
    first, last = spoken.words[0][0], spoken.words[-1][1]
    assert np.abs(audio[: max(int(first * rate) - 160, 0)]).max(initial=0) < level  # 10 ms of slack
    assert np.abs(audio[int(last * rate) + 160 :]).max(initial=0) < level


@needs_espeak
def test_espeak_sentence_is_the_command_line_audio_with_word_times():
    from jaxstream.synth.engines import speak_espeak

    # Oracle for the audio: the espeak-ng command line speaking the same text in the same voice (m3 has no
    # random breath or flutter), both trimmed of silence.
    words = "please turn off the lights in the kitchen".split()
    voice = VoiceSpec("en-gb-x-rp", "m3", speed_wpm=150, pitch=45)
    # In a fresh process, as the command line's: libespeak-ng's output depends on what it spoke before in the
    # process (the same call twice differs), and other tests in this worker may have used it.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        spoken = fresh.submit(speak_espeak, words, voice).result()
    reference = _run_espeak(voice, " ".join(words), ssml=False)
    np.testing.assert_allclose(_trim(spoken.audio), _trim(reference), atol=1e-3)
    _check_word_spans(spoken, len(words))
    # "in the" is one espeak-ng word group: both words share its times; the others are distinct.
    assert len(set(spoken.words)) >= len(words) - 1
    # An edited variant reaches the library too (it reads the private data folder's voices).
    edited = speak_espeak(words, dataclasses.replace(voice, edits=("pitch 160 240",)))
    assert edited is not None
    size = min(edited.audio.size, spoken.audio.size)
    assert np.abs(edited.audio[:size] - spoken.audio[:size]).max() > 0.1


@needs_festival
def test_festival_sentence_word_times_and_possessives():
    from jaxstream.synth.engines import FestivalVoice, speak_festival

    words = "the book's cover was torn at nine o'clock".split()
    spoken = speak_festival(words, FestivalVoice(duration_stretch=1.1, f0_mean=140))
    assert spoken is not None
    _check_word_spans(spoken, len(words))
    slower = speak_festival(words, FestivalVoice(duration_stretch=1.4))
    assert slower.words[-1][1] > 1.15 * spoken.words[-1][1]


def test_flite_speakers_are_never_festival_training_voices():
    from jaxstream.synth.engines import FLITE_SPEAKER_VOICES, FestivalVoice

    for name in FLITE_SPEAKER_VOICES:
        with pytest.raises(ValueError, match="flite"):
            FestivalVoice(name=name)
    with pytest.raises(ValueError, match="held-out engine"):
        CorpusSpec(num_utterances=1, text="sentences", engines=(("espeak", 0.5), ("flite", 0.5)))


@needs_flite
def test_flite_speaks_each_held_out_voice():
    from jaxstream.synth.engines import FLITE_VOICES, speak_flite

    for voice in FLITE_VOICES:
        audio = speak_flite("turn off the lights", voice)
        assert audio.dtype == np.float32 and 0.5 < audio.size / 16000 < 3 and np.abs(audio).max() > 0.05


def _tone(hz, seconds=1.0, rate=16000):
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _amplitude(audio, hz, rate=16000):
    """The amplitude of the `hz` component (oracle: the DFT at that bin, away from the edges)."""
    middle = audio[rate // 4 : -rate // 4]
    bins = np.fft.rfft(middle * np.hanning(middle.size))
    freqs = np.fft.rfftfreq(middle.size, 1 / rate)
    return 2 * np.abs(bins[np.argmin(np.abs(freqs - hz))]) / np.hanning(middle.size).sum()


def test_telephone_keeps_the_voice_band_only():
    from jaxstream.synth import augment

    rng = np.random.default_rng(0)
    for hz, passes in ((1000, True), (2500, True), (100, False), (5000, False), (7000, False)):
        line = augment.telephone(_tone(hz), np.random.default_rng(1))
        assert line.size == 16000
        ratio = _amplitude(line, hz) / max(_amplitude(augment.telephone(_tone(1000), np.random.default_rng(1)), 1000),
                                           1e-9)
        assert (ratio > 0.7) if passes else (ratio < 0.05), (hz, ratio)
    narrow = augment.telephone(_tone(1000), rng, at_8khz=True)
    assert narrow.size == 8000 and narrow.dtype == np.float32


def test_mu_law_has_256_levels_and_relative_error():
    from jaxstream.synth.augment import mu_law

    signal = np.linspace(-1, 1, 100001).astype(np.float32)
    coded = mu_law(signal)
    assert len(np.unique(coded)) <= 256
    loud = np.abs(signal) > 0.05
    assert np.max(np.abs(coded - signal)[loud] / np.abs(signal)[loud]) < 0.07  # companding: relative steps


def test_band_limit_and_room_response():
    from jaxstream.synth import augment

    limited = augment.band_limit(_tone(200) + _tone(2000) + _tone(7500), 300, 4000)
    assert _amplitude(limited, 2000) > 0.45 and _amplitude(limited, 200) < 0.25 and _amplitude(limited, 7500) < 0.01
    rng = np.random.default_rng(3)
    response = augment.room_impulse_response(rng, rt60_s=0.4)
    assert response.size == 6400 and np.argmax(np.abs(response)) == 0
    assert np.sum(response[3200:] ** 2) < np.sum(response[:3200] ** 2)  # it decays
    audio = rng.standard_normal(5000).astype(np.float32)
    np.testing.assert_allclose(augment.convolve(audio, response), np.convolve(audio, response)[:5000], atol=1e-4)


@pytest.fixture
def tiny_pools(monkeypatch):
    """Sentence pools without the Debian packages (CI): a handful of sentences per kind."""
    from jaxstream.synth import sentences

    pools = {"examples": ("the cat sat on the mat", "she fed three cats every day"),
             "definitions": ("a member of the genus canis",), "fortunes": ("never eat more than you can lift",),
             "held-out": ("look before you leap", "she walked quietly into the room",
                          "a penny saved is a penny earned")}
    monkeypatch.setattr(sentences, "sentence_pools", lambda: pools)
    monkeypatch.setattr(sentences, "_held_out_set", lambda: frozenset(pools["held-out"]))
    return pools


@needs_espeak
def test_sentence_corpus_timings_follow_the_audio(tmp_path, tiny_pools):
    spec = CorpusSpec(num_utterances=3, seed=4, text="sentences", augment_strength=0.0, voice_edit_fraction=0.0)
    records = generate_corpus(os.fspath(tmp_path), spec)
    for record in records:
        audio, rate = soundfile.read(tmp_path / record["path"], dtype="float32")
        assert rate == 16000 and record["engine"] == "espeak"
        assert [w["word"] for w in record["words"]] == record["text"].split()
        spans = [(w["start"], w["end"]) for w in record["words"]]
        _check_word_spans(Spoken(audio, spans), len(spans))
        assert record["voice"].split("+")[1] not in HELD_OUT_VARIANTS


@needs_espeak
def test_held_out_sets_share_sentences_and_the_phone_set_is_8khz(tmp_path, tiny_pools):
    plain = generate_corpus(os.fspath(tmp_path / "a"), CorpusSpec(3, seed=1, held_out=True, text="sentences"))
    phone = generate_corpus(os.fspath(tmp_path / "c"), CorpusSpec(3, seed=1, held_out=True, text="sentences",
                                                                  telephone=1.0))
    assert sorted(r["text"] for r in plain) == sorted(tiny_pools["held-out"])
    assert [(r["id"], r["text"], r["voice"]) for r in plain] == [(r["id"], r["text"], r["voice"]) for r in phone]
    for record in phone:
        assert record["telephone"] and soundfile.info(tmp_path / "c" / record["path"]).samplerate == 8000
        assert record["voice"].split("+")[1] in HELD_OUT_VARIANTS
    if shutil.which("flite"):
        flite = generate_corpus(os.fspath(tmp_path / "b"), CorpusSpec(3, seed=1, held_out=True, text="sentences",
                                                                      engines=(("flite", 1.0),)))
        assert sorted(r["text"] for r in flite) == sorted(r["text"] for r in plain)
        assert all(r["engine"] == "flite" and r["words"] == [] for r in flite)


@needs_espeak
def test_synth_cli_sentence_options(tmp_path, tiny_pools, capsys):
    from jaxstream.cli import main

    assert main(["synth", os.fspath(tmp_path / "x"), "--text", "sentences", "--engines", "flite"]) == 2
    assert main(["synth", os.fspath(tmp_path / "x"), "--text", "sentences", "--engines", "espeak:0"]) == 2
    assert main(["synth", os.fspath(tmp_path / "x"), "--text", "sentences", "--engines", "mbrola"]) == 2
    assert main(["synth", os.fspath(tmp_path / "x"), "--text", "words", "--telephone", "0.5"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert "flite is the held-out engine" in errors[0] and "share must be positive" in errors[1]
    out = tmp_path / "phone"
    assert main(["synth", os.fspath(out), "--num", "2", "--text", "sentences", "--held-out", "--telephone", "1",
                 "--workers", "1"]) == 0
    assert all(json.loads(line)["telephone"] for line in (out / "manifest.jsonl").read_text().splitlines())


@needs_espeak
def test_joined_streams_are_the_utterances_back_to_back(tmp_path, tiny_pools):
    from jaxstream.synth.long_streams import join_corpus

    plain = generate_corpus(os.fspath(tmp_path / "plain"), CorpusSpec(6, seed=4, held_out=True, text="sentences"))
    streams = join_corpus(os.fspath(tmp_path / "plain"), plain, os.fspath(tmp_path / "long"), 8.0)
    assert read_manifest(os.fspath(tmp_path / "long")) == streams
    # Oracle: the utterances' own files and word times. Streams are the utterances in order, each stream within
    # 8 s unless one utterance alone is longer, its words the utterances' shifted by the audio before them.
    assert [u for stream in streams for u in stream["utterances"]] == [r["id"] for r in plain]
    assert 1 < len(streams) < len(plain)
    by_id = {r["id"]: r for r in plain}
    for stream in streams:
        members = [by_id[u] for u in stream["utterances"]]
        assert stream["text"] == " ".join(r["text"] for r in members)
        assert sum(r["duration"] for r in members) <= 8 or len(members) == 1
        audios = [soundfile.read(tmp_path / "plain" / r["path"], dtype="float32")[0] for r in members]
        joined, rate = soundfile.read(tmp_path / "long" / stream["path"], dtype="float32")
        np.testing.assert_array_equal(joined, np.concatenate(audios))
        offsets = np.cumsum([0] + [a.size for a in audios])[:-1] / rate
        expected = [(w["word"], round(w["start"] + t, 4), round(w["end"] + t, 4))
                    for r, t in zip(members, offsets) for w in r["words"]]
        assert [(w["word"], w["start"], w["end"]) for w in stream["words"]] == expected
    corpus = read_corpus(tmp_path / "long")  # what `jaxstream eval` reads
    assert corpus.layout == "manifest" and [u.text for u in corpus.utterances] == [s["text"] for s in streams]


@needs_espeak
def test_synth_cli_join_seconds_writes_a_long_stream_set_of_held_out_sentences(tmp_path, tiny_pools, capsys):
    from jaxstream.cli import main

    assert main(["synth", os.fspath(tmp_path / "long"), "--num", "4", "--seed", "4", "--held-out", "--workers", "1",
                 "--join-seconds", "8"]) == 0
    assert capsys.readouterr().out.strip().startswith("wrote ")
    assert sorted(p.name for p in (tmp_path / "long").iterdir()) == ["manifest.jsonl", "streams"]
    assert not [p for p in tmp_path.iterdir() if p.name != "long"]  # the utterances' folder is gone
    streams = read_manifest(os.fspath(tmp_path / "long"))
    from jaxstream.synth.sentences import held_out_sentence

    assert sorted(int(u.split("-")[2]) for stream in streams for u in stream["utterances"]) == [0, 1, 2, 3]
    for stream in streams:  # each utterance's held-out sentence (seed 4, its index), in the stream's order
        assert stream["text"] == " ".join(held_out_sentence(4, int(u.split("-")[2])) for u in stream["utterances"])
    assert all(int(u.split("-")[0]) >= 9000 for stream in streams for u in stream["utterances"])  # held-out voices
    for argv, message in ((["--join-seconds", "8"], "use it with --held-out"),
                          (["--held-out", "--join-seconds", "0"], "--join-seconds must be a positive number"),
                          (["--held-out", "--join-seconds", "8", "--telephone", "0.5"], "needs --telephone 0 or 1")):
        assert main(["synth", os.fspath(tmp_path / "x"), "--num", "1", *argv]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("option, message", [
    (["--engines", "espeak:nan"], "the share must be positive and finite"),
    (["--engines", "espeak:inf"], "the share must be positive and finite"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    (["--augment", "20"], "--augment must be between 0 and 5, got 20.0"),
    (["--augment", "nan"], "--augment must be between 0 and 5, got nan"),
    (["--augment", "-1"], "--augment must be between 0 and 5, got -1.0"),
    # Accepted and ignored: the sentence corpora speak whole sentences.
    (["--text", "sentences", "--min-words", "3"], "--min-words applies to --text words only"),
    (["--text", "sentences", "--min-words", "2", "--max-words", "4"],
     "--min-words and --max-words apply to --text words only"),
    (["--text", "words", "--max-words", "2"], "need 1 <= --min-words <= --max-words, got 3 and 2"),  # default min
    (["--max-words", "5"], "--max-words applies to --text words only: --text sentences (the default) speaks"),
])
def test_synth_cli_refuses_bad_numbers(tmp_path, capsys, option, message):
    from jaxstream.cli import main

    engines = ["--text", "sentences"] if option[0] == "--engines" else []
    assert main(["synth", os.fspath(tmp_path / "x"), "--num", "1", *engines, *option]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error
    assert not (tmp_path / "x").exists()


def test_the_strongest_augmentation_keeps_a_positive_speed():
    from jaxstream.synth.augment import MAX_STRENGTH, augment, augment_sentence

    rng = np.random.default_rng(0)
    audio = 0.1 * rng.standard_normal(4000).astype(np.float32)
    for _ in range(20):
        assert augment(audio, rng, MAX_STRENGTH)[1] > 0
        assert augment_sentence(audio, rng, MAX_STRENGTH, speed_range=0.15)[1] > 0


@needs_festival
def test_a_missing_festival_voice_is_an_error_not_festivals_default(tmp_path, monkeypatch, capsys):
    """Without festvox-kdlpc16k Festival falls back to kal_diphone, a flite speaker: it must never be spoken."""
    from jaxstream.cli import main
    from jaxstream.errors import UserError
    from jaxstream.synth import engines

    with pytest.raises(UserError, match="no voice nosuch_voice .*festvox-kdlpc16k"):
        engines.speak_festival(["hello"], engines.FestivalVoice(name="nosuch_voice"))
    engines.check_festival_voices()  # the installed training voice loads
    monkeypatch.setattr(engines, "FESTIVAL_VOICES", ("nosuch_voice",))
    assert main(["synth", os.fspath(tmp_path / "x"), "--num", "1", "--text", "sentences", "--engines",
                 "festival"]) == 2
    assert "Festival has no voice nosuch_voice" in capsys.readouterr().err
