"""Light, cheap audio augmentation in numpy: speed, gain, rooms, noise, microphone bands and phone lines."""
import numpy as np
import soxr

from jaxstream.models.audio import SAMPLING_RATE


# The largest strength the chains support: their widest speed range (Festival's, +-0.15 per unit of strength)
# must keep the speed factor positive, with a margin.
MAX_STRENGTH = 5.0


def change_speed(audio: np.ndarray, factor: float) -> np.ndarray:
    """Plays `audio` `factor` times faster (pitch moves with it, like tape); durations scale by 1/factor."""
    return soxr.resample(audio, SAMPLING_RATE * factor, SAMPLING_RATE).astype(np.float32)


def room_reverb(audio: np.ndarray, rng: np.random.Generator, rt60_s: float, wet: float) -> np.ndarray:
    """Convolves with an exponentially decaying noise impulse response (a diffuse-field room model)."""
    length = max(int(rt60_s * SAMPLING_RATE), 16)
    decay = np.exp(-6.9 * np.arange(length) / length)  # -60 dB at rt60
    response = rng.standard_normal(length) * decay
    response[0] = 0.0
    response /= np.sqrt(np.sum(response**2)) + 1e-9
    reverberant = np.convolve(audio, response)[: audio.size]
    return ((1.0 - wet) * audio + wet * reverberant).astype(np.float32)


def add_noise(audio: np.ndarray, rng: np.random.Generator, snr_db: float, colour: str) -> np.ndarray:
    """Adds white, pink or brown noise at `snr_db` relative to the speech power."""
    noise = rng.standard_normal(audio.size)
    if colour != "white":
        spectrum = np.fft.rfft(noise)
        freqs = np.maximum(np.fft.rfftfreq(audio.size), 1.0 / max(audio.size, 1))
        spectrum /= np.sqrt(freqs) if colour == "pink" else freqs
        noise = np.fft.irfft(spectrum, n=audio.size)
    speech_power = np.mean(audio**2) + 1e-12
    noise *= np.sqrt(speech_power / (np.mean(noise**2) + 1e-12) / 10 ** (snr_db / 10))
    return (audio + noise).astype(np.float32)


def augment(audio: np.ndarray, rng: np.random.Generator, strength: float = 1.0) -> tuple[np.ndarray, float]:
    """A random light augmentation chain; returns the audio and its speed factor (to rescale timings)."""
    speed = float(rng.uniform(1.0 - 0.1 * strength, 1.0 + 0.1 * strength)) if rng.random() < 0.5 else 1.0
    if speed != 1.0:
        audio = change_speed(audio, speed)
    if rng.random() < 0.4 * strength:
        audio = room_reverb(audio, rng, rt60_s=float(rng.uniform(0.1, 0.5)), wet=float(rng.uniform(0.1, 0.4)))
    if rng.random() < 0.6 * strength:
        colour = str(rng.choice(["white", "pink", "brown"]))
        audio = add_noise(audio, rng, snr_db=float(rng.uniform(15.0, 40.0)), colour=colour)
    peak = float(np.max(np.abs(audio))) + 1e-9
    gain = float(rng.uniform(0.1, 0.95)) / peak
    return (audio * gain).astype(np.float32), speed


# What a microphone, a room and a phone line add (sentence corpora, `corpus.py`). The word-list corpora above keep
# `augment` as it was, so the first tiny model's corpus can still be made exactly.
TELEPHONE_RATE = 8000
TELEPHONE_BAND_HZ = (300.0, 3400.0)
_MU = 255.0


def _fast_size(size: int) -> int:
    """A power of two >= size: numpy's FFT is slow on lengths with large prime factors."""
    return 1 << max(size - 1, 1).bit_length()


