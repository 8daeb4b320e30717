"""One utterance of a sentence corpus (`CorpusSpec(text="sentences")`): a natural sentence (`sentences.py`)
spoken whole by espeak-ng, Festival or SVOX Pico (flite for held-out sets), with each word's start and end,
passed through a room, a microphone, noise and, for some, a phone line (`augment.py`).

Voices: training espeak-ng utterances use every English accent and every voice variant except the held-out
ones and the effect voices (robot, whisper, demonic...), half of them with edited voice files; Festival
speaks with `engines.FESTIVAL_VOICES`, varied in speaking rate, pitch and (through tape-style speed) vocal
tract length; Pico speaks with `pico.PICO_VOICES`, varied the same way. Held-out espeak-ng sets use only
`espeak.HELD_OUT_VARIANTS`; flite sets use flite's voices.
"""
import dataclasses

import numpy as np

from jaxstream.synth import augment as augmentation
from jaxstream.synth import engines, pico, sentences, voices
from jaxstream.synth.espeak import (
    ACCENTS, HELD_OUT_VARIANTS, SAMPLING_RATE, TRAIN_VARIANTS, VoiceSpec, synthesize_words,
)

# Variants beyond the word corpora's 50: everything espeak-ng ships except the held-out variants, Gene2 (the
# held-out Gene's file with another pitch) and the effect voices. Like the word corpora's klatt..klatt3 and
# iven, klatt5, klatt6 and iven4 differ from the held-out klatt4 and iven3 in one setting only (the Klatt
# mode; voicing or spectral tilt): per-voice WER on those two is not an unseen-voice measure.
EXTRA_TRAIN_VARIANTS = (
    "Andrea", "AnxiousAndy", "Denis", "Diogo", "Henrique", "Marco", "Mario", "Nguyen", "RicishayMax",
    "RicishayMax2", "RicishayMax3", "Storm", "Tweaky", "edward2", "grandpa", "gustave", "iven4", "kaukovalta",
    "klatt5", "klatt6", "miguel", "pablo", "sandro", "steph3",
)
SENTENCE_TRAIN_VARIANTS = TRAIN_VARIANTS + EXTRA_TRAIN_VARIANTS
ENGINES = ("espeak", "festival", "pico", "flite")


def speaker_chapter(engine: str, voice: str, held_out: bool) -> tuple[int, int]:
    """LibriSpeech speaker and chapter ids: one speaker per voice (variant, Festival or flite voice), the
    chapter is the espeak-ng accent."""
    if engine == "flite":
        return 9500 + engines.FLITE_VOICES.index(voice), 0
    if engine == "festival":
        return 7000 + engines.FESTIVAL_VOICES.index(voice), 0
    if engine == "pico":
        return 7100 + pico.PICO_VOICES.index(voice), 0
    accent, variant = voice.split("+")
    if held_out:
        return 9000 + HELD_OUT_VARIANTS.index(variant), ACCENTS.index(accent)
    return 100 + SENTENCE_TRAIN_VARIANTS.index(variant), ACCENTS.index(accent)


def _draw_engine(spec, rng: np.random.Generator) -> str:
    names = [name for name, _ in spec.engines]
    weights = np.array([weight for _, weight in spec.engines], np.float64)
    return names[int(rng.choice(len(names), p=weights / weights.sum()))] if len(names) > 1 else names[0]


def _espeak(spec, rng: np.random.Generator, edit_rng: np.random.Generator, words: list[str]):
    variants = HELD_OUT_VARIANTS if spec.held_out else SENTENCE_TRAIN_VARIANTS
    voice = VoiceSpec(accent=str(rng.choice(ACCENTS)), variant=str(rng.choice(variants)),
                      speed_wpm=int(rng.integers(*spec.speed_wpm)), pitch=int(rng.integers(*spec.pitch)))
    if spec.edits_voices and edit_rng.random() < spec.voice_edit_fraction:
        voice = dataclasses.replace(voice, edits=voices.random_voice_edits(edit_rng))
    spoken = engines.speak_espeak(words, voice)
    if spoken is None:  # rare: espeak-ng's word events did not line up; speak the words one by one instead
        pieces = synthesize_words(words, voice)
        gap = int(0.06 * SAMPLING_RATE)
        cursor, spans, chunks = 0, [], []
        for piece in pieces:
            spans.append((cursor / SAMPLING_RATE, (cursor + piece.size) / SAMPLING_RATE))
            chunks += [piece, np.zeros(gap, np.float32)]
            cursor += piece.size + gap
        spoken = engines.Spoken(np.concatenate(chunks), spans)
    details = {"speed_wpm": voice.speed_wpm, "pitch": voice.pitch}
    if voice.edits:
        details["voice_edits"] = list(voice.edits)
    return spoken, voice.name, details


