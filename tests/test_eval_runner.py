"""`jaxstream eval` end to end on espeak-ng speech, through the engine with the embedded `tiny` model.

The tiny model transcribes this speech (most words right, some wrong), so the checks are on real words:
the report's WER equals jiwer on the same normalized text, each word's emission latency equals (emission
position - reference word end) recomputed from the session's own events, shards join into the full run,
resume only runs what is missing, a corrupt or missing file is reported while the others are transcribed.
"""
import csv
import dataclasses
import io
import json
import os
import re
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

MODEL = "tiny"  # the embedded model (models/assets/tiny)
SLOT_S = 0.08  # one generated token per 80 ms of audio
SENTENCES = {  # id -> text; speakers 19 and 26 as in LibriSpeech ids
    "19-198-0000": "the cat sat on the mat",
    "19-198-0001": "seven green apples",
    "26-495-0000": "hello there my friend",
    "26-495-0001": "open the door please",
}
CORRUPT_ID, MISSING_ID = "26-495-0002", "26-495-0003"
ESPEAK_RATE = 22050
SAMPLING_RATE = 16000
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
    return cli.main(["eval", "--model", MODEL, *map(str, args)])


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
    assert all(u["hypothesis"].strip() for u in done)  # real words, some of them wrong
    words = run["summary"]["words"]
    assert words["reference"] == sum(len(text.split()) for text in SENTENCES.values())
    assert words["hits"] >= words["reference"] / 2
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


def test_eval_cli_names_its_manifest_says_why_utterances_failed_and_the_delay_used(tmp_path, capsys):
    """A folder with a CSV manifest (and `transcribe --json` hypotheses beside it, which must not be taken for
    references): eval says which file it read, lists each failed utterance with its reason on stderr, and its
    table and CSV show the delay the engine used (the model's default), not "default" or an empty cell."""
    sample = Path(__file__).resolve().parents[1] / "models" / "assets" / "samples" / "sample.wav"
    shutil.copy(sample, tmp_path / "sample.wav")
    reference = (sample.parent / "sample.txt").read_text().strip()
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(f"id,audio,text\nsample,sample.wav,{reference}\ngone,missing.wav,never spoken\n")
    (tmp_path / "out.jsonl").write_text(json.dumps({"file": "sample.wav", "text": "not the reference", "token_ids": [1],
                                                    "words": [], "audio_seconds": 3.5, "delay_ms": 480}) + "\n")
    report_path = tmp_path / "report.json"
    assert _eval(tmp_path, "--concurrency", 1, "--report", report_path) == 0
    captured = capsys.readouterr()
    assert f"manifest layout (detected), read from {manifest}" in captured.err
    assert "1 utterance(s) failed at 480 ms:\n  gone: " in captured.err
    failure = captured.err.split("  gone: ")[1].splitlines()[0]
    assert "missing.wav" in failure and "not found" in failure
    assert f"report: {report_path}, {tmp_path / 'report.md'}, {tmp_path / 'report.csv'}" in captured.err
    header, rule, row = captured.out.strip().splitlines()[:3]
    assert header.split()[:2] == ["delay", "ms"] and row.split()[:3] == ["480", "1", "1"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "report.csv").read_text())))
    assert [(r["id"], r["delay_ms"]) for r in rows] == [("gone", "480"), ("sample", "480")]
    (run,) = load_report(report_path)["runs"]
    # Scored against the manifest (the embedded model transcribes the sample exactly), not out.jsonl's text.
    assert run["delay_ms"] == 480 and run["summary"]["wer"] == 0


def _manifest(path: Path, texts: list[str]) -> Path:
    """A JSONL manifest of `texts`; its audio does not exist (the tests using it run no utterance)."""
    path.write_text("".join(json.dumps({"id": f"u{i}", "audio": f"u{i}.wav", "text": text}) + "\n"
                            for i, text in enumerate(texts)))
    return path