def _fft_filter(audio: np.ndarray, gain_of_hz) -> np.ndarray:
    """`audio` with each frequency scaled by gain_of_hz(frequencies): zero-phase, whole-signal FFT (zero
    padded, so the filter's ringing does not wrap around)."""
    n = _fast_size(audio.size + SAMPLING_RATE // 10)
    frequencies = np.fft.rfftfreq(n, 1.0 / SAMPLING_RATE)
    return np.fft.irfft(np.fft.rfft(audio, n) * gain_of_hz(frequencies), n)[: audio.size].astype(np.float32)


def coloured_noise(size: int, rng: np.random.Generator, colour: str) -> np.ndarray:
    """Unit-power white, pink (1/f power) or brown (1/f^2 power) noise."""
    n = _fast_size(size)
    noise = rng.standard_normal(n)
    if colour != "white":
        spectrum = np.fft.rfft(noise)
        freqs = np.maximum(np.fft.rfftfreq(n), 1.0 / n)
        noise = np.fft.irfft(spectrum / (np.sqrt(freqs) if colour == "pink" else freqs), n)
    noise = noise[:size]
    return (noise / (np.sqrt(np.mean(noise**2)) + 1e-12)).astype(np.float32)


def band_limit(audio: np.ndarray, low_hz: float, high_hz: float, *, rolloff: float = 1.3) -> np.ndarray:
    """Passes low_hz..high_hz; the gain falls as a raised cosine over a factor `rolloff` outside each edge
    (the response of a cheap microphone or a narrow channel)."""
    def gain(frequencies):
        def edge(x):  # 0 -> 1 over log-frequency distance 0..1
            return 0.5 - 0.5 * np.cos(np.pi * np.clip(x, 0.0, 1.0))
        safe = np.maximum(frequencies, 1.0)
        rise = edge(np.log(safe / (low_hz / rolloff)) / np.log(rolloff)) if low_hz > 0 else 1.0
        fall = edge(np.log(high_hz * rolloff / safe) / np.log(rolloff))
        return rise * fall
    return _fft_filter(audio, gain)


def room_impulse_response(rng: np.random.Generator, rt60_s: float, *, reflections: int = 12) -> np.ndarray:
    """A synthetic room: the direct sound, sparse early reflections over the first 5-50 ms, then a diffuse
    tail decaying 60 dB in rt60_s whose high frequencies die faster (air and wall absorption)."""
    length = max(int(rt60_s * SAMPLING_RATE), 64)
    response = np.zeros(length)
    response[0] = 1.0
    delays = rng.integers(int(0.005 * SAMPLING_RATE), min(int(0.05 * SAMPLING_RATE), length), size=reflections)
    response[delays] += rng.uniform(-0.6, 0.6, size=reflections) * np.exp(-6.9 * delays / length)
    start = int(0.01 * SAMPLING_RATE)
    tail = rng.standard_normal(length) * np.exp(-6.9 * np.arange(length) / length)
    smoothed = np.convolve(tail, np.ones(4) / 4, mode="same")  # a gentle low-pass
    mix = np.linspace(0.0, 1.0, length)  # later parts of the tail are the duller ones
    tail = (1 - mix) * tail + mix * smoothed
    tail[:start] = 0.0
    response += tail * float(rng.uniform(0.1, 0.4)) / (np.sqrt(np.sum(tail**2)) + 1e-9)
    return (response / np.sqrt(np.sum(response**2))).astype(np.float32)


def convolve(audio: np.ndarray, response: np.ndarray) -> np.ndarray:
    """`audio` through `response`, the same length (FFT convolution)."""
    n = _fast_size(audio.size + response.size - 1)
    out = np.fft.irfft(np.fft.rfft(audio, n) * np.fft.rfft(response, n), n)[: audio.size]
    return out.astype(np.float32)


def mu_law(audio: np.ndarray) -> np.ndarray:
    """G.711 mu-law: compands to 8-bit codes and back (the quantisation noise of a digital phone line)."""
    clipped = np.clip(audio, -1.0, 1.0)
    compressed = np.sign(clipped) * np.log1p(_MU * np.abs(clipped)) / np.log1p(_MU)
    codes = np.round((compressed + 1.0) * 127.5)  # 256 levels
    expanded = codes / 127.5 - 1.0
    return (np.sign(expanded) * np.expm1(np.abs(expanded) * np.log1p(_MU)) / _MU).astype(np.float32)


def telephone(audio: np.ndarray, rng: np.random.Generator, *, at_8khz: bool = False) -> np.ndarray:
    """A phone call: the voice band (300-3400 Hz), 8 kHz sampling, mu-law coding with probability 0.7. At
    16 kHz (resampled back up, as a system that upsamples its input hears it) unless `at_8khz`."""
    narrow = soxr.resample(band_limit(audio, *TELEPHONE_BAND_HZ, rolloff=1.15), SAMPLING_RATE, TELEPHONE_RATE)
    peak = float(np.max(np.abs(narrow))) + 1e-9
    level = float(rng.uniform(0.3, 0.9)) / peak  # a line's fixed-point range: scale before coding
    narrow = narrow * level
    if rng.random() < 0.7:
        narrow = mu_law(narrow)
    narrow = narrow.astype(np.float32)
    if at_8khz:
        return narrow
    return soxr.resample(narrow, TELEPHONE_RATE, SAMPLING_RATE).astype(np.float32)


def augment_sentence(audio: np.ndarray, rng: np.random.Generator, strength: float = 1.0,
                     speed_range: float = 0.1) -> tuple[np.ndarray, float]:
    """The sentence corpora's chain: speed (tape-style, +-speed_range), a synthetic room, a microphone's band,
    noise and gain. Returns the audio and its speed factor (to rescale timings)."""
    speed = 1.0
    if rng.random() < 0.6:
        speed = float(rng.uniform(1.0 - speed_range * strength, 1.0 + speed_range * strength))
        audio = change_speed(audio, speed)
    if rng.random() < 0.4 * strength:
        audio = convolve(audio, room_impulse_response(rng, rt60_s=float(rng.uniform(0.15, 0.8))))
    if rng.random() < 0.3 * strength:
        audio = band_limit(audio, low_hz=float(rng.uniform(50, 300)), high_hz=float(rng.uniform(3500, 7800)))
    if rng.random() < 0.6 * strength:
        noise = coloured_noise(audio.size, rng, str(rng.choice(["white", "pink", "brown"])))
        snr_db = float(rng.uniform(10.0, 40.0))
        audio = audio + noise * np.sqrt((np.mean(audio**2) + 1e-12) / 10 ** (snr_db / 10))
    peak = float(np.max(np.abs(audio))) + 1e-9
    return (audio * float(rng.uniform(0.05, 0.95)) / peak).astype(np.float32), speed
