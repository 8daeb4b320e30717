"""Whole sentences spoken with natural prosody by three engines, with each word's start and end time.

- espeak-ng, through its C library (libespeak-ng.so.1, ctypes): the synthesis callback reports a WORD event
  at the sample where each word starts. espeak-ng sometimes speaks two words as one ("in the"): the words of
  such a group share its times. A word ends where the next group starts, less the silence before it (a
  pause or a stop's closure belongs to no word).
- Festival (`festival`, one long-lived process per worker, read through a pipe): its Segment relation holds
  every phone's end time; a word spans its syllables' phones.
- flite (`flite`): the held-out engine. Only audio: its sets are scored on their text, never trained on.

Voices: espeak-ng's English accents x voice variants (`espeak.py`, edited ones from `voices.py`); Festival's
`ked_diphone` (festvox-kdlpc16k), the one Debian English voice not built from a flite speaker, varied in
speed and pitch; flite's kal16, slt, rms and awb, never used for training.
"""
import atexit
import contextlib
import ctypes
import dataclasses
import functools
import os
import subprocess
import tempfile

import numpy as np
import soundfile
import soxr

from jaxstream.errors import UserError
from jaxstream.synth import voices
from jaxstream.synth.alignment import SILENCE_LEVEL
from jaxstream.synth.espeak import SAMPLING_RATE, VoiceSpec

FESTIVAL_VOICES = ("ked_diphone",)
FLITE_VOICES = ("kal16", "slt", "rms", "awb")
# Festival voices built from flite's speakers: never used, so flite stays an unseen engine and speaker.
FLITE_SPEAKER_VOICES = ("kal_diphone", "cmu_us_slt_arctic_hts", "cmu_us_kal_com_hts", "cmu_us_rms_arctic_hts",
                        "cmu_us_awb_arctic_hts")
# The library selects voices by name or file, not by language as the espeak-ng command does: en-gb's file is "en".
_ACCENT_VOICES = {"en-gb": "en"}
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_EVENT_WORD, _EVENT_END = 1, 0
_PARAM_RATE, _PARAM_PITCH = 1, 3


@dataclasses.dataclass(frozen=True)
class Spoken:
    audio: np.ndarray  # 16 kHz float32
    words: list[tuple[float, float]]  # (start, end) seconds of each word


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


