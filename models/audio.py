"""Voxtral Realtime audio front end, on the host in numpy: log-mel features, padding, streaming, audio I/O.

Features are **time-major**: `[frames, 128]` float32, one row per 10 ms hop (160 samples at 16 kHz), eight
rows per 80 ms decoder slot. (Transformers' feature extractor returns the transpose, `(128, frames)`.)

The log-mel matches transformers' `VoxtralRealtimeFeatureExtractor` (spec §1.1): periodic Hann window 400,
n_fft 400, hop 160, centred STFT with reflect padding, power spectrum, the last STFT frame dropped, a
Slaney-scale Slaney-normalised mel filterbank (201 x 128, 0-8 kHz), log10 floored at 1e-10, clamped at
the fixed global maximum 1.5 - 8, then (x + 4) / 4. Computed in float64 and returned as float32.

Every stream is left-padded with 32 silent slots (40960 samples) and, at its end, right-padded to a
multiple of 1280 samples plus `n_delay + 11` silent slots (spec §1.2). `StreamingLogMel` reproduces the
offline features of that padded stream exactly while the audio arrives in pieces of any size (spec §1.3).
"""
import io
import math
import os

import numpy as np

SAMPLING_RATE = 16000
HOP_LENGTH = 160
WINDOW_SIZE = 400  # also n_fft
NUM_MEL_BINS = 128
GLOBAL_LOG_MEL_MAX = 1.5
SAMPLES_PER_SLOT = 1280  # one decoder token = 80 ms
SLOT_MS = SAMPLES_PER_SLOT * 1000 // SAMPLING_RATE
SLOT_SECONDS = SAMPLES_PER_SLOT / SAMPLING_RATE
MEL_FRAMES_PER_SLOT = SAMPLES_PER_SLOT // HOP_LENGTH
N_LEFT_PAD_TOKENS = 32
DEFAULT_DELAY_MS = 480
# mistral-common's OFFLINE_STREAMING_BUFFER_TOKENS: extra silence that lets the model flush delayed words.
END_OF_STREAM_BUFFER_SLOTS = 10

_HALF_WINDOW = WINDOW_SIZE // 2
# The last mel frame of a slot is centred 40 samples before the slot's end and reads 200 samples past its
# centre, so a slot needs 40 samples of the next slot (2.5 ms look-ahead).
LOOK_AHEAD_SAMPLES = _HALF_WINDOW - HOP_LENGTH
# Samples one slot's 8 windows read: from 200 before its first sample to 40 past its last.
SLOT_SEGMENT = SAMPLES_PER_SLOT + WINDOW_SIZE - HOP_LENGTH
# Float PCM is nominally in [-1, 1]; resampling and gain can overshoot a little, so allow some headroom.
MAX_SAMPLE_MAGNITUDE = 2.0
# The transcription delays Voxtral Realtime was trained for, and how messages and help texts state them.
ALLOWED_DELAYS_MS = tuple(range(SLOT_MS, 1201, SLOT_MS)) + (2400,)
ALLOWED_DELAYS_TEXT = f"a multiple of {SLOT_MS} between {SLOT_MS} and 1200, or 2400"
_FRAMES_PER_BLOCK = 4096  # bounds the float64 work arrays of the offline path (~13 MB per block)
# load_audio decodes this many frames at a time (2.7 s at 48 kHz, 1 MB of float32 stereo).
_DECODE_BLOCK_FRAMES = 1 << 17
_UNKNOWN_FRAMES = 2**63 - 1  # libsndfile's frame count for a stream of unknown length (SF_COUNT_MAX)
_UNKNOWN_LENGTH_SECONDS = 60  # load_audio's first buffer for a file of unknown length (it grows as needed)
# The streaming path's block: its work arrays (~1.6 MB) come back from the allocator's free lists. A stream's
# end releases ~18 slots at once, and 32 streams ending together made one 15 MB FFT output whose fresh pages
# cost more than the FFT (24 ms against 3 for 4,608 frames).
_SLOTS_PER_BLOCK = 64


class AudioError(ValueError):
    """Audio the front end cannot use: wrong rate, shape or values, or a file that is missing/undecodable."""