def _festival(rng: np.random.Generator, words: list[str]):
    voice = engines.FestivalVoice(name=str(rng.choice(engines.FESTIVAL_VOICES)),
                                  duration_stretch=round(float(rng.uniform(0.8, 1.3)), 3),
                                  f0_mean=int(rng.integers(70, 200)), f0_std=int(rng.integers(8, 35)))
    details = {"duration_stretch": voice.duration_stretch, "f0_mean": voice.f0_mean, "f0_std": voice.f0_std}
    return engines.speak_festival(words, voice), voice.name, details


def _pico(rng: np.random.Generator, words: list[str]):
    # Pitch down to 60 %: its two voices are female, and a lower one reaches male range (tape speed below
    # moves the formants too).
    voice = pico.PicoVoice(language=str(rng.choice(pico.PICO_VOICES)), rate=int(rng.integers(75, 131)),
                           pitch=int(rng.integers(60, 131)))
    return pico.speak_pico(words, voice), voice.language, {"rate_percent": voice.rate, "pitch_percent": voice.pitch}


def make_sentence_utterance(spec, index: int) -> tuple[dict, np.ndarray, int]:
    """(manifest record without path, audio, its sampling rate) of sentence utterance `index`. A held-out
    sentence depends only on (seed, index), so held-out sets that differ only in engine or phone line hold
    the same sentences; a phone line's draws come from their own stream, so a `telephone` set is its plain
    twin over a phone line."""
    rng = np.random.default_rng([spec.seed, index, int(spec.held_out), 3])
    edit_rng = np.random.default_rng([spec.seed, index, int(spec.held_out), 1])
    line_rng = np.random.default_rng([spec.seed, index, int(spec.held_out), 2])
    text = sentences.held_out_sentence(spec.seed, index) if spec.held_out else sentences.training_sentence(rng)
    words = text.split()
    engine = _draw_engine(spec, rng)
    spoken, voice, details = None, "", {}
    if engine == "flite":
        voice = str(rng.choice(engines.FLITE_VOICES))
        spoken = engines.Spoken(engines.speak_flite(text, voice), [])
    elif engine in ("festival", "pico"):
        spoken, voice, details = (_festival if engine == "festival" else _pico)(rng, words)
        # Festival split a word its own way, or Pico's words did not align: espeak-ng speaks it instead.
        engine = engine if spoken is not None else "espeak"
    if spoken is None:
        spoken, voice, details = _espeak(spec, rng, edit_rng, words)
    lead = np.zeros(int(rng.uniform(0.1, 0.6) * SAMPLING_RATE), np.float32)
    tail = np.zeros(int(rng.uniform(0.1, 0.4) * SAMPLING_RATE), np.float32)
    audio = np.concatenate([lead, spoken.audio, tail])
    # One Festival voice, two Pico ones: stretch them further.
    speed_range = 0.15 if engine in ("festival", "pico") else 0.1
    audio, speed = augmentation.augment_sentence(audio, rng, spec.augment_strength, speed_range)
    offset = lead.size / SAMPLING_RATE
    record = {
        "text": text,
        "words": [{"word": word, "start": round((start + offset) / speed, 4), "end": round((end + offset) / speed, 4)}
                  for word, (start, end) in zip(words, spoken.words)],
        "engine": engine, "voice": voice, **details,
    }
    rate = SAMPLING_RATE
    if line_rng.random() < spec.telephone:
        # Held-out phone sets are written at 8 kHz, as a phone recording would reach a user; training
        # examples stay at 16 kHz (the training loader reads 16 kHz only).
        audio = augmentation.telephone(audio, line_rng, at_8khz=spec.held_out)
        rate = augmentation.TELEPHONE_RATE if spec.held_out else SAMPLING_RATE
        record["telephone"] = True
    record["duration"] = round(audio.size / rate, 4)
    speaker, chapter = speaker_chapter(engine, voice, spec.held_out)
    record = {"id": f"{speaker}-{chapter}-{index:05d}", **record}
    return record, audio, rate
