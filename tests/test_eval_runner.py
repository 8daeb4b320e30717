"""`jaxstream eval` end to end on espeak-ng speech, through the engine with the tiny Voxtral fixture model.

The fixture model's weights are random, so its transcripts are noise: the checks are on the plumbing —
the report's WER equals jiwer on the same normalized text, shards join into the full run, resume only runs
what is missing, a corrupt or missing file is reported while the others are transcribed.
"""
import dataclasses
import io
import json
import shutil
import subprocess
from pathlib import Path

import jiwer
import numpy as np
import pytest
import pytest_asyncio
import soundfile
import soxr
from whisper_normalizer.english import EnglishTextNormalizer

from jaxstream import cli
from jaxstream.evaluation import (
    Evaluation, RunOptions, load_report, merge_reports, read_corpus, run_evaluation, write_reports,
)
from jaxstream.models.audio import load_audio

FIXTURE_MODEL = Path(__file__).parent / "fixtures" / "voxtral_tiny"
SENTENCES = {  # id -> text; speakers 19 and 26 as in LibriSpeech ids
    "19-198-0000": "the cat sat on the mat",
    "19-198-0001": "seven green apples",
    "26-495-0000": "hello there my friend",
    "26-495-0001": "open the door please",
}
CORRUPT_ID, MISSING_ID = "26-495-0002", "26-495-0003"
ESPEAK_RATE = 22050
GAP_S = 0.12


def _speak(word: str) -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "--stdout", word], check=True, capture_output=True).stdout
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == ESPEAK_RATE
    return audio


