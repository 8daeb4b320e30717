"""Synthetic corpus generation: LibriSpeech layout + a JSONL manifest with word timings.

Layout under OUT: `<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac` (16 kHz mono; 8 kHz for held-out
phone-line sets) with one `<speaker>-<chapter>.trans.txt` per chapter (lines `ID UPPERCASE TRANSCRIPT`), and
`manifest.jsonl` with one object per utterance: id, path (relative to OUT), text, words [{word, start, end}]
in seconds (empty for flite, whose sets are only scored), duration, voice, the voice's settings, and for
sentence corpora engine and telephone. Two kinds of text: word-list corpora (`text="words"`, the first
tiny model's: each word spoken alone by espeak-ng, so its boundaries are exact; speaker = variant, chapter =
accent) and sentence corpora (`text="sentences"`, `spoken.py`: the shipped model's). Every utterance's text,
voice, settings and augmentation are a pure function of (seed, index), so corpora can be generated in
parallel; the samples are not: libespeak-ng's output depends on what it spoke before in the same process
(calling espeak_Initialize again does not reset it), so --workers changes some espeak-ng utterances' audio
slightly.
"""
import dataclasses
import json
import multiprocessing
import os
from collections.abc import Iterator

import numpy as np
import soundfile

from jaxstream.synth import augment as augmentation
from jaxstream.synth import sentences, spoken, voices
from jaxstream.synth.espeak import (
    ACCENTS, HELD_OUT_VARIANTS, SAMPLING_RATE, TRAIN_VARIANTS, VoiceSpec, synthesize_words,
)
from jaxstream.synth.words import SentenceSampler

MANIFEST_NAME = "manifest.jsonl"


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    num_utterances: int
    seed: int = 0
    held_out: bool = False  # unseen sentences and voice variants
    min_words: int = 3
    max_words: int = 8
    augment_strength: float = 1.0
    speed_wpm: tuple[int, int] = (125, 200)
    pitch: tuple[int, int] = (25, 75)
    voice_edit_fraction: float = 0.5  # share of utterances with an edited variant (synth/voices.py); never held out
    # "words": random word sequences, each word spoken alone (the first tiny model's corpus); "sentences":
    # natural sentences spoken whole (synth/sentences.py, synth/spoken.py; the shipped model's corpus, and the
    # CLI's default); the fields below apply to these.
    text: str = "words"
    engines: tuple[tuple[str, float], ...] = (("espeak", 1.0),)  # (engine, share) of spoken.ENGINES
    telephone: float = 0.0  # share of utterances over a phone line (held-out ones written at 8 kHz)

    def __post_init__(self):
        if self.text not in ("words", "sentences"):
            raise ValueError(f"text must be 'words' or 'sentences', got {self.text!r}")
        unknown = [name for name, _ in self.engines if name not in spoken.ENGINES]
        if unknown or not self.engines or any(share <= 0 for _, share in self.engines):
            raise ValueError(f"engines must be (name, share > 0) pairs with names in {spoken.ENGINES}, "
                             f"got {self.engines}")
        if self.text == "words" and self.engines != (("espeak", 1.0),):
            raise ValueError("word-list corpora are espeak-ng only")
        if not self.held_out and "flite" in dict(self.engines):
            raise ValueError("flite is the held-out engine: training corpora never use it")
        if not 0.0 <= self.telephone <= 1.0:
            raise ValueError(f"telephone must be a share between 0 and 1, got {self.telephone}")

    @property
    def edits_voices(self) -> bool:
        return self.voice_edit_fraction > 0 and not self.held_out


_SAMPLER: SentenceSampler | None = None


def _sampler(spec: CorpusSpec) -> SentenceSampler:
    global _SAMPLER
    if _SAMPLER is None or (_SAMPLER.min_words, _SAMPLER.max_words) != (spec.min_words, spec.max_words):
        _SAMPLER = SentenceSampler(spec.min_words, spec.max_words)
    return _SAMPLER


def _speaker_chapter(spec: CorpusSpec, voice: VoiceSpec) -> tuple[int, int]:
    variants = HELD_OUT_VARIANTS if spec.held_out else TRAIN_VARIANTS
    speaker = variants.index(voice.variant) + (9000 if spec.held_out else 100)
    return speaker, ACCENTS.index(voice.accent)


