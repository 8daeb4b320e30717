"""espeak-ng synthesis with exact word boundaries.

One espeak-ng call per sentence speaks the words separated by long SSML breaks; the breaks come out as
digital silence, so cutting at the long silent runs gives each word's audio exactly. The corpus then
joins the trimmed words with natural gaps of its own choosing, so every word's start and end is known to
the sample. Voices = an English accent (espeak-ng's `gmw` voices) + a voice variant (`!v` files) + speed
and pitch; some variants are reserved for held-out sets and never used in training.
"""
import contextlib
import dataclasses
import io
import subprocess

import numpy as np
import soundfile
import soxr

from jaxstream.models.audio import SAMPLING_RATE  # the corpus is written at the model's rate
from jaxstream.synth import voices

ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029",
           "en-us-nyc")
# Variants with a normal speaking voice (no whisper/robot/creak effects), male and female.
TRAIN_VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "klatt", "klatt2", "klatt3", "Alex",
    "Andy", "Annie", "adam", "anika", "announcer", "aunty", "belinda", "benjamin", "boris", "caleb", "david",
    "ed", "edward", "grandma", "iven", "iven2", "john", "linda", "max", "michel", "norbert", "paul", "pedro",
    "quincy", "rob", "robert", "shelby", "steph", "travis", "victor", "zac", "Lee", "Michael", "Mike", "Hugo",
)
HELD_OUT_VARIANTS = ("m8", "f5", "klatt4", "Alicia", "Gene", "steph2", "iven3", "Jacky", "marcelo", "antonio")

_BREAK_MS = 600
_SPLIT_SILENCE_S = 0.3  # longer than any silence inside one espeak word, shorter than the SSML break
_SILENCE_LEVEL = 1e-3


@dataclasses.dataclass(frozen=True)
class VoiceSpec:
    accent: str
    variant: str
    speed_wpm: int = 160
    pitch: int = 50
    edits: tuple[str, ...] = ()  # voice-file lines appended to the variant's (synth/voices.py)

    @property
    def name(self) -> str:
        return f"{self.accent}+{self.variant}"


def _run_espeak(voice: VoiceSpec, text: str, ssml: bool) -> np.ndarray:
    with contextlib.ExitStack() as stack:
        name, path = voice.name, []
        if voice.edits:
            name = f"{voice.accent}+{stack.enter_context(voices.edited_variant(voice.variant, voice.edits))}"
            path = [f"--path={voices.private_data_path()}"]
        command = ["espeak-ng", *path, "-v", name, "-s", str(voice.speed_wpm), "-p", str(voice.pitch), "--stdout"]
        if ssml:
            command.append("-m")
        try:
            wav = subprocess.run(command + [text], check=True, capture_output=True).stdout
        except FileNotFoundError as error:
            raise RuntimeError(voices.NOT_INSTALLED) from error
        except subprocess.CalledProcessError as error:
            message = error.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {error.returncode}"]
            raise RuntimeError(f"espeak-ng failed for voice {voice}: {message[0]}") from error
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return soxr.resample(audio, rate, SAMPLING_RATE).astype(np.float32)


def _voiced_runs(audio: np.ndarray, min_gap: int) -> list[tuple[int, int]]:
    """[start, end) sample ranges of sound, merging runs separated by less than `min_gap` silent samples."""
    loud = np.abs(audio) > _SILENCE_LEVEL
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loud.astype(np.int8), [0]])))
    runs: list[list[int]] = []
    for start, end in edges.reshape(-1, 2):
        if runs and start - runs[-1][1] < min_gap:
            runs[-1][1] = end
        else:
            runs.append([int(start), int(end)])
    return [(start, end) for start, end in runs]


def _trim(audio: np.ndarray) -> np.ndarray:
    runs = _voiced_runs(audio, len(audio) + 1)
    if not runs:
        return audio[:0]
    return audio[runs[0][0] : runs[-1][1]]


def synthesize_words(words: list[str], voice: VoiceSpec, break_ms: int = _BREAK_MS) -> list[np.ndarray]:
    """Each word's 16 kHz float32 audio, trimmed of leading and trailing silence, spoken by `voice`."""
    pause = f'<break time="{break_ms}ms"/>'
    audio = _run_espeak(voice, "<speak>" + pause.join(words) + "</speak>", ssml=True)
    runs = _voiced_runs(audio, int(_SPLIT_SILENCE_S * SAMPLING_RATE))
    if len(runs) == len(words):
        return [audio[start:end] for start, end in runs]
    # Rare: a word whose audio has a long internal silence, or one spoken as silence. Slower but exact.
    pieces = [_trim(_run_espeak(voice, word, ssml=False)) for word in words]
    return [piece if piece.size else np.zeros(SAMPLING_RATE // 20, np.float32) for piece in pieces]
