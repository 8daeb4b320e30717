"""Light, cheap audio augmentation in numpy: speed, gain, room reverb and background noise."""
import numpy as np
import soxr

SAMPLING_RATE = 16000


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
