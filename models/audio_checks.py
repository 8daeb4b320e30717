"""Inputs a model transcribes badly without any error: narrowband audio and delays it was not trained at.

A model trained on 16 kHz speech loses what it relies on above 4 kHz when the audio comes from an 8 kHz
source (a phone line, G.711, an 8 kHz recording upsampled later), and a delay outside the range it saw in
training shifts its text alignment. Neither can be rejected (both are valid input), so the CLI and the engine
warn once, with the reason, through these checks.
"""
import contextlib
import logging
import threading

import numpy as np

from jaxstream.models.audio import SAMPLING_RATE

NARROWBAND_RATE = 8000
# Above the telephone band and above soxr's transition band when it upsamples 8 kHz audio (its passband
# ends near 3.8 kHz), below the 8 kHz Nyquist edge of 16 kHz audio.
HIGH_BAND_HZ = (4200.0, 7600.0)
# Share of the speech energy in HIGH_BAND_HZ. Measured (first 40 files of each tiny-v2 corpus, 16 kHz):
# espeak-ng / Festival / flite speech 1.2e-4 .. 0.14 (median ~7e-3); 8 kHz phone-line audio upsampled by
# soxr 9e-13 .. 5e-11. The threshold sits in the six decades between. Below it too: 16 kHz speech through a
# narrow microphone band (the sentence corpora's `synth.augment.band_limit` with its upper edge under ~3.7 kHz:
# 3 of the 300 held-out espeak-ng utterances of seed 1, 2.4e-6 .. 6.5e-6), and the upsampled phone line stored
# as 16-bit PCM, whose rounding noise reaches the high band (6e-10 .. 4e-9 at a 0.9 peak, up to 8e-6 at 0.02;
# 1e-12 .. 1e-11 as float). The share cannot tell an 8 kHz source from a band-limited 16 kHz one, so the
# reason names both.
NARROWBAND_ENERGY_SHARE = 1e-5
_FRAME = 512
# Frames side by side, not overlapping: the probe runs once per stream on the front-end thread, and half the
# frames of the overlapping hop (256) gave the same shares to within 0.6x-1.3x (first 60 files of the tiny-v2
# held-out espeak-ng and flite sets), far inside the six decades around the threshold.
_HOP = _FRAME
_SPEECH_FRAME_DB = -30.0  # frames this far below the loudest frame are silence and not counted
PROBE_SECONDS = 3.0  # of a stream's first audio, enough speech to judge its band
_WINDOW = np.hanning(_FRAME)
_FREQS = np.fft.rfftfreq(_FRAME, 1 / SAMPLING_RATE)
_BAND = slice(int(np.searchsorted(_FREQS, HIGH_BAND_HZ[0], "right")), int(np.searchsorted(_FREQS, HIGH_BAND_HZ[1])))


def high_band_energy_share(pcm) -> float | None:
    """Share of the energy of the louder frames of 16 kHz `pcm` that lies in HIGH_BAND_HZ; None when the
    audio is too short (< 1 frame) or silent, where no judgement is possible."""
    pcm = np.asarray(pcm, np.float64)
    if pcm.ndim != 1 or pcm.size < _FRAME:
        return None
    frames = np.lib.stride_tricks.sliding_window_view(pcm, _FRAME)[::_HOP]
    spectrum = np.fft.rfft(frames * _WINDOW, axis=1)
    power = spectrum.real**2 + spectrum.imag**2
    frame_energy = power.sum(axis=1)
    if not frame_energy.max() > 0:
        return None
    loud = frame_energy >= frame_energy.max() * 10 ** (_SPEECH_FRAME_DB / 10)
    return float(power[:, _BAND].sum(axis=1)[loud].sum() / frame_energy[loud].sum())


