"""`jaxstream transcribe`: JSON lines per design.md through the engine, one-line errors for bad audio."""
import concurrent.futures
import json
import multiprocessing
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr

from jaxstream import cli

FIXTURE_MODEL = Path(__file__).parent / "fixtures" / "voxtral_tiny"


def _espeak(text: str, path: Path) -> None:
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)


def test_transcribe_json_lines(tmp_path, capsys):
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    first, second = tmp_path / "first.wav", tmp_path / "second.flac"
    _espeak("good morning", first)
    audio, rate = soundfile.read(first, dtype="float32")
    soundfile.write(second, np.concatenate([audio, audio]), rate)
    assert cli.main(["transcribe", "--model", str(FIXTURE_MODEL), "--delay-ms", "160", "--json", "--concurrency", "1",
                     str(first), str(second)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    tokenizer = Tekkenizer.from_file(str(FIXTURE_MODEL / "tekken.json"))
    for line, path in zip(lines, (first, second)):
        result = json.loads(line)
        assert set(result) == {"file", "text", "token_ids", "words", "audio_seconds", "delay_ms"}
        assert result["file"] == str(path) and result["delay_ms"] == 160
        audio, rate = soundfile.read(path, dtype="float32")
        assert result["audio_seconds"] == pytest.approx(soxr.resample(audio, rate, 16000).size / 16000)
        assert result["token_ids"] and all(isinstance(t, int) for t in result["token_ids"])
        # The text is the tokenizer's own decoding of the generated ids, special tokens dropped.
        decoded = tokenizer.decode(result["token_ids"], special_token_policy=SpecialTokenPolicy.IGNORE)
        assert " ".join(result["text"].split()) == " ".join(decoded.split())
        for word in result["words"]:
            assert set(word) == {"word", "start", "end"} and 0 <= word["start"] <= word["end"]


def test_transcribe_bad_audio_is_one_line_error(tmp_path, capsys):
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("this is not a wav file")
    # A header and no samples printed an empty transcript with exit 0 (the HTTP upload: "holds no samples").
    header_only = tmp_path / "zero.wav"
    soundfile.write(header_only, np.zeros(0, np.float32), 16000)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    for path, message in [(tmp_path / "missing.wav", "audio file not found"),
                          (not_audio, "unsupported or unreadable audio"),
                          (tmp_path, "is a directory, not an audio file"),
                          (header_only, f"audio file {header_only} holds no samples"),
                          (empty, f"audio file {empty} is empty (0 bytes)")]:
        assert cli.main(["transcribe", "--model", str(FIXTURE_MODEL), str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err and len(err.strip().splitlines()) == 1
        if path == not_audio:  # as the HTTP route says it: what this build can read instead
            assert "Format not recognised. Readable formats (libsndfile" in err and "WAV" in err, err
    assert cli.main(["transcribe", str(not_audio), "--delay-ms", "100"]) == 2
    assert "--delay-ms 100" in capsys.readouterr().err


def test_a_bad_file_in_a_batch_costs_only_itself(tmp_path, capsys):
    """`transcribe good.wav bad.wav good2.wav` checked every file first and exited 2 with no transcript at all. Each
    bad file is now its own line on stderr (one found before the model loads, one only when decoded: a NaN sample),
    the good ones are transcribed as they are alone, and the exit status says some files were not (1); when no
    file was, it is 2, as for one bad file given alone."""
    good, good2 = tmp_path / "good.wav", tmp_path / "good2.wav"
    _espeak("good morning", good)
    _espeak("see you later", good2)
    not_audio, nan = tmp_path / "bad.wav", tmp_path / "nan.wav"
    not_audio.write_text("this is not a wav file")
    samples, rate = soundfile.read(good, dtype="float32")
    samples[100] = np.nan
    soundfile.write(nan, samples, rate, subtype="FLOAT")
    model = ["transcribe", "--model", str(FIXTURE_MODEL), "--json", "--concurrency", "2"]  # one engine shape: cached
    assert cli.main([*model, str(good), str(good2)]) == 0
    alone = capsys.readouterr().out.splitlines()

    assert cli.main([*model, str(good), str(not_audio), str(nan), str(good2)]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == alone  # the same transcripts, in the order given
    errors = captured.err.splitlines()
    assert len(errors) == 3, errors
    assert errors[0].startswith("jaxstream transcribe: error: unsupported or unreadable audio") and str(not_audio) in \
        errors[0] and errors[0].endswith("(skipped)"), errors
    assert errors[1].startswith(f"jaxstream transcribe: error: unusable audio {nan}") and \
        errors[1].endswith("(skipped)"), errors
    assert errors[2] == "jaxstream transcribe: error: 2 of 4 files not transcribed"

    missing = tmp_path / "missing.wav"
    assert cli.main([*model, str(not_audio), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[1:] == [f"jaxstream transcribe: error: audio file not found: {missing} (skipped)",
                                             "jaxstream transcribe: error: 2 of 2 files not transcribed"]


def test_undecodable_audio_bytes_are_named_as_bytes_with_libsndfiles_reason(tmp_path):
    """An HTTP upload reaches load_audio as bytes: its error read "Error opening <_io.BytesIO object at
    0x...>". The reason must be the one the same bytes give as a file (libsndfile's), the name "<audio bytes>"."""
    from jaxstream.models.audio import AudioError, load_audio

    content = b"this is not a wav file"
    path = tmp_path / "notes.wav"
    path.write_bytes(content)
    with pytest.raises(AudioError) as from_file:
        load_audio(path)
    with pytest.raises(AudioError) as from_bytes:
        load_audio(content)
    assert str(from_bytes.value) == str(from_file.value).replace(str(path), "<audio bytes>")
    assert "BytesIO" not in str(from_bytes.value) and "Format not recognised" in str(from_bytes.value)


SAMPLE_DIR = Path(__file__).resolve().parents[1] / "models" / "assets" / "samples"
TINY_CONFIG = Path(__file__).resolve().parents[1] / "models" / "assets" / "tiny" / "jaxstream.json"
TIME_TOLERANCE_S = 0.3


def test_transcribe_tiny_model_words_and_timings(tmp_path, capsys):
    """The embedded model (the default) on its bundled sample and two held-out `jaxstream synth` utterances:
    the words are the transcript's, mostly the reference's, and each starts where the synthesizer put the
    reference word (its manifest's word times), give or take TIME_TOLERANCE_S."""
    import difflib

    import jiwer

    from jaxstream.synth import CorpusSpec, generate_corpus, sentences

    if not sentences.wordnet_installed():
        pytest.skip("wordnet-base not installed (.ci/run installs it)")
    # In a fresh process: libespeak-ng's audio depends on what it spoke before in the process, and other
    # tests in this worker may have used it (the same two utterances then came out differently).
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        records = fresh.submit(generate_corpus, str(tmp_path / "heldout"),
                               CorpusSpec(num_utterances=2, seed=2024, held_out=True, text="sentences")).result()
    sample = SAMPLE_DIR / "sample.wav"
    paths = [sample] + [tmp_path / "heldout" / record["path"] for record in records]
    assert cli.main(["transcribe", "--json", "--concurrency", "1", *map(str, paths)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(paths)
    results = [json.loads(line) for line in lines]
    default_delay_ms = json.loads(TINY_CONFIG.read_text())["config"]["default_delay_ms"]
    for result, path in zip(results, paths):
        assert result["file"] == str(path) and result["delay_ms"] == default_delay_ms
        info = soundfile.info(path)
        assert info.samplerate == 16000 and result["audio_seconds"] == pytest.approx(info.frames / 16000)
        words = result["words"]
        assert [w["word"] for w in words] == result["text"].split()
        previous_end = 0.0
        for word in words:  # in order, not overlapping, within the recording
            assert previous_end <= word["start"] <= word["end"] <= result["audio_seconds"], words
            previous_end = word["end"]
            # Milliseconds, as JSON shows them: 1.92, never 1.9200000000000002.
            assert all(repr(round(word[key], 3)) == repr(word[key]) for key in ("start", "end")), word

    # The sample: the model gets it exactly at every trained delay (README); one word of room.
    reference = (SAMPLE_DIR / "sample.txt").read_text().split()
    hypothesis = results[0]["text"].split()
    assert jiwer.wer(" ".join(reference), " ".join(hypothesis)) <= 1 / len(reference)

    for result, record in zip(results[1:], records):
        reference_words = record["words"]
        # The embedded model's WER on held-out sentences is ~36 % (its model card): this checks the word times
        # of the words it gets, and that it gets most of them.
        assert jiwer.wer(record["text"], result["text"]) <= 0.6, (record["text"], result["text"])
        matcher = difflib.SequenceMatcher(None, [w["word"] for w in reference_words],
                                          [w["word"] for w in result["words"]], autojunk=False)
        pairs = [(reference_words[block.a + k], result["words"][block.b + k])
                 for block in matcher.get_matching_blocks() for k in range(block.size)]
        assert len(pairs) >= 0.5 * len(reference_words)
        for expected, word in pairs:  # the delay is already taken off: times are of the audio
            assert expected["start"] - TIME_TOLERANCE_S <= word["start"] <= expected["end"] + TIME_TOLERANCE_S, \
                (expected, word)


def test_narrowband_audio_and_untrained_delay_are_said_once(tmp_path, capsys):
    """8 kHz files at a delay outside the embedded model's trained range: the untrained delay once for the whole
    run, and each narrowband file by name (models/audio_checks.py), as warnings in the command's style (they
    were `WARNING:jaxstream.engine.async_engine:...` lines naming no file); the transcripts still come."""
    audio, rate = soundfile.read(SAMPLE_DIR / "sample.wav", dtype="float32")
    paths = [tmp_path / "call-1.wav", tmp_path / "call-2.wav"]
    for path in paths:
        soundfile.write(path, soxr.resample(audio, rate, 8000), 8000)
    assert cli.main(["transcribe", "--delay-ms", "2400", "--concurrency", "1", *map(str, paths)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    warnings = captured.err.splitlines()
    narrowband = ("narrowband input: the audio is sampled at 8000 Hz; the model was trained on 16 kHz wideband "
                  "speech and may transcribe it less accurately")
    assert sorted(warnings) == sorted([
        "jaxstream transcribe: warning: delay 2400 ms is outside the delays this model was trained at (160-960 ms); "
        "expect a worse transcript",
        *(f"jaxstream transcribe: warning: {path}: {narrowband}" for path in paths)]), warnings