def make_utterance(spec: CorpusSpec, index: int) -> tuple[dict, np.ndarray, int]:
    """The manifest record (path not set), audio and its sampling rate of utterance `index` of the corpus."""
    if spec.text == "sentences":
        return spoken.make_sentence_utterance(spec, index)
    rng = np.random.default_rng([spec.seed, index, int(spec.held_out)])
    variants = HELD_OUT_VARIANTS if spec.held_out else TRAIN_VARIANTS
    voice = VoiceSpec(
        accent=str(rng.choice(ACCENTS)), variant=str(rng.choice(variants)),
        speed_wpm=int(rng.integers(*spec.speed_wpm)), pitch=int(rng.integers(*spec.pitch)),
    )
    edit_rng = np.random.default_rng([spec.seed, index, int(spec.held_out), 1])  # keeps `rng`'s draws as they were
    if spec.edits_voices and edit_rng.random() < spec.voice_edit_fraction:
        voice = dataclasses.replace(voice, edits=voices.random_voice_edits(edit_rng))
    words = _sampler(spec).sample_split(rng, spec.held_out)
    pieces = synthesize_words(words, voice)
    gap_scale = float(rng.uniform(0.03, 0.2))
    cursor = int(rng.uniform(0.1, 0.6) * SAMPLING_RATE)
    chunks, timings = [np.zeros(cursor, np.float32)], []
    for word, piece in zip(words, pieces):
        timings.append((word, cursor, cursor + piece.size))
        gap = int(rng.exponential(gap_scale) * SAMPLING_RATE)
        chunks += [piece, np.zeros(gap, np.float32)]
        cursor += piece.size + gap
    chunks.append(np.zeros(int(rng.uniform(0.1, 0.4) * SAMPLING_RATE), np.float32))
    audio, speed = augmentation.augment(np.concatenate(chunks), rng, spec.augment_strength)
    speaker, chapter = _speaker_chapter(spec, voice)
    record = {
        "id": f"{speaker}-{chapter}-{index:05d}",
        "text": " ".join(words),
        "words": [{"word": w, "start": round(s / SAMPLING_RATE / speed, 4), "end": round(e / SAMPLING_RATE / speed, 4)}
                  for w, s, e in timings],
        "duration": round(audio.size / SAMPLING_RATE, 4),
        "voice": voice.name, "speed_wpm": voice.speed_wpm, "pitch": voice.pitch,
    }
    if voice.edits:
        record["voice_edits"] = list(voice.edits)
    return record, audio, SAMPLING_RATE


def _write_one(args: tuple[str, CorpusSpec, int]) -> dict:
    out_dir, spec, index = args
    record, audio, rate = make_utterance(spec, index)
    speaker, chapter, _ = record["id"].split("-")
    relative = os.path.join(speaker, chapter, record["id"] + ".flac")
    os.makedirs(os.path.join(out_dir, speaker, chapter), exist_ok=True)
    soundfile.write(os.path.join(out_dir, relative), np.clip(audio, -1.0, 1.0), rate, format="FLAC")
    return {"path": relative, **record}


def generate_corpus(out_dir: str, spec: CorpusSpec, *, workers: int = 1, progress: bool = False) -> list[dict]:
    """Writes the corpus under `out_dir`; returns the manifest records (sorted by id)."""
    os.makedirs(out_dir, exist_ok=True)
    jobs = [(out_dir, spec, index) for index in range(spec.num_utterances)]
    # Before forking, so that every worker shares them: one espeak-ng data folder for the edited variants
    # (and the library's voices), and the sentence pools (seconds to build).
    speaks_espeak = spec.text == "sentences" and bool({"espeak", "festival", "pico"} & set(dict(spec.engines)))
    if spec.edits_voices or speaks_espeak:
        voices.private_data_path()
    if spec.text == "sentences":
        sentences.sentence_pools()
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.imap_unordered(_write_one, jobs, chunksize=8)
            records = list(_progress(results, len(jobs), progress))
    else:
        records = list(_progress(map(_write_one, jobs), len(jobs), progress))
    records.sort(key=lambda r: r["id"])
    chapters: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        speaker, chapter, _ = record["id"].split("-")
        chapters.setdefault((speaker, chapter), []).append(record)
    for (speaker, chapter), members in chapters.items():
        with open(os.path.join(out_dir, speaker, chapter, f"{speaker}-{chapter}.trans.txt"), "w") as f:
            f.writelines(f"{r['id']} {r['text'].upper()}\n" for r in members)
    with open(os.path.join(out_dir, MANIFEST_NAME), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records


def _progress(items: Iterator, total: int, enabled: bool) -> Iterator:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, unit="utt", disable=None)  # None: a bar on a terminal, none into a pipe or file


def read_manifest(corpus_dir: str) -> list[dict]:
    path = os.path.join(corpus_dir, MANIFEST_NAME)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