class _EspeakLibrary:
    """libespeak-ng in synchronous mode, initialised on the private data path (so edited variants load)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libespeak-ng.so.1")
        except OSError as error:
            raise RuntimeError(voices.NOT_INSTALLED) from error
        root = voices.private_data_path().encode()
        self.rate = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, root, 0)
        if self.rate <= 0:
            raise RuntimeError(f"libespeak-ng failed to initialise (data path {root.decode()})")
        self.chunks: list[np.ndarray] = []
        self.events: list[tuple[int, int]] = []  # (text position, audio position in ms)
        self._callback = _CALLBACK(self._receive)  # kept alive: the library holds only the pointer
        self.lib.espeak_SetSynthCallback(self._callback)

    def _receive(self, wav, num_samples, events) -> int:
        if num_samples > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        index = 0
        while events[index].type != _EVENT_END:
            if events[index].type == _EVENT_WORD:
                self.events.append((events[index].text_position, events[index].audio_position))
            index += 1
        return 0

    def speak(self, voice_name: str, text: str, speed_wpm: int, pitch: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        if self.lib.espeak_SetVoiceByName(voice_name.encode()) != 0:
            raise RuntimeError(f"espeak-ng has no voice {voice_name!r}")
        self.lib.espeak_SetParameter(_PARAM_RATE, speed_wpm, 0)
        self.lib.espeak_SetParameter(_PARAM_PITCH, pitch, 0)
        self.chunks, self.events = [], []
        data = text.encode() + b"\0"
        self.lib.espeak_Synth(data, len(data), 0, 1, 0, 0, None, None)  # POS_CHARACTER, espeakCHARS_AUTO
        self.lib.espeak_Synchronize()
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        return audio.astype(np.float32) / 32768.0, self.events


@functools.cache
def _espeak_library(pid: int) -> _EspeakLibrary:
    del pid  # one per process: a forked worker must not share its parent's synthesiser state
    return _EspeakLibrary()


def _word_spans(words: list[str], starts_by_char: list[tuple[int, int]], audio: np.ndarray,
                rate: int) -> list[tuple[float, float]] | None:
    """Each word's (start, end) in seconds from the WORD events (1-based character positions in the text
    " ".join(words), audio positions in ms); None if the events do not line up with the words."""
    offsets = np.cumsum([0] + [len(word) + 1 for word in words[:-1]]) + 1
    group_start = [None] * len(words)
    for position, ms in starts_by_char:
        if position <= 0:  # the end-of-text event some sentences get
            continue
        index = int(np.searchsorted(offsets, position, side="right")) - 1
        if index < 0 or offsets[index] != position or group_start[index] is not None:
            return None
        group_start[index] = ms * rate // 1000
    if group_start[0] is None:
        return None
    heads = [i for i, start in enumerate(group_start) if start is not None]
    if any(group_start[a] >= group_start[b] for a, b in zip(heads, heads[1:])):
        return None
    spans = []
    for k, head in enumerate(heads):
        start = group_start[head]
        stop = group_start[heads[k + 1]] if k + 1 < len(heads) else audio.size
        loud = np.flatnonzero(np.abs(audio[start:stop]) > SILENCE_LEVEL)
        # A short word's event can come before its sound starts ("a" after the leading silence): then it
        # spans its whole group.
        end = start + int(loud[-1]) + 1 if loud.size else stop
        start += int(loud[0]) if k == 0 and loud.size else 0  # the leading silence belongs to no word
        following = heads[k + 1] if k + 1 < len(heads) else len(words)
        spans += [(start / rate, end / rate)] * (following - head)
    return spans


def speak_espeak(words: list[str], voice: VoiceSpec) -> Spoken | None:
    """`words` as one espeak-ng sentence; None when its word events do not line up with the words."""
    library = _espeak_library(os.getpid())
    variant_file = (voices.edited_variant(voice.variant, voice.edits) if voice.edits
                    else contextlib.nullcontext(voice.variant))
    name = _ACCENT_VOICES.get(voice.accent, voice.accent)
    with variant_file as variant:
        audio, events = library.speak(f"{name}+{variant}", " ".join(words), voice.speed_wpm, voice.pitch)
    spans = _word_spans(words, events, audio, library.rate)
    if spans is None:
        return None
    return Spoken(soxr.resample(audio, library.rate, SAMPLING_RATE).astype(np.float32), spans)


@dataclasses.dataclass(frozen=True)
class FestivalVoice:
    name: str = "ked_diphone"
    duration_stretch: float = 1.0  # > 1 speaks slower
    f0_mean: int = 105  # Hz, the intonation model's target mean and spread
    f0_std: int = 15

    def __post_init__(self):
        if self.name in FLITE_SPEAKER_VOICES:
            raise ValueError(f"{self.name} is built from a flite speaker: flite is the held-out engine")


class _Festival:
    """One `festival --pipe` process. Festival buffers stdout in a pipe but not stderr, so replies come on
    stderr, each ended by a DONE line."""

    def __init__(self):
        try:
            self.process = subprocess.Popen(["festival", "--pipe"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True, bufsize=1)
        except FileNotFoundError as error:
            raise RuntimeError(FESTIVAL_NOT_INSTALLED) from error
        # Festival writes each utterance's audio here; it is removed once read (forked corpus workers exit
        # without running atexit, so nothing may be left for it to clean).
        self.wav = os.path.join(tempfile.gettempdir(), f"jaxstream-festival-{os.getpid()}.wav")
        atexit.register(self.close)
        self.voice = None

    def ask(self, commands: str) -> list[str]:
        self.process.stdin.write(commands + '\n(format stderr "DONE\\n")\n')
        self.process.stdin.flush()
        lines = []
        while (line := self.process.stderr.readline()) and line.strip() != "DONE":
            lines.append(line.rstrip("\n"))
        if not line:
            raise RuntimeError("festival exited: " + " | ".join(lines[-3:]))
        return lines

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


FESTIVAL_NOT_INSTALLED = "festival is not installed (Debian/Ubuntu: apt-get install festival festvox-kdlpc16k)"


def select_festival_voice(festival: _Festival, name: str) -> None:
    """Makes `name` Festival's current voice. An unknown voice only prints a SIOD error and leaves Festival on
    its default, which on Debian without festvox-kdlpc16k is kal_diphone, a flite speaker: never train on it."""
    replies = festival.ask(f'(voice_{name})\n(format stderr "VOICE %s\\n" current-voice)')
    if f"VOICE {name}" not in replies:
        raise UserError(f"Festival has no voice {name} (Debian/Ubuntu: apt-get install festvox-kdlpc16k)")
    festival.voice = name


def check_festival_voices() -> None:
    """UserError unless Festival is installed with every training voice (`FESTIVAL_VOICES`)."""
    festival = _Festival()
    try:
        for name in FESTIVAL_VOICES:
            select_festival_voice(festival, name)
    finally:
        festival.close()
# Prints each word's name, first phone's start (the previous segment's end) and last phone's end.
_FESTIVAL_SAY = """(set! jx_u (utt.synth (eval (list 'Utterance 'Text "{text}"))))
(utt.save.wave jx_u "{wav}" 'riff)
(mapcar (lambda (w) (format stderr "W %s %s %s\\n" (item.name w)
  (item.feat w "R:SylStructure.daughter1.daughter1.R:Segment.p.end")
  (item.feat w "R:SylStructure.daughtern.daughtern.end"))) (utt.relation.items jx_u 'Word))"""


@functools.cache
def _festival(pid: int) -> _Festival:
    del pid  # one per process
    return _Festival()


def speak_festival(words: list[str], voice: FestivalVoice) -> Spoken | None:
    """`words` spoken by Festival; None when Festival's words are not `words` (it split or merged one)."""
    festival = _festival(os.getpid())
    if festival.voice != voice.name:
        select_festival_voice(festival, voice.name)
    wav = festival.wav
    settings = (f"(Parameter.set 'Duration_Stretch {voice.duration_stretch:.3f})\n"
                f"(set! int_lr_params '((target_f0_mean {voice.f0_mean}) (target_f0_std {voice.f0_std}) "
                f"(model_f0_mean 170) (model_f0_std 34)))\n")
    replies = festival.ask(settings + _FESTIVAL_SAY.format(text=" ".join(words), wav=wav))
    audio, rate = soundfile.read(wav, dtype="float32")
    os.remove(wav)
    rows = []
    for line in replies:
        if line.startswith("W "):
            name, start, end = line.split()[1:]
            if name.startswith("'") and rows:  # Festival makes "'s" a word of its own, with no phones
                rows[-1][0] += name
            else:
                rows.append([name, start, end])
    # Festival also drops apostrophes inside words ("o'clock" -> "oclock").
    if [row[0].replace("'", "") for row in rows] != [word.replace("'", "") for word in words]:
        return None
    if rate != SAMPLING_RATE:
        audio = soxr.resample(audio, rate, SAMPLING_RATE).astype(np.float32)
    return Spoken(audio, [(float(start), float(end)) for _, start, end in rows])


def speak_flite(text: str, voice: str) -> np.ndarray:
    """`text` spoken by one of flite's voices, 16 kHz float32 (no word times: held-out sets only)."""
    if voice not in FLITE_VOICES:
        raise ValueError(f"flite voice must be one of {FLITE_VOICES}, got {voice!r}")
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        try:
            subprocess.run(["flite", "-voice", voice, "-t", text, "-o", wav.name], check=True, capture_output=True)
        except FileNotFoundError as error:
            raise RuntimeError("flite is not installed (Debian/Ubuntu: apt-get install flite)") from error
        audio, rate = soundfile.read(wav.name, dtype="float32")
    return soxr.resample(audio, rate, SAMPLING_RATE).astype(np.float32) if rate != SAMPLING_RATE else audio