@pytest.fixture(scope="module")
def speech_corpus(tmp_path_factory) -> Path:
    """A LibriSpeech-layout corpus (22.05 kHz flac, resampled on load) with a corrupt and a missing file,
    plus `words.jsonl`: the same utterances with word times (each word synthesized alone, then joined)."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is required (apt-get install espeak-ng)")
    root = tmp_path_factory.mktemp("speech")
    manifest, transcripts = [], {}
    for utterance_id, text in SENTENCES.items():
        speaker, chapter, _ = utterance_id.split("-")
        folder = root / speaker / chapter
        folder.mkdir(parents=True, exist_ok=True)
        pieces, words, cursor = [], [], GAP_S
        pieces.append(np.zeros(int(GAP_S * ESPEAK_RATE), np.float32))
        for word in text.split():
            audio = _speak(word)
            words.append({"word": word, "start": cursor, "end": cursor + audio.size / ESPEAK_RATE})
            cursor += audio.size / ESPEAK_RATE + GAP_S
            pieces += [audio, np.zeros(int(GAP_S * ESPEAK_RATE), np.float32)]
        soundfile.write(folder / f"{utterance_id}.flac", np.concatenate(pieces), ESPEAK_RATE)
        transcripts.setdefault(folder / f"{speaker}-{chapter}.trans.txt", []).append(f"{utterance_id} {text.upper()}")
        manifest.append({"id": utterance_id, "audio": f"{root.name}/{speaker}/{chapter}/{utterance_id}.flac",
                         "text": text, "speaker": speaker, "words": words})
    (root / "26" / "495" / f"{CORRUPT_ID}.flac").write_bytes(b"fLaC this is not audio" * 10)
    transcripts[root / "26" / "495" / "26-495.trans.txt"] += [f"{CORRUPT_ID} BROKEN FILE", f"{MISSING_ID} NO FILE"]
    for path, lines in transcripts.items():
        path.write_text("\n".join(lines) + "\n")
    (root.parent / f"{root.name}-words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in manifest))
    return root


def _words_manifest(root: Path) -> Path:
    return root.parent / f"{root.name}-words.jsonl"


def _eval(*args) -> int:
    return cli.main(["eval", "--model", str(FIXTURE_MODEL), *map(str, args)])


def test_eval_cli_report_matches_jiwer_and_lists_bad_audio(speech_corpus, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert _eval(speech_corpus, "--concurrency", 1, "--report", report_path) == 0
    report = json.loads(report_path.read_text())
    (run,) = report["runs"]
    assert report["complete"] and report["corpus"]["layout"] == "librispeech"
    errors = {error["id"]: error["error"] for error in run["errors"]}
    assert set(errors) == {CORRUPT_ID, MISSING_ID}
    assert "not found" in errors[MISSING_ID]
    done = [u for u in run["utterances"] if u["error"] is None]
    assert sorted(u["id"] for u in done) == sorted(SENTENCES)
    normalizer = EnglishTextNormalizer()  # the oracle: independent normalization of the raw texts
    references = [normalizer(SENTENCES[u["id"]].upper()) for u in done]
    hypotheses = [normalizer(u["hypothesis"]) for u in done]
    assert run["summary"]["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
    assert run["summary"]["cer"] == pytest.approx(jiwer.cer(references, hypotheses), abs=1e-12)
    for utterance in done:  # the audio duration after decoding + resampling to 16 kHz
        audio, rate = soundfile.read(utterance["audio"], dtype="float32")
        assert utterance["audio_seconds"] == pytest.approx(soxr.resample(audio, rate, 16000).size / 16000)
    assert run["rtfx"] == pytest.approx(run["summary"]["audio_seconds"] / run["wall_seconds"])
    assert set(run["speakers"]) == {"19", "26"}
    out = capsys.readouterr().out
    assert f"{100 * run['summary']['wer']:.2f}" in out
    assert report_path.with_suffix(".md").exists() and report_path.with_suffix(".csv").exists()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig

    engine = AsyncEngine.from_pretrained(str(FIXTURE_MODEL), config=EngineConfig(max_sessions=2))
    async with engine:
        yield engine


async def _evaluate(engine, corpus, *, delays=(None,), concurrency=2, realtime=False, limit=None, shard=None,
                    resume=None, save_to=None):
    evaluation = Evaluation(corpus, model=str(FIXTURE_MODEL), delays=list(delays),
                            options=RunOptions(concurrency=concurrency, realtime=realtime),
                            normalizer_name="english", limit=limit, shard=shard)
    if resume is not None:
        evaluation.resume_from(resume)
    save = None if save_to is None else (lambda state: write_reports(state.report(), save_to))
    await run_evaluation(evaluation, engine, load_audio=load_audio, progress=False, save=save, save_interval_s=0)
    return evaluation.report()


def _as_json(report: dict) -> dict:
    return json.loads(json.dumps(report))


def _hypotheses(report: dict) -> dict[str, str]:
    return {u["id"]: u["hypothesis"] for u in report["runs"][0]["utterances"]}


@pytest.mark.asyncio(loop_scope="module")
async def test_shards_join_into_the_full_run_and_resume_runs_only_the_rest(engine, speech_corpus, tmp_path):
    corpus = read_corpus(_words_manifest(speech_corpus))
    # One session at a time, so every stream runs in the same batch bucket and decodes identically.
    full = await _evaluate(engine, corpus, concurrency=1)
    assert full["runs"][0]["summary"]["transcribed"] == len(SENTENCES)
    shards = [await _evaluate(engine, corpus, concurrency=1, shard=(i, 2)) for i in range(2)]
    merged = merge_reports(shards)
    assert _hypotheses(merged) == _hypotheses(full)
    assert merged["runs"][0]["summary"]["wer"] == full["runs"][0]["summary"]["wer"]

    # A run stopped after two utterances leaves the report it wrote while running (as after a crash).
    saved_path = tmp_path / "partial.json"
    partial = _as_json(await _evaluate(engine, corpus, concurrency=1, limit=2, save_to=saved_path))
    saved = load_report(saved_path)
    before = {u["id"]: u for u in saved["runs"][0]["utterances"]}
    assert before and all(u in partial["runs"][0]["utterances"] for u in before.values())
    resumed = _as_json(await _evaluate(engine, corpus, concurrency=1, resume=saved))
    after = {u["id"]: u for u in resumed["runs"][0]["utterances"]}
    assert set(after) == set(SENTENCES) and resumed["complete"]
    for utterance_id, result in before.items():  # kept as they were: same wall-clock timings, not re-run
        assert after[utterance_id] == result
    assert _hypotheses(resumed) == _hypotheses(full)


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_delay_sweep(engine, speech_corpus):
    corpus = read_corpus(_words_manifest(speech_corpus))
    shortest = sorted(corpus.utterances, key=lambda u: u.words[-1].end)[:2]  # paced runs take real time
    corpus = dataclasses.replace(corpus, utterances=tuple(shortest))
    report = await _evaluate(engine, corpus, delays=(240, 480), concurrency=2, realtime=True)
    assert [run["delay_ms"] for run in report["runs"]] == [240, 480]
    for run in report["runs"]:
        assert run["summary"]["transcribed"] == 2
        assert run["streams"]["peak"] == 2 and run["streams"]["sustained"] is not None
        # Paced at real time: the run cannot end before the longest recording has been spoken.
        assert run["wall_seconds"] >= max(u["audio_seconds"] for u in run["utterances"])
        for utterance in run["utterances"]:
            assert utterance["finalize_ms"] is not None
            assert len(utterance["word_latencies_wall_ms"]) == len(utterance["word_latencies_ms"])
