"""Exact RoPE for day-long streams: angles vs float64 numpy, the half-split rotation, Llama 3 scaling."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.models.layers import apply_rope, rope_cos_sin, rope_frequencies

LONG_STREAM = 5_000_000  # ~28 h of decoder slots, ~28 h of 20 ms encoder frames at 5e6 frames


def long_positions(rng):
    special = [0, 1, 255, 256, 65535, 65536, 4_999_999, LONG_STREAM, 2**24 + 1, 2**31 - 1]
    return np.concatenate([special, rng.integers(0, LONG_STREAM, 200)]).astype(np.int32)


@pytest.mark.parametrize("head_dim,theta", [(128, 1e6), (64, 1e6), (24, 1e4)])
def test_angles_exact_at_long_positions(head_dim, theta):
    positions = long_positions(np.random.default_rng(0))
    freqs = rope_frequencies(head_dim, theta)
    cos, sin = jax.jit(lambda p: rope_cos_sin(p, freqs))(jnp.asarray(positions))
    exact = positions.astype(np.float64)[:, None] * freqs[None, :]
    half = head_dim // 2
    error = max(np.abs(np.asarray(cos)[:, :half] - np.cos(exact)).max(),
                np.abs(np.asarray(sin)[:, :half] - np.sin(exact)).max())
    print(f"head_dim {head_dim}: max |cos/sin - float64| = {error:.2e}")
    assert error <= 1e-5
    # The half-split layout repeats the angles for the second half of the head.
    np.testing.assert_array_equal(np.asarray(cos)[:, half:], np.asarray(cos)[:, :half])
    # The naive float32 product pos * freq is far off at these positions: the test would catch it.
    naive = np.cos(positions.astype(np.float32)[:, None] * freqs.astype(np.float32)[None, :])
    assert np.abs(naive - np.cos(exact)).max() > 1e-2


def test_apply_rope_rotates_half_split_pairs():
    rng = np.random.default_rng(1)
    sessions, chunk, heads, head_dim = 2, 5, 3, 16
    x = rng.standard_normal((sessions, chunk, heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, LONG_STREAM, (sessions, chunk)).astype(np.int32)
    freqs = rope_frequencies(head_dim, 1e6)
    cos, sin = rope_cos_sin(jnp.asarray(positions), freqs)
    rotated = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    # Pair i = (x[i], x[i + hd/2]) rotates by positions * freq_i, in float64.
    angle = positions.astype(np.float64)[:, :, None, None] * freqs
    first, second = x[..., : head_dim // 2].astype(np.float64), x[..., head_dim // 2 :].astype(np.float64)
    expected = np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                               second * np.cos(angle) + first * np.sin(angle)], axis=-1)
    np.testing.assert_allclose(rotated, expected, atol=2e-5)


def test_attention_scores_depend_only_on_relative_position_far_into_stream():
    rng = np.random.default_rng(2)
    head_dim = 128
    q = jnp.asarray(rng.standard_normal((1, 1, 1, head_dim)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((1, 1, 1, head_dim)).astype(np.float32))
    freqs = rope_frequencies(head_dim, 1e6)

    def score(query_pos, key_pos):
        qc, qs = rope_cos_sin(jnp.asarray([[query_pos]], jnp.int32), freqs)
        kc, ks = rope_cos_sin(jnp.asarray([[key_pos]], jnp.int32), freqs)
        return float(jnp.sum(apply_rope(q, qc, qs) * apply_rope(k, kc, ks)))

    for distance in (0, 1, 7, 749, 8191):
        near = score(10_000, 10_000 - distance)
        far = score(LONG_STREAM, LONG_STREAM - distance)
        assert abs(near - far) <= 1e-4 * max(1.0, abs(near))


def meta_llama3_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's reference `apply_scaling` (llama-models), one frequency at a time."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    scaled, regimes = [], set()
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            scaled.append(freq)
            regimes.add("high")
        elif wavelen > low_freq_wavelen:
            scaled.append(freq / factor)
            regimes.add("low")
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
            regimes.add("medium")
    return np.array(scaled), regimes


def test_llama3_rope_scaling_matches_meta_reference():
    scaling = (8.0, 1.0, 4.0, 8192)  # Llama 3.1 8B
    plain = rope_frequencies(128, 5e5)
    expected, regimes = meta_llama3_scaling(plain, *scaling)
    assert regimes == {"high", "medium", "low"}
    np.testing.assert_allclose(rope_frequencies(128, 5e5, scaling), expected, rtol=1e-12)
