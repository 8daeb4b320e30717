"""Audio on the wire: base64 PCM16 little-endian mono, or G.711 mu-law/A-law bytes -> float32 samples, with
strict checks.

Every way the data can be wrong raises `AudioDecodeError` with a short reason; the protocol turns it into
its `invalid_audio` error. Strict decoding (the default) rejects characters outside the base64 alphabet,
where vLLM's lax decoder silently drops them and decodes something else than the client meant; ASCII
whitespace is still allowed, because `base64.encodebytes` (and MIME encoders) wrap lines with newlines.
"""
import base64
import binascii

import numpy as np

_WHITESPACE = str.maketrans("", "", " \t\r\n")


class AudioDecodeError(ValueError):
    """Audio data the server cannot use; `str(exc)` says why, in words a client can act on."""


def decode_pcm16_base64(data: str, *, max_samples: int, strict: bool = True) -> np.ndarray:
    """base64 of PCM16 LE mono -> float32 in [-1, 1) (divided by 32768, as vLLM does).

    Rejects an empty payload, an odd byte count and more than `max_samples` samples (checked on the
    encoded length first, so an oversized payload is never decoded).
    """
    if not data:
        raise AudioDecodeError("empty audio")
    # 4 base64 characters carry 3 bytes = 1.5 samples; whitespace only makes the bound looser.
    if len(data) // 4 * 3 > 2 * max_samples + 2:
        raise AudioDecodeError(f"audio longer than {max_samples} samples in one append")
    try:
        if strict:
            raw = base64.b64decode(data.translate(_WHITESPACE), validate=True)
        else:
            raw = base64.b64decode(data)
    except (binascii.Error, ValueError) as exc:
        raise AudioDecodeError(f"bad base64 ({exc})") from None
    if not raw:
        raise AudioDecodeError("empty audio")
    if len(raw) % 2:
        raise AudioDecodeError(f"PCM16 needs an even number of bytes, got {len(raw)}")
    if len(raw) // 2 > max_samples:
        raise AudioDecodeError(f"audio longer than {max_samples} samples in one append")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def encode_pcm16_base64(samples: np.ndarray) -> str:
    """float32 in [-1, 1] -> base64 PCM16 LE (clients and tests)."""
    pcm = np.clip(np.asarray(samples, np.float32) * 32768.0, -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def _ulaw_table() -> np.ndarray:
    # ITU-T G.711 mu-law: bytes are stored inverted; magnitude = ((mantissa << 3) + bias) << exponent - bias.
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent, mantissa = (codes >> 4) & 7, codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32) / np.float32(32768.0)


def _alaw_table() -> np.ndarray:
    # ITU-T G.711 A-law: even bits inverted (0x55); the sign bit set means positive, unlike mu-law.
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    exponent, mantissa = (codes >> 4) & 7, codes & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(codes & 0x80, magnitude, -magnitude).astype(np.float32) / np.float32(32768.0)


# Byte -> float32 sample, as `audioop.ulaw2lin`/`alaw2lin` decode (audioop is deprecated and leaves in 3.13).
G711_TABLES = {"pcmu": _ulaw_table(), "pcma": _alaw_table()}


def decode_g711_base64(data: str, law: str, *, max_samples: int) -> np.ndarray:
    """base64 of 8 kHz G.711 (`law` "pcmu" or "pcma", one byte per sample) -> float32 in [-1, 1)."""
    if not data:
        raise AudioDecodeError("empty audio")
    if len(data) // 4 * 3 > max_samples + 2:
        raise AudioDecodeError(f"audio longer than {max_samples} samples in one append")
    try:
        raw = base64.b64decode(data.translate(_WHITESPACE), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioDecodeError(f"bad base64 ({exc})") from None
    if not raw:
        raise AudioDecodeError("empty audio")
    if len(raw) > max_samples:
        raise AudioDecodeError(f"audio longer than {max_samples} samples in one append")
    return G711_TABLES[law][np.frombuffer(raw, dtype=np.uint8)]