class AudioTooLongError(AudioError):
    """A file longer than the caller's limit (`load_audio`'s `max_seconds`); `seconds` is its length when
    the file declares it, else None (the decoding stopped at the limit)."""

    def __init__(self, message: str, seconds: float | None = None):
        super().__init__(message)
        self.seconds = seconds


def _mel_filters() -> np.ndarray:
    # mistral-common's filterbank is bit-identical to transformers' slaney/slaney one (checked in the tests
    # against committed transformers features). It is cached there, so keep a private read-only copy.
    from mistral_common.audio import mel_filter_bank

    filters = np.array(mel_filter_bank(WINDOW_SIZE // 2 + 1, NUM_MEL_BINS, 0.0, SAMPLING_RATE / 2, SAMPLING_RATE))
    filters.setflags(write=False)
    return filters


MEL_FILTERS = _mel_filters()  # [201, 128]
# torch.hann_window(400) is the periodic Hann window: the symmetric window of length 401 without its end.
_WINDOW = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(WINDOW_SIZE) / WINDOW_SIZE)


def _frames_to_log_mel(frames: np.ndarray, mel_filters: np.ndarray, *, per_slot: bool = False,
                       windowed: bool = False) -> np.ndarray:
    """[n, 400] windows of samples (already multiplied by the Hann window when `windowed`) -> [n, 128]
    float32 normalised log-mel rows.

    `per_slot` (n a multiple of 8): the filterbank product as a stack of one small product per slot. One
    large product makes OpenBLAS wake its thread pool, whose spinning threads take several times the work's
    CPU from the engine's threads on a busy machine; the small ones stay on the calling thread.
    """
    spectrum = np.fft.rfft(frames if windowed else frames * _WINDOW, n=WINDOW_SIZE, axis=-1)
    power = spectrum.real**2 + spectrum.imag**2  # half the time of np.abs(spectrum) ** 2 (no square root)
    if per_slot:
        mel = (power.reshape(-1, MEL_FRAMES_PER_SLOT, power.shape[-1]) @ mel_filters).reshape(-1, NUM_MEL_BINS)
    else:
        mel = power @ mel_filters
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, GLOBAL_LOG_MEL_MAX - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def _hop_windows(samples: np.ndarray, num_frames: int) -> np.ndarray:
    """The `num_frames` windows of 400 samples starting every 160 samples of 1-D `samples`, which must hold
    them all (a read-only strided view, no copy; numpy's `sliding_window_view` cost 9 us a call here, a
    quarter of an 80 ms slot's features, against 2)."""
    needed = (num_frames - 1) * HOP_LENGTH + WINDOW_SIZE if num_frames else 0
    if samples.ndim != 1 or samples.size < needed:
        raise ValueError(f"{num_frames} windows need {needed} samples, got an array of shape {samples.shape}")
    step = samples.strides[0]
    return np.lib.stride_tricks.as_strided(samples, (num_frames, WINDOW_SIZE), (HOP_LENGTH * step, step),
                                           writeable=False)


def check_pcm(audio, what: str = "audio") -> np.ndarray:
    """Validated 1-D finite float PCM within +-MAX_SAMPLE_MAGNITUDE, in its own float dtype (no copy: the
    front end checks every 80 ms append, and each numpy call on 1,280 samples costs as much as its work)."""
    array = np.asarray(audio)
    if array.ndim != 1:
        raise AudioError(f"{what} must be 1-D mono PCM, got an array of shape {array.shape}")
    if array.dtype.kind != "f":
        raise AudioError(
            f"{what} must be float PCM in [-1, 1], got dtype {array.dtype} (convert PCM16 bytes with pcm16_to_float32)"
        )
    # One pass each way; NaN propagates through both reductions and fails the comparison, as inf does.
    if array.size and not max(np.maximum.reduce(array), -np.minimum.reduce(array)) <= MAX_SAMPLE_MAGNITUDE:
        if not np.isfinite(array).all():
            raise AudioError(f"{what} contains NaN or infinite samples")
        # Far outside [-1, 1] is a caller's mistake (PCM16-scaled floats), and huge values overflow the
        # power spectrum to inf, which would reach the KV cache.
        peak = float(np.max(np.abs(array)))
        raise AudioError(f"{what} must be float PCM in [-1, 1]; got a sample of magnitude {peak:.6g} "
                         f"(integer PCM must be divided by its full scale, e.g. 32768 for PCM16)")
    return array


def _check_rate(sampling_rate: int) -> None:
    if sampling_rate != SAMPLING_RATE:
        raise AudioError(
            f"the audio front end expects {SAMPLING_RATE} Hz audio, got {sampling_rate} Hz; "
            f"resample it first (resample_to_16k)"
        )


# The features of a slot whose windows read only zeros (the left padding): the log floor everywhere.
SILENT_SLOT = _frames_to_log_mel(np.zeros((MEL_FRAMES_PER_SLOT, WINDOW_SIZE)), MEL_FILTERS)
SILENT_SLOT.flags.writeable = False


def log_mel(audio, sampling_rate: int = SAMPLING_RATE, *, mel_filters: np.ndarray = MEL_FILTERS) -> np.ndarray:
    """Log-mel features of already padded 16 kHz audio: `[len(audio) // 160, 128]` float32, time-major.

    Equals transformers' `VoxtralRealtimeFeatureExtractor()(audio, center=True)["input_features"][0].T`.
    `mel_filters` [201, 128] replaces the filterbank (training's frequency warping passes a warped one).
    """
    _check_rate(sampling_rate)
    if np.shape(mel_filters) != MEL_FILTERS.shape:
        raise AudioError(f"mel_filters must have shape {MEL_FILTERS.shape}, got {np.shape(mel_filters)}")
    samples = check_pcm(audio).astype(np.float64)
    if samples.size <= _HALF_WINDOW:
        raise AudioError(f"audio must be longer than {_HALF_WINDOW} samples for the centred STFT, got {samples.size}")
    samples = np.pad(samples, _HALF_WINDOW, mode="reflect")
    num_frames = (samples.size - WINDOW_SIZE) // HOP_LENGTH  # the STFT's last frame is dropped
    features = np.empty((num_frames, NUM_MEL_BINS), np.float32)
    for first in range(0, num_frames, _FRAMES_PER_BLOCK):
        count = min(_FRAMES_PER_BLOCK, num_frames - first)
        block = samples[first * HOP_LENGTH : (first + count - 1) * HOP_LENGTH + WINDOW_SIZE]
        features[first : first + count] = _frames_to_log_mel(_hop_windows(block, count), mel_filters)
    return features


def n_delay_from_ms(delay_ms) -> int:
    """Transcription delay in ms -> number of delay slots (480 ms -> 6): the one check of a delay, for every
    caller. Allowed: `ALLOWED_DELAYS_MS`; anything else raises ValueError."""
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float, np.integer, np.floating)):
        raise ValueError(f"delay_ms must be a number of milliseconds, got {delay_ms!r}")
    if delay_ms not in ALLOWED_DELAYS_MS:
        raise ValueError(f"delay_ms must be {ALLOWED_DELAYS_TEXT}; got {delay_ms}")
    return int(delay_ms) // SLOT_MS


