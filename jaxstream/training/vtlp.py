"""Vocal tract length perturbation (VTLP): a training-time warp of the frequency axis, applied through the filterbank.

A longer or shorter vocal tract scales every formant by about the same factor. Warping the frequencies that
the mel filterbank reads by a random factor alpha per utterance (Jaitly & Hinton, 2013) shows the model the
same words from voices it was never given; the held-out voices the tiny model gets wrong are the ones whose
formants, pitch and consonant spectra lie outside the training variants'.

The warp g is Kaldi's piecewise-linear VTLN function: g(f) = alpha * f up to a knee, then a straight line
to the Nyquist frequency, so the whole 0-8 kHz band stays in range. The warped filterbank reads the power
at frequency g(f) where the plain one reads it at f: a tone at f comes out of the warped filterbank as a
tone at g(f) comes out of the plain one.
"""
import functools

import numpy as np

from jaxstream.models import audio as front_end

_NYQUIST = front_end.SAMPLING_RATE / 2
_BIN_HZ = front_end.SAMPLING_RATE / front_end.WINDOW_SIZE  # 40 Hz between rfft bins
_KNEE = 0.85  # of the Nyquist frequency, for alpha = 1 (the knee moves with alpha so g stays monotonic)
_ALPHA_STEP = 0.005  # warped filterbanks are cached on this grid of alphas
ALPHA_LIMITS = (0.5, 2.0)  # the warp factors `warped_mel_filters` accepts


def warp_frequency(freqs_hz: np.ndarray, alpha: float) -> np.ndarray:
    """g(f): alpha * f below the knee, then linear so that g(Nyquist) = Nyquist."""
    knee = _KNEE * _NYQUIST * min(alpha, 1.0) / alpha
    above = _NYQUIST - (_NYQUIST - alpha * knee) / (_NYQUIST - knee) * (_NYQUIST - freqs_hz)
    return np.where(freqs_hz <= knee, alpha * freqs_hz, above)


@functools.lru_cache(maxsize=256)
def _warped_on_grid(step_index: int) -> np.ndarray:
    alpha = step_index * _ALPHA_STEP
    filters = front_end.MEL_FILTERS
    position = warp_frequency(np.arange(filters.shape[0]) * _BIN_HZ, alpha) / _BIN_HZ
    low = np.clip(np.floor(position).astype(int), 0, filters.shape[0] - 2)
    fraction = (position - low)[:, None]
    warped = (1.0 - fraction) * filters[low] + fraction * filters[low + 1]
    warped.setflags(write=False)
    return warped


def warped_mel_filters(alpha: float) -> np.ndarray:
    """The [201, 128] mel filterbank read at g(f) (linear interpolation between rfft bins); alpha is rounded
    to a multiple of 0.005 and the result cached. alpha = 1 returns the plain filterbank."""
    low, high = ALPHA_LIMITS
    if not low <= alpha <= high:
        raise ValueError(f"VTLP warp factor must lie in [{low}, {high}], got {alpha}")
    step_index = int(round(alpha / _ALPHA_STEP))
    if step_index == round(1.0 / _ALPHA_STEP):
        return front_end.MEL_FILTERS
    return _warped_on_grid(step_index)
