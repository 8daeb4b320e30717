"""`jaxstream transcribe`: JSON lines per design.md through the engine, one-line errors for bad audio."""
import json
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
    for path, message in [(tmp_path / "missing.wav", "audio file not found"),
                          (not_audio, "unsupported or unreadable audio")]:
        assert cli.main(["transcribe", "--model", str(FIXTURE_MODEL), str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err and len(err.strip().splitlines()) == 1
    assert cli.main(["transcribe", str(not_audio), "--delay-ms", "100"]) == 2
    assert "--delay-ms 100" in capsys.readouterr().err
