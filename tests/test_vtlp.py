"""VTLP: the warped filterbank moves a tone where the warp function says, against the plain front end."""
import numpy as np
import pytest

from jaxstream.models import audio as front_end
from jaxstream.training import vtlp

_SECOND = np.arange(front_end.SAMPLING_RATE) / front_end.SAMPLING_RATE


def _tone_profile(frequency_hz, mel_filters=front_end.MEL_FILTERS):
    """Mean log-mel row of a one-second tone, away from the reflect-padded edges."""
    tone = 0.3 * np.sin(2 * np.pi * frequency_hz * _SECOND)
    return front_end.log_mel(tone, mel_filters=mel_filters)[20:-20].mean(axis=0)


# Tones and warps whose warped frequency also falls on an rfft bin (40 Hz apart), so both tones leak alike.
@pytest.mark.parametrize("frequency_hz, alpha", [(500, 0.88), (1000, 1.12), (2000, 1.04), (3000, 0.92)])
def test_warped_filterbank_hears_a_tone_at_the_warped_frequency(frequency_hz, alpha):
    warped_hz = float(vtlp.warp_frequency(np.array([frequency_hz]), alpha)[0])
    assert warped_hz == pytest.approx(alpha * frequency_hz)  # all below the knee
    reference = _tone_profile(warped_hz)  # oracle: the plain front end on a tone synthesized at g(f)
    warped = _tone_profile(frequency_hz, vtlp.warped_mel_filters(alpha))
    peak = int(reference.argmax())
    assert int(warped.argmax()) == peak
    near = slice(peak - 1, peak + 2)
    np.testing.assert_allclose(warped[near], reference[near], atol=0.05)
    assert np.abs(_tone_profile(frequency_hz)[near] - reference[near]).max() > 0.3  # the warp did something


@pytest.mark.parametrize("alpha", [0.85, 0.9, 1.0, 1.1, 1.15])
def test_warp_function_keeps_the_band_and_is_increasing(alpha):
    freqs = np.linspace(0.0, 8000.0, 801)
    warped = vtlp.warp_frequency(freqs, alpha)
    assert warped[0] == 0.0 and warped[-1] == pytest.approx(8000.0)
    assert np.all(np.diff(warped) > 0)
    np.testing.assert_allclose(warped[freqs <= 5000], alpha * freqs[freqs <= 5000])


def test_unit_warp_is_the_plain_filterbank_and_bad_inputs_are_refused():
    assert vtlp.warped_mel_filters(1.0) is front_end.MEL_FILTERS
    assert vtlp.warped_mel_filters(1.001) is front_end.MEL_FILTERS  # rounded to the 0.005 grid
    assert vtlp.warped_mel_filters(1.1) is vtlp.warped_mel_filters(1.1)  # cached
    with pytest.raises(ValueError, match="VTLP warp factor"):
        vtlp.warped_mel_filters(3.0)
    with pytest.raises(front_end.AudioError, match=r"mel_filters must have shape \(201, 128\)"):
        front_end.log_mel(np.zeros(4000), mel_filters=front_end.MEL_FILTERS[:, :64])