def test_an_empty_shard_is_an_empty_part_and_only_an_empty_selection_is_an_error(tmp_path, capsys):
    """`--shard 7/8` of 6 utterances once failed with "every selected utterance has an empty reference" (and
    hung the other processes under --shard auto)."""
    corpus = _manifest(tmp_path / "six.jsonl", [f"word {i}" for i in range(6)])
    for args, why in [(["--shard", "7/8"], "selects no utterance"), (["--limit", "2", "--shard", "2/3"],
                                                                      "selects no utterance")]:
        assert _eval(corpus, *args, "--report", tmp_path / "part.json") == 0
        assert f"shard {args[-1]} {why}: its part of the report is empty" in capsys.readouterr().err
        part = load_report(tmp_path / "part.json")
        (run,) = part["runs"]
        assert part["complete"] and run["complete"] and part["corpus"]["selected"] == 0
        assert run["summary"]["utterances"] == 0 and run["utterances"] == []

    mixed = _manifest(tmp_path / "mixed.jsonl", ["", "a word"])  # shard 0/2 holds only the empty reference
    assert _eval(mixed, "--shard", "0/2") == 0
    assert "shard 0/2 has only empty references: its part of the report is empty" in capsys.readouterr().err

    empty = _manifest(tmp_path / "empty.jsonl", ["", "[noise]", "ignore_time_segment_in_scoring"])
    for args in ([], ["--shard", "1/2"], ["--limit", "1", "--shard", "0/2"]):
        assert _eval(empty, *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("jaxstream eval: error: nothing to evaluate: the reference of every selected")
        assert not any("error" in line for line in err[:-1]), err


def test_a_resume_that_cannot_continue_its_report_says_what_to_pass(tmp_path, capsys):
    """`--resume` with another `--realtime` than the report's run said "cannot resume from reports with a different
    realtime: True vs False": each mismatch now names the flags the report was run with, to pass them again, or a
    new --report. Found before the model loads."""
    from jaxstream.evaluation import UtteranceResult
    from jaxstream.evaluation.metrics import score

    corpus = _manifest(tmp_path / "four.jsonl", [f"word {i}" for i in range(4)])
    report_path = tmp_path / "report.json"
    earlier = Evaluation(read_corpus(corpus), model=MODEL, delays=[480], options=RunOptions(),
                         normalizer_name="english", limit=3)
    for utterance in earlier.utterances:
        result = UtteranceResult(utterance.id, utterance.audio, utterance.text,
                                 reference_normalized=earlier.normalizer(utterance.text))
        score(result, utterance.text, earlier.normalizer)
        earlier.add(480, result)
    write_reports(earlier.report(), report_path)
    again = ["--delay-ms", "480", "--report", report_path, "--resume"]
    cannot = f"jaxstream eval: error: cannot resume {report_path}: the report was run"
    for flags, report_flags, run_flags in [
            (["--limit", "3", "--realtime"], "without --realtime", "with --realtime"),
            (["--limit", "3", "--normalizer", "basic", "--realtime"],
             "without --realtime and with --normalizer english", "with --realtime and with --normalizer basic"),
            (["--limit", "3", "--shard", "0/2"], "without --shard", "with --shard 0/2"),
            (["--limit", "3", "--quantization", "int8"], "without --quantization", "with --quantization int8"),
            (["--limit", "3", "--kv-cache-dtype", "fp8"], "without --kv-cache-dtype", "with --kv-cache-dtype fp8"),
            (["--limit", "2"], "with --limit 3", "with --limit 2")]:
        assert _eval(corpus, *flags, *again) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"{cannot} {report_flags}, this run {run_flags}: run {report_flags} to continue it, or give another "
            "--report PATH to start a new run")
    assert _eval(corpus, "--limit", "3", *again) == 0  # the same flags continue it (nothing is left to run)
    assert f"resuming {report_path}: 3 utterance results kept" in capsys.readouterr().err


def test_a_process_that_fails_hands_its_error_to_process_0(tmp_path, monkeypatch, capsys):
    """Under --shard auto process 0 waits for every part; a process that failed without sending one once left it
    waiting for a day."""
    from jaxstream import distributed
    from jaxstream.commands import eval as eval_command

    sent = []
    monkeypatch.setattr(distributed, "gather_json", lambda name, value: sent.append((name, value)))
    monkeypatch.setattr(distributed, "initialize", lambda args: distributed.ProcessGroup(1, 2))
    assert _eval(_manifest(tmp_path / "empty.jsonl", ["", "[noise]"]), "--shard", "auto") == 2
    message = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("jaxstream eval: error: ")
    assert message.startswith("nothing to evaluate") and sent == [("eval-report", {"error": message})]

    sent.clear()
    monkeypatch.setattr(eval_command, "_run", lambda *args: (_ for _ in ()).throw(RuntimeError("no device\nat all")))
    with pytest.raises(RuntimeError, match="no device"):
        _eval(_manifest(tmp_path / "two.jsonl", ["", "a word"]), "--shard", "auto")
    assert sent == [("eval-report", {"error": "RuntimeError: no device"})]

    monkeypatch.setattr(distributed, "initialize", lambda args: distributed.ProcessGroup(0, 2))  # process 0
    monkeypatch.setattr(distributed, "gather_json", lambda name, value: [value, {"error": "RuntimeError: no device"}])
    assert _eval(tmp_path / "two.jsonl", "--shard", "auto", "--report", tmp_path / "all.json") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("\njaxstream eval: error: 1 of 2 processes failed; process 1: RuntimeError: no device"), err
    assert (tmp_path / "all.part-0-of-2.json").exists() and not (tmp_path / "all.json").exists()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    from jaxstream.engine.async_engine import AsyncEngine
    from jaxstream.engine.config import EngineConfig

    engine = AsyncEngine.from_pretrained(MODEL, config=EngineConfig(max_sessions=2))
    async with engine:
        yield engine