def prompt_length(n_delay: int, n_left_pad_tokens: int = N_LEFT_PAD_TOKENS) -> int:
    """Prompt tokens = audio slots prefilled at the start: BOS + left-pad + delay `[STREAMING_PAD]`s (39 at 480 ms)."""
    return 1 + n_left_pad_tokens + n_delay


def left_pad_samples(n_left_pad_tokens: int = N_LEFT_PAD_TOKENS) -> int:
    """Zeros put before every stream (40960 = 2.56 s for the default 32 slots)."""
    return n_left_pad_tokens * SAMPLES_PER_SLOT


def silent_prefix_slots(n_left_pad_tokens: int = N_LEFT_PAD_TOKENS) -> int:
    """Leading slots whose features come from the left padding alone (31 of the 32: the last one's frames
    look 40 samples into the audio). They are the same in every stream, so an engine may compute them once."""
    return (left_pad_samples(n_left_pad_tokens) - LOOK_AHEAD_SAMPLES) // SAMPLES_PER_SLOT


def right_pad_samples(num_samples: int, n_delay: int) -> int:
    """Zeros appended after `num_samples` real samples at the end of a stream.

    Aligns to a whole slot, then adds `(n_delay + 1) + 10` silent slots (mistral-common `_get_streaming_pad`).
    """
    align = -num_samples % SAMPLES_PER_SLOT
    return align + (n_delay + 1 + END_OF_STREAM_BUFFER_SLOTS) * SAMPLES_PER_SLOT