def narrowband_reason(pcm, source_rate: int = SAMPLING_RATE) -> str | None:
    """Why audio is narrowband, or None when it is not (or cannot be judged yet). `pcm` is the audio at
    16 kHz, `source_rate` the rate it came at (a file's or a stream's, before resampling)."""
    if source_rate <= NARROWBAND_RATE:
        return f"the audio is sampled at {source_rate} Hz"
    share = high_band_energy_share(pcm)
    if share is not None and share < NARROWBAND_ENERGY_SHARE:
        return (f"the audio has almost no energy above {HIGH_BAND_HZ[0] / 1000:g} kHz (an 8 kHz source such as a "
                "phone line, or a band-limited microphone or channel)")
    return None


def file_narrowband_reason(path, pcm) -> str | None:
    """`narrowband_reason` of an audio file, from its first PROBE_SECONDS (as a stream's is judged): `pcm` is
    the file decoded to 16 kHz; the rate the file declares decides an 8 kHz recording."""
    import soundfile

    return narrowband_reason(pcm[:int(PROBE_SECONDS * SAMPLING_RATE)], soundfile.info(path).samplerate)


def narrowband_warning(reason: str) -> str:
    return (f"narrowband input: {reason}; the model was trained on 16 kHz wideband speech and may transcribe "
            "it less accurately")


# The engine's narrowband warnings (one per distinct reason; the front end knows no file or client) go to a
# logger of their own, so that a caller that judges its inputs itself and names them (the CLI, with
# `file_narrowband_reason`) can mute them (`engine_narrowband_warnings_muted`) instead of saying it twice.
narrowband_logger = logging.getLogger(f"{__name__}.narrowband")


@contextlib.contextmanager
def engine_narrowband_warnings_muted():
    def mute(record: logging.LogRecord) -> bool:
        return False

    narrowband_logger.addFilter(mute)
    try:
        yield
    finally:
        narrowband_logger.removeFilter(mute)


def delay_warning(config, delay_ms: int) -> str | None:
    """A warning when `delay_ms` lies outside the delays the model was trained at (its config's
    `trained_delays_ms`, when the checkpoint records them), else None."""
    trained = getattr(config, "trained_delays_ms", None)
    if trained is None or trained[0] <= delay_ms <= trained[1]:
        return None
    return (f"delay {delay_ms} ms is outside the delays this model was trained at ({trained[0]}-{trained[1]} ms); "
            "expect a worse transcript")


class BandProbe:
    """Judges a stream's band once, from its first PROBE_SECONDS of 16 kHz audio (or all of it when the
    stream is shorter). `feed` collects the audio and says when there is enough; `judge` gives the verdict
    (the narrowband reason, or None) the first time it is called and None after. The two are apart so that
    a front end serving many streams can judge when it has nothing more urgent to do."""

    def __init__(self, source_rate: int = SAMPLING_RATE):
        self._source_rate = source_rate
        self._parts: list[np.ndarray] | None = []  # None once judged
        self._size = 0
        self._full = False

    def feed(self, pcm16k: np.ndarray) -> bool:
        """Adds audio; True on the one call after which the probe has what it needs (the source rate alone
        decides a stream sampled at 8 kHz or below)."""
        if self._parts is None or self._full:
            return False
        self._parts.append(np.asarray(pcm16k, np.float32))
        self._size += len(pcm16k)
        self._full = self._source_rate <= NARROWBAND_RATE or self._size >= PROBE_SECONDS * SAMPLING_RATE
        return self._full

    def judge(self) -> str | None:
        if self._parts is None:
            return None
        audio = np.concatenate(self._parts) if self._parts else np.zeros(0, np.float32)
        self._parts = None
        return narrowband_reason(audio, self._source_rate)


class WarnOnce:
    """Logs each distinct warning once: an engine serving many sessions of one phone line, or a CLI
    transcribing a folder of them, says it once rather than per session. Thread-safe."""

    def __init__(self, logger):
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, message: str | None) -> None:
        if message is None:
            return
        with self._lock:
            if message in self._seen:
                return
            self._seen.add(message)
        self._logger.warning("%s", message)
