"""SVOX Pico (the `ttspico` package: Pico's C engine and its voice data, Apache-2), a training engine whose
voices were as foreign to a model trained on espeak-ng and Festival as flite's (models/assets/tiny/MODEL_CARD.md):
two female HMM voices, en-US and en-GB, varied in speaking rate and pitch. Pico reports no word times;
`alignment.py` finds them from syntheses of the sentence's suffixes, so an n-word sentence costs n syntheses
(~20 ms each) and n - 1 alignments: ~0.1 s of CPU an utterance, about seven times an espeak-ng one."""
import dataclasses
import functools
import os

import numpy as np

from jaxstream.synth import alignment
from jaxstream.synth.engines import Spoken

PICO_VOICES = ("en-US", "en-GB")
PICO_NOT_INSTALLED = "SVOX Pico is not installed (pip install ttspico; it builds with a C compiler)"


@dataclasses.dataclass(frozen=True)
class PicoVoice:
    language: str = "en-US"
    rate: int = 100  # percent of the voice's speaking rate
    pitch: int = 100  # percent of its pitch

    def __post_init__(self):
        if self.language not in PICO_VOICES:
            raise ValueError(f"Pico voice must be one of {PICO_VOICES}, got {self.language!r}")


@functools.cache
def _engine(pid: int, language: str):
    del pid  # one per process and language: a forked worker must not share its parent's engine
    try:
        import ttspico
    except ImportError as error:
        raise RuntimeError(PICO_NOT_INSTALLED) from error
    return ttspico.TtsEngine(language)


def _speak(words: list[str], voice: PicoVoice) -> np.ndarray:
    """16 kHz float32: Pico writes 16-bit mono at the model's rate."""
    engine = _engine(os.getpid(), voice.language)
    engine.rate, engine.pitch = voice.rate, voice.pitch
    pcm = engine.speak(" ".join(words)) or b""
    return np.frombuffer(pcm, np.int16).astype(np.float32) / 32768.0


def speak_pico(words: list[str], voice: PicoVoice) -> Spoken | None:
    """`words` as one Pico sentence with each word's times; None when its suffixes do not align plausibly."""
    audio = _speak(words, voice)
    spans = alignment.word_spans_from_suffixes(words, lambda suffix: _speak(suffix, voice), audio)
    return None if spans is None else Spoken(audio, spans)