def stream_slot_bound(seconds: float, n_delay: int, n_left_pad_tokens: int = N_LEFT_PAD_TOKENS) -> int:
    """The most slots a stream of at most `seconds` of audio has: the left padding, the audio (plus one slot
    for a resampler's rounding) and the end padding of `right_pad_samples`."""
    audio_slots = math.ceil(seconds * SAMPLING_RATE / SAMPLES_PER_SLOT) + 1
    return n_left_pad_tokens + audio_slots + n_delay + 1 + END_OF_STREAM_BUFFER_SLOTS


def pad_for_offline(audio, n_delay: int, n_left_pad_tokens: int = N_LEFT_PAD_TOKENS) -> np.ndarray:
    """Left and right padded float32 audio; its length is a multiple of 1280 (one slot per 1280 samples)."""
    samples = check_pcm(audio).astype(np.float32)
    return np.concatenate([
        np.zeros(left_pad_samples(n_left_pad_tokens), np.float32),
        samples,
        np.zeros(right_pad_samples(samples.size, n_delay), np.float32),
    ])


def offline_features(
    audio, n_delay: int, sampling_rate: int = SAMPLING_RATE, n_left_pad_tokens: int = N_LEFT_PAD_TOKENS
) -> np.ndarray:
    """Features of a whole utterance: `[8 * num_slots, 128]`, the padded stream's slots in order."""
    _check_rate(sampling_rate)
    return log_mel(pad_for_offline(audio, n_delay, n_left_pad_tokens))