async def _evaluate(engine, corpus, *, delays=(None,), concurrency=2, realtime=False, limit=None, shard=None,
                    resume=None, save_to=None):
    evaluation = Evaluation(corpus, model=MODEL, delays=list(delays),
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
    assert all(_hypotheses(full).values())
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
    fast = await _evaluate(engine, corpus, delays=(240, 480), concurrency=2)
    assert [run["delay_ms"] for run in report["runs"]] == [240, 480]
    for run, fast_run in zip(report["runs"], fast["runs"]):
        assert run["summary"]["transcribed"] == 2
        assert run["streams"]["peak"] == 2 and run["streams"]["sustained"] is not None
        # Paced at real time: the run cannot end before the longest recording has been spoken.
        assert run["wall_seconds"] >= max(u["audio_seconds"] for u in run["utterances"])
        assert sum(len(u["word_latencies_ms"]) for u in run["utterances"]) >= 4
        same_text = 0
        for utterance, fast_utterance in zip(run["utterances"], fast_run["utterances"]):
            assert utterance["finalize_ms"] is not None and utterance["first_token_ms"] is not None
            algorithmic, wall = utterance["word_latencies_ms"], utterance["word_latencies_wall_ms"]
            assert len(wall) == len(algorithmic)
            # A live listener cannot see a word before the audio it was emitted at has been spoken.
            assert all(w >= a - 1000 * SLOT_S for a, w in zip(algorithmic, wall)), (algorithmic, wall)
            # The algorithmic latency does not depend on how the audio was fed (one 80 ms step per dispatch
            # here, many per dispatch when it is all queued), for the same transcript (batch shapes differ,
            # so a near tie could in principle decode differently).
            if utterance["hypothesis"] == fast_utterance["hypothesis"]:
                same_text += 1
                assert algorithmic == pytest.approx(fast_utterance["word_latencies_ms"], abs=1e-6)
        assert same_text >= 1


class _RecordingEngine:
    """The engine as the runner sees it, keeping each transcription session's events and audio."""

    def __init__(self, engine):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.sessions: list[_RecordingSession] = []

    async def start_transcription(self, **kwargs):
        session = _RecordingSession(await self._engine.start_transcription(**kwargs))
        self.sessions.append(session)
        return session

    def find(self, delay_ms: int, audio_seconds: float) -> "_RecordingSession":
        (session,) = [s for s in self.sessions
                      if s.delay_ms == delay_ms and s.samples == round(audio_seconds * SAMPLING_RATE)]
        return session


class _RecordingSession:
    def __init__(self, session):
        self._session = session
        self.samples = 0
        self.events: list = []

    def __getattr__(self, name):
        return getattr(self._session, name)

    async def append(self, pcm):
        await self._session.append(pcm)
        self.samples += pcm.size

    def __aiter__(self):
        self._iterator = self._session.__aiter__()
        return self

    async def __anext__(self):
        event = await self._iterator.__anext__()
        self.events.append(event)
        return event


def _match_key(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def _expected_word_latencies(session: _RecordingSession, tokenizer, reference_words) -> list[float]:
    """Emission position of each hypothesis word's last character - its reference word's end (seconds),
    from the session's deltas: the n-th generated id was emitted at n * 80 ms + delay of audio (at most
    the recording); hypothesis words are paired with reference words by jiwer's word alignment (the one WER
    counts; on sentences, difflib's matching blocks can pair a different number of words)."""
    from jaxstream.engine.transcription_session import TranscriptionDelta

    duration = session.samples / SAMPLING_RATE
    deltas = [event for event in session.events if isinstance(event, TranscriptionDelta)]
    char_positions, generated = [], 0  # emission position of every non-space character, in order
    for delta in deltas:
        for token in delta.token_ids:
            generated += 1
            chars = sum(not c.isspace() for c in tokenizer.token_bytes(token).decode("utf-8", "replace"))
            char_positions += [min(generated * SLOT_S + session.delay_ms / 1000, duration)] * chars
    words = "".join(delta.text for delta in deltas).split()
    assert len(char_positions) == sum(map(len, words))  # ASCII text: one character per byte
    last_chars = np.cumsum([len(word) for word in words]) - 1
    emitted = [(_match_key(word), char_positions[i]) for word, i in zip(words, last_chars)]
    reference = [(_match_key(word.word), word.end) for word in reference_words]
    alignment = jiwer.process_words(" ".join(k for k, _ in reference), " ".join(k for k, _ in emitted)).alignments[0]
    return [emitted[chunk.hyp_start_idx + k][1] - reference[chunk.ref_start_idx + k][1]
            for chunk in alignment if chunk.type == "equal" for k in range(chunk.ref_end_idx - chunk.ref_start_idx)]


@pytest.fixture(scope="module")
def heldout_corpus(tmp_path_factory) -> Path:
    """Three utterances of `jaxstream synth`'s held-out set (sentences and voices the tiny model never
    heard), with the word times its manifest records."""
    from jaxstream.synth import CorpusSpec, generate_corpus, sentences

    if not sentences.wordnet_installed():
        pytest.skip("wordnet-base not installed (.ci/run installs it)")
    root = tmp_path_factory.mktemp("heldout")
    generate_corpus(os.fspath(root), CorpusSpec(num_utterances=3, seed=2024, held_out=True, text="sentences"))
    return root


@pytest.mark.asyncio(loop_scope="module")
async def test_word_latencies_are_emission_minus_word_end(engine, heldout_corpus):
    from jaxstream.engine.transcription_session import TranscriptionDone

    corpus = read_corpus(heldout_corpus)
    assert corpus.layout == "manifest" and all(u.words for u in corpus.utterances)
    references = {u.id: u for u in corpus.utterances}
    recorder = _RecordingEngine(engine)
    # Two sessions batched together, each fed all its audio at once: the engine runs several 80 ms steps
    # per dispatch and one delta carries all of them.
    report = await _evaluate(recorder, corpus, delays=(240, 480), concurrency=2)
    normalizer = EnglishTextNormalizer()
    for run in report["runs"]:
        delay_ms = run["delay_ms"]
        assert run["summary"]["transcribed"] == len(references)
        latencies, reference_texts, hypotheses = [], [], []
        for utterance in run["utterances"]:
            session = recorder.find(delay_ms, utterance["audio_seconds"])
            done = session.events[-1]
            assert isinstance(done, TranscriptionDone)
            assert utterance["hypothesis"] == done.text == "".join(e.text for e in session.events[:-1])
            reference_words = references[utterance["id"]].words
            expected = _expected_word_latencies(session, engine.tokenizer, reference_words)
            assert len(expected) >= 0.5 * len(reference_words), (utterance["hypothesis"], reference_words)
            assert utterance["word_latencies_ms"] == pytest.approx([1000 * v for v in expected], abs=1e-6)
            # After the word's end (the model writes it `delay` later), but not long after.
            assert all(0 < v < delay_ms + 500 for v in utterance["word_latencies_ms"]), utterance
            assert 0 < utterance["first_token_ms"] <= 1000 * run["wall_seconds"]
            latencies += utterance["word_latencies_ms"]
            reference_texts.append(normalizer(references[utterance["id"]].text))
            hypotheses.append(normalizer(done.text))
        summary = run["summary"]
        assert summary["wer"] == pytest.approx(jiwer.wer(reference_texts, hypotheses), abs=1e-12)
        assert summary["wer"] <= 0.5  # the embedded model: ~36 % on held-out sentences (its model card)
        emission = summary["latency"]["word_emission_ms"]
        assert emission["count"] == len(latencies)
        assert emission["mean"] == pytest.approx(np.mean(latencies))
        assert emission["max"] == pytest.approx(max(latencies))
        assert summary["latency"]["first_token_ms"]["count"] == len(references)


def test_eval_names_the_narrowband_files(tmp_path, capsys):
    """The engine said "narrowband input" once, naming no file (an eval of a wideband set with a few
    band-limited utterances read as if the whole set were phone audio); eval now names them, counted among
    the files it read, in its own warning style."""
    sample = Path(__file__).resolve().parents[1] / "models" / "assets" / "samples" / "sample.wav"
    shutil.copy(sample, tmp_path / "wide.wav")
    audio, rate = soundfile.read(sample, dtype="float32")
    soundfile.write(tmp_path / "call.wav", soxr.resample(audio, rate, 8000), 8000)
    for name in ("wide", "call"):
        shutil.copy(sample.with_suffix(".txt"), tmp_path / f"{name}.txt")
    assert _eval(tmp_path, "--concurrency", 1) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"jaxstream eval: warning: 1 of 2 files ({tmp_path / 'call.wav'}): narrowband input: the "
                        "audio is sampled at 8000 Hz; the model was trained on 16 kHz wideband speech and may "
                        "transcribe it less accurately"], warnings
