"""Generate tests/fixtures/frontend_reference.npz, the extra audio front-end reference read by
tests/test_audio_frontend.py (CI never runs this script; it only reads the committed file).

Run by hand from the repository root with torch + transformers installed:

    python tests/make_frontend_fixture.py

Why a second front-end fixture next to tests/fixtures/voxtral_tiny_reference.npz: transformers computes
the STFT in float32, whose round-off reaches ~3e-5 (in normalised log-mel units) in low-power bins of
tonal audio. jaxstream computes in float64, so besides the float32 transformers output this file holds the
same transformers algorithm run in float64 (`VoxtralRealtimeFeatureExtractor._torch_extract_fbank_features`
with float64 tensors), which an exact implementation matches to ~1e-7.

Contents (features in transformers' layout (128, frames); float32 arrays):
    audio              (6400,)   synthetic: noise + a 440 Hz tone + a chirp + a digital-silence gap
    n_delay            ()        3 (240 ms), a delay the model fixtures do not use
    padded_audio       (N,)      mistral-common AudioEncoder.pad(audio, 16000, 240): 40960 zeros, audio,
                                 zeros to a multiple of 1280 plus (3 + 11) * 1280
    features_float32   (128, N/160)  VoxtralRealtimeFeatureExtractor()(padded_audio, center=True)
    features_float64   (128, N/160)  the same algorithm in float64
    short_audio        (3001,)   unpadded audio, loud at both ends (exercises the reflect padding)
    short_float32      (128, 18)
    short_float64      (128, 18)
    versions           ()        JSON string of the library versions
"""
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mistral_common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402
from transformers import VoxtralRealtimeFeatureExtractor  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE_RATE = 16000
N_DELAY = 3


def synthetic_audio(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / SAMPLE_RATE
    chirp = np.sin(2 * np.pi * (200 * t + 9000 * t**2))
    audio = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.3 * chirp * (t > 0.2) + 0.02 * rng.standard_normal(num_samples)
    audio[int(0.12 * SAMPLE_RATE) : int(0.2 * SAMPLE_RATE)] = 0.0
    return audio.astype(np.float32)


def float32_reference(fe: VoxtralRealtimeFeatureExtractor, audio: np.ndarray) -> np.ndarray:
    return fe(audio, sampling_rate=SAMPLE_RATE, center=True, return_tensors="np")["input_features"][0]


def float64_reference(fe: VoxtralRealtimeFeatureExtractor, audio: np.ndarray) -> np.ndarray:
    """`_torch_extract_fbank_features` line by line, in float64."""
    waveform = torch.from_numpy(audio.astype(np.float64))
    window = torch.hann_window(fe.n_fft, dtype=torch.float64)
    stft = torch.stft(waveform, fe.n_fft, fe.hop_length, window=window, return_complex=True, center=True)
    magnitudes = stft[..., :-1].abs() ** 2
    mel_spec = torch.from_numpy(fe.mel_filters).T @ magnitudes
    log_spec = torch.clamp(mel_spec, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, torch.tensor(fe.global_log_mel_max - 8.0, dtype=torch.float64))
    return ((log_spec + 4.0) / 4.0).numpy()


def main() -> None:
    fe = VoxtralRealtimeFeatureExtractor()
    tokenizer = MistralTokenizer.from_file(str(FIXTURES / "voxtral_tiny" / "tekken.json"))
    audio_encoder = tokenizer.instruct_tokenizer.audio_encoder
    audio = synthetic_audio(6400, seed=3)
    padded = audio_encoder.pad(audio, SAMPLE_RATE, transcription_delay_ms=80 * N_DELAY).astype(np.float32)
    assert padded.shape[0] % 1280 == 0
    short = synthetic_audio(3001, seed=4) + np.float32(0.5)  # a DC offset makes both ends loud
    arrays = {
        "audio": audio,
        "n_delay": np.array(N_DELAY),
        "padded_audio": padded,
        "features_float32": float32_reference(fe, padded),
        "features_float64": float64_reference(fe, padded).astype(np.float32),
        "short_audio": short,
        "short_float32": float32_reference(fe, short),
        "short_float64": float64_reference(fe, short).astype(np.float32),
        "versions": np.array(json.dumps({
            "torch": torch.__version__, "transformers": transformers.__version__,
            "mistral_common": mistral_common.__version__, "numpy": np.__version__,
        })),
    }
    error = np.abs(arrays["features_float32"] - arrays["features_float64"]).max()
    print(f"padded {padded.shape[0]} samples, {arrays['features_float32'].shape[1]} frames; "
          f"float32 transformers vs float64: {error:.2e}")
    np.savez_compressed(FIXTURES / "frontend_reference.npz", **arrays)


if __name__ == "__main__":
    main()