class StreamingLogMel:
    """Incremental front end: PCM pieces in, mel slots `[n, 8, 128]` out, equal to `offline_features`.

    Sample indices below are in padded-stream coordinates (0 = first left-pad sample). Slot k holds mel
    frames 8k..8k+7; frame f reads samples [160f - 200, 160f + 200), so slot k is computable once samples
    up to 1280 (k + 1) + 40 have arrived. Reflect padding only ever mirrors left-pad or right-pad zeros,
    so the stream is extended with implicit zeros on both sides.

    Slots are released in the HF streaming order: nothing until the prompt's slots (`prompt_slots` =
    1 + 32 + n_delay, the first 9000 real samples at 480 ms) are all computable, then one slot per 1280
    samples. `finish()` appends the right padding and releases every remaining slot. Features are computed
    lazily in `take`; only the samples of slots not yet taken (plus 200 of history) are kept, so memory
    stays bounded for streams of any length as long as the consumer keeps taking slots.
    """

    def __init__(
        self, n_delay: int, n_left_pad_tokens: int = N_LEFT_PAD_TOKENS, sampling_rate: int = SAMPLING_RATE
    ):
        _check_rate(sampling_rate)
        if n_delay < 1:
            raise ValueError(f"n_delay must be >= 1, got {n_delay}")
        self.n_delay = n_delay
        self.prompt_slots = prompt_length(n_delay, n_left_pad_tokens)
        self._left_pad = left_pad_samples(n_left_pad_tokens)
        self._silent_slots = max(silent_prefix_slots(n_left_pad_tokens), 0)
        # _buffer[_offset : _offset + _length] holds the padded samples [_start, _start + _length). It starts
        # at the first window of the first slot that is computed: the silent slots before it are never read.
        self._start = self._silent_slots * SAMPLES_PER_SLOT - _HALF_WINDOW
        self._length = self._left_pad - self._start
        # Room for the whole prompt and a few appends: 32 streams growing their buffers in the same pass made
        # 24 MB of fresh pages, a 3 ms stall of every stream's features.
        prompt_end = self.prompt_slots * SAMPLES_PER_SLOT + LOOK_AHEAD_SAMPLES - self._start
        self._buffer = np.zeros(prompt_end + 4 * SAMPLES_PER_SLOT)
        self._offset = 0
        self.samples_received = 0
        self.slots_taken = 0
        self.total_slots: int | None = None  # known once finished
        self._right_silent_from: int | None = None  # once finished: the first slot reading right padding alone

    @property
    def finished(self) -> bool:
        return self.total_slots is not None

    @property
    def done(self) -> bool:
        """Finished and every slot taken."""
        return self.finished and self.slots_taken == self.total_slots

    @property
    def retained_samples(self) -> int:
        """Samples held in memory: those the slots not yet taken read (but the silent left padding), plus 200
        of history."""
        return self._length

    @property
    def _stream_end(self) -> int:
        return self._start + self._length

    def slots_at(self, samples_received: int) -> int:
        """The slots ready in all (taken or not) once `samples_received` real samples have been pushed,
        before `finish`. It reads no stream state, so another thread may predict what a push will make
        ready while this stream's own thread applies pushes."""
        count = max(0, (self._left_pad + samples_received - LOOK_AHEAD_SAMPLES) // SAMPLES_PER_SLOT)
        return count if count >= self.prompt_slots else 0

    def _computable_slots(self) -> int:
        return self.total_slots if self.finished else self.slots_at(self.samples_received)

    @property
    def slots_ready(self) -> int:
        """Slots that `take` can return now."""
        return self._computable_slots() - self.slots_taken

    @property
    def samples_until_next_slot(self) -> int:
        """Real samples still needed before one more slot (or the whole prompt) is ready; 0 if ready or done."""
        if self.slots_ready > 0 or self.finished:
            return 0
        target_slots = max(self.slots_taken + 1, self.prompt_slots)
        return target_slots * SAMPLES_PER_SLOT + LOOK_AHEAD_SAMPLES - self._stream_end

    def _append(self, samples: np.ndarray) -> None:
        if self._offset + self._length + samples.size > self._buffer.size:
            # Move the live samples to the front; grow only if the consumer lags behind.
            live = self._buffer[self._offset : self._offset + self._length]
            if self._length + samples.size > self._buffer.size:
                self._buffer = np.zeros(max(self._length + samples.size, 2 * self._buffer.size))
            self._buffer[: self._length] = live
            self._offset = 0
        end = self._offset + self._length
        self._buffer[end : end + samples.size] = samples
        self._length += samples.size

    def push(self, pcm) -> int:
        """Append float PCM at 16 kHz (any number of samples); returns `slots_ready`."""
        if self.finished:
            raise ValueError("cannot push audio after finish()")
        samples = check_pcm(pcm)
        self._append(samples)
        self.samples_received += samples.size
        return self.slots_ready

    def finish(self) -> int:
        """End of stream: append the right padding; every remaining slot becomes ready. Returns `slots_ready`."""
        if not self.finished:
            padding = right_pad_samples(self.samples_received, self.n_delay)
            self.total_slots = (self._stream_end + padding) // SAMPLES_PER_SLOT
            # Slot k's windows start at 1280 k - 200: past the audio's end they read zeros only.
            self._right_silent_from = -(-(self._stream_end + _HALF_WINDOW) // SAMPLES_PER_SLOT)
            # The offline STFT's end reflection mirrors right-pad zeros, hence the extra look-ahead zeros.
            self._append(np.zeros(padding + LOOK_AHEAD_SAMPLES))
        return self.slots_ready

    def take(self, max_slots: int | None = None) -> np.ndarray:
        """Up to `max_slots` (default: all) ready slots, in order, as float32 `[n, 8, 128]`."""
        count = self.slots_ready if max_slots is None else min(max_slots, self.slots_ready)
        return take_ready([(self, max(count, 0))])[0]

    def _ready_segments(self, count: int, skip: int = 0) -> np.ndarray:
        """The samples each of `count` slots' windows read, from `skip` past the next slot, `[count,
        SLOT_SEGMENT]` (a strided view of the buffer, no copy): slot k's 8 windows start every 160 samples
        from 1280 k - 200."""
        first = self._offset + (self.slots_taken + skip) * SAMPLES_PER_SLOT - _HALF_WINDOW - self._start
        if count == 1:
            return self._buffer[None, first : first + SLOT_SEGMENT]
        samples = self._buffer[first : first + (count - 1) * SAMPLES_PER_SLOT + SLOT_SEGMENT]
        if samples.size < (count - 1) * SAMPLES_PER_SLOT + SLOT_SEGMENT:  # as_strided reads unchecked memory
            raise ValueError(f"{count} slots are not buffered")
        step = samples.strides[0]
        return np.lib.stride_tricks.as_strided(samples, (count, SLOT_SEGMENT), (SAMPLES_PER_SLOT * step, step),
                                               writeable=False)

    def _silent_ahead(self, count: int) -> int:
        """How many of the next `count` slots read the left padding alone (their features are `SILENT_SLOT`)."""
        return min(count, max(self._silent_slots - self.slots_taken, 0))

    def _silent_behind(self, count: int) -> int:
        """How many of the last of the next `count` slots read the right padding alone (also `SILENT_SLOT`),
        not counting those `_silent_ahead` already covers."""
        if self._right_silent_from is None:
            return 0
        after = max(self.slots_taken + count - self._right_silent_from, 0)
        return min(after, count - self._silent_ahead(count))

    def _release(self, count: int) -> None:
        """Marks `count` slots taken and drops the samples only they read (the next slot starts reading 200
        samples early)."""
        self.slots_taken += count
        released = max(self.slots_taken * SAMPLES_PER_SLOT - _HALF_WINDOW - self._start, 0)  # 0 within the silence
        self._offset += released
        self._start += released
        self._length -= released


def take_ready(requests) -> list[np.ndarray]:
    """Takes slots from several streams at once: `requests` is `(stream, count)` pairs (count <= the stream's
    `slots_ready`; each stream at most once); returns each stream's `[count, 8, 128]` float32 slots.

    Every window of every stream goes through one `_frames_to_log_mel` (one FFT, one stacked filterbank
    product, one log), so many streams appending 80 ms each cost a few large numpy calls instead of a dozen
    tiny ones per stream. Rows are computed independently, so each stream's features equal its own `take`'s.
    Slots of the left padding alone are not computed: they all equal `SILENT_SLOT` (31 of a new stream's 39
    prompt slots at 480 ms, a third of the features of a 4 s utterance); nor are those of the right padding
    alone (16 of the 17-18 slots a stream's end adds at 480 ms: a pass that finished 32 streams of the tiny
    model took 14.7 ms, a tenth of their whole run, computing them).
    """
    counts = [count for _, count in requests]
    lead = [stream._silent_ahead(count) for stream, count in requests]
    tail = [stream._silent_behind(count) for stream, count in requests]
    middle = [count - skip - trailing for count, skip, trailing in zip(counts, lead, tail)]  # computed per stream
    computed = sum(middle)
    # Each computed slot's samples copied into one array (a slice per stream in the paced steady state); then
    # every window of every slot is one strided view of it, and one multiply applies the Hann window.
    segments = np.empty((computed, SLOT_SEGMENT))
    row = 0
    for (stream, _), skip, own in zip(requests, lead, middle):
        if own:
            segments[row : row + own] = stream._ready_segments(own, skip)
            row += own
    features = np.empty((computed, MEL_FRAMES_PER_SLOT, NUM_MEL_BINS), np.float32)
    step = segments.strides[1]
    for first in range(0, computed, _SLOTS_PER_BLOCK):  # a stream's end or a burst of prompts: many slots at once
        block = segments[first : first + _SLOTS_PER_BLOCK]
        windows = np.lib.stride_tricks.as_strided(block, (len(block), MEL_FRAMES_PER_SLOT, WINDOW_SIZE),
                                                  (SLOT_SEGMENT * step, HOP_LENGTH * step, step), writeable=False)
        frames = (windows * _WINDOW).reshape(-1, WINDOW_SIZE)
        features[first : first + len(block)] = _frames_to_log_mel(
            frames, MEL_FILTERS, per_slot=True, windowed=True).reshape(-1, MEL_FRAMES_PER_SLOT, NUM_MEL_BINS)
    slots, first = [], 0
    for (stream, count), skip, own, trailing in zip(requests, lead, middle, tail):
        part = features[first : first + own]
        if skip or trailing:
            part = np.concatenate([np.broadcast_to(SILENT_SLOT, (skip, *SILENT_SLOT.shape)), part,
                                   np.broadcast_to(SILENT_SLOT, (trailing, *SILENT_SLOT.shape))])
        slots.append(part)
        first += own
        if count:
            stream._release(count)
    return slots


def pcm16_to_float32(data: bytes) -> np.ndarray:
    """Little-endian signed 16-bit PCM bytes -> float32 samples in [-1, 1) (divided by 32768, as vLLM does)."""
    if len(data) % 2:
        raise AudioError(f"PCM16 data must have an even number of bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def resample_to_16k(audio, sampling_rate: int) -> np.ndarray:
    """1-D float audio at any positive rate -> float32 at 16 kHz (soxr "HQ", as mistral-common resamples)."""
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise AudioError(f"sampling rate must be a positive integer number of Hz, got {sampling_rate!r}")
    samples = check_pcm(audio).astype(np.float32)
    if sampling_rate == SAMPLING_RATE:
        return samples
    import soxr

    return clip_resampled(soxr.resample(samples, int(sampling_rate), SAMPLING_RATE, quality="HQ").astype(np.float32))


def clip_resampled(samples: np.ndarray) -> np.ndarray:
    """Resampled audio within the magnitude its input was checked against: the filter rings (an 8 kHz square
    wave of magnitude 2, the most the checks take, comes out at up to 2.7), and the 16 kHz checks would refuse
    what the input's passed. The streaming front end clips the same way, so both paths give the same samples."""
    return np.clip(samples, -MAX_SAMPLE_MAGNITUDE, MAX_SAMPLE_MAGNITUDE)


def load_audio(source: str | os.PathLike | bytes, max_seconds: float | None = None, *,
               name: str | None = None) -> np.ndarray:
    """An audio file (path or the file's bytes; wav/flac/ogg/mp3/...) -> mono float32 at 16 kHz.

    Channels are averaged. Raises `AudioError` naming the file (its path; bytes by `name`, an upload's filename,
    when the caller has one) when it is missing or cannot be decoded, and listing the formats libsndfile reads
    when it does not recognise the file's format or encoding (`readable_formats`). With
    `max_seconds`, longer audio raises `AudioTooLongError` before more than that much of it is decoded: a
    compressed file of hours of silence is a few MB, its samples gigabytes. The length the file declares is
    checked first; the decoding, a block at a time, stops once it passes the limit all the same, since a
    stream of unknown length declares libsndfile's maximum count.

    Each block is downmixed and resampled (soxr "HQ", streaming) as it is decoded, so only 16 kHz samples
    are kept (resampling the whole signal at the end kept 2 h of 96 kHz audio as 2.8 GB of float32, for
    460 MB at 16 kHz); they equal `resample_to_16k` of the whole signal.
    """
    import soundfile
    import soxr

    if isinstance(source, (bytes, bytearray)):
        name, handle = name or "<audio bytes>", io.BytesIO(source)
    else:
        name = handle = os.fspath(source)
        if not os.path.isfile(name):
            raise AudioError(f"audio file not found: {name}")
    try:
        with soundfile.SoundFile(handle) as audio:
            rate = audio.samplerate
            limit = math.inf if max_seconds is None else max_seconds * rate
            if limit < audio.frames < _UNKNOWN_FRAMES:
                raise AudioTooLongError(f"audio {name} lasts {audio.frames / rate:.0f} s, more than the limit "
                                        f"of {max_seconds:g} s", audio.frames / rate)
            # Room for the length the file declares, trusted up to the limit or, without one, an hour (a header
            # may lie); the buffer grows past it if the file holds more.
            trusted = limit if max_seconds is not None else 3600 * rate
            expected = min(audio.frames, trusted) if audio.frames < _UNKNOWN_FRAMES else _UNKNOWN_LENGTH_SECONDS * rate
            samples = _GrowingPcm(math.ceil(expected * SAMPLING_RATE / rate) + 1)
            # soxr "HQ", as resample_to_16k: the stream's samples equal those of the whole signal resampled.
            resampler = (None if rate == SAMPLING_RATE
                         else soxr.ResampleStream(rate, SAMPLING_RATE, 1, dtype="float32", quality="HQ"))
            frames = 0
            while (block := audio.read(_DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True)).size:
                frames += len(block)
                if frames > limit:
                    raise AudioTooLongError(f"audio {name} lasts more than the limit of {max_seconds:g} s")
                mono = _checked_block(block.mean(axis=1) if block.shape[1] > 1 else block[:, 0], name)
                samples.append(mono if resampler is None else clip_resampled(resampler.resample_chunk(mono)))
            if resampler is not None:  # the filter's delayed tail
                samples.append(clip_resampled(resampler.resample_chunk(np.zeros(0, np.float32), last=True)))
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise AudioError(f"cannot decode audio {name}: {decode_failure(exc)}") from exc
    return samples.take()


def decode_failure(exc: Exception) -> str:
    """Why libsndfile could not open or decode audio, and the formats it reads when it did not recognise the
    file's. Its own message names its handle ("Error opening <_io.BytesIO object at 0x...>"): the caller says
    which audio, its error_string why."""
    reason = getattr(exc, "error_string", None) or str(exc)
    if getattr(exc, "code", None) in _FORMAT_ERRORS:
        reason = f"{reason.rstrip('.')}. {readable_formats()}"
    return reason


_FORMAT_ERRORS = (1, 4)  # libsndfile's SF_ERR_UNRECOGNISED_FORMAT, SF_ERR_UNSUPPORTED_ENCODING
_COMMON_FORMATS = ("WAV", "FLAC", "OGG", "MP3")  # named first, when this libsndfile reads them


def readable_formats() -> str:
    """The formats load_audio decodes, as this build of libsndfile names them (RAW, header-less, it cannot: it
    would need the rate and encoding given). Common ones it does not read, such as the MP4/M4A and WebM that
    OpenAI's upload takes, need converting first."""
    import soundfile

    formats = set(soundfile.available_formats()) - {"RAW"}
    named = [f for f in _COMMON_FORMATS if f in formats] + sorted(formats - set(_COMMON_FORMATS))
    return (f"Readable formats (libsndfile {soundfile.__libsndfile_version__}): {', '.join(named)}; convert others "
            f"first, e.g. MP4, M4A or WebM: ffmpeg -i IN OUT.wav")


def _checked_block(mono: np.ndarray, name: str) -> np.ndarray:
    try:
        return check_pcm(mono)
    except AudioError as exc:
        raise AudioError(f"unusable audio {name}: {exc}") from exc


class _GrowingPcm:
    """Float32 samples appended piece by piece to one buffer, trimmed in place at the end (`ndarray.resize`:
    realloc), so that the samples never exist twice, as in a list of pieces and its concatenation. The
    buffer is made for the expected count (`np.empty`: its pages cost memory only once written); one that
    turns out too small is doubled (resize zero-fills the new half)."""

    def __init__(self, capacity: int):
        self._buffer = np.empty(max(capacity, 1), np.float32)
        self._size = 0

    def append(self, piece: np.ndarray) -> None:
        end = self._size + piece.size
        if end > self._buffer.size:
            # No view of the buffer outlives a call, so resizing it without numpy's reference check is safe.
            self._buffer.resize(max(end, 2 * self._buffer.size), refcheck=False)
        self._buffer[self._size : end] = piece
        self._size = end

    def take(self) -> np.ndarray:
        """The samples; the buffer is handed over (append no more)."""
        self._buffer.resize(self._size, refcheck=False)
        return self._buffer
