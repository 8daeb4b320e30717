"""On-device sampling against a numpy statement of vLLM's filters (temperature, top-k then top-p)."""
import jax
import numpy as np
import pytest

from jaxstream.engine import sampling


def numpy_filter(logits, temperature, top_k, top_p):
    """The set of tokens vLLM may sample and their probabilities, in float64."""
    scaled = logits.astype(np.float64) / max(temperature, 1e-6)
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.shape, bool)
    k = scaled.size if top_k <= 0 else min(top_k, scaled.size)
    kept = order[:k]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep[kept[(mass_before < top_p) | (np.arange(k) == 0)]] = True
    out = np.where(keep, scaled, -np.inf)
    p = np.exp(out - out.max())
    return keep, p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.8), (2.0, 1, 1.0), (1.0, 50, 0.05),
])
def test_filtered_logits_match_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(top_k)
    logits = rng.standard_normal((3, 40)).astype(np.float32) * 3
    got = np.asarray(sampling.filtered_logits(logits, np.full(3, temperature, np.float32),
                                              np.full(3, top_k, np.int32), np.full(3, top_p, np.float32)))
    for row in range(3):
        keep, _ = numpy_filter(logits[row], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), keep)
        np.testing.assert_allclose(got[row][keep], logits[row][keep] / temperature, rtol=1e-6)


def test_sampling_frequencies_follow_the_filtered_distribution():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(12).astype(np.float32)
    draws = 20000
    rows = np.broadcast_to(logits, (draws, 12))
    tokens, logprobs = jax.jit(sampling.sample)(
        rows, np.full(draws, 0.8, np.float32), np.full(draws, 6, np.int32), np.full(draws, 0.9, np.float32),
        np.full(draws, 42, np.uint32), np.arange(draws, dtype=np.int32))
    tokens = np.asarray(tokens)
    keep, probs = numpy_filter(logits, 0.8, 6, 0.9)
    assert keep[tokens].all()
    counts = np.bincount(tokens, minlength=12) / draws
    sigma = np.sqrt(probs * (1 - probs) / draws)
    assert np.all(np.abs(counts - probs) <= 5 * sigma + 1e-9)
    log_softmax = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    np.testing.assert_allclose(np.asarray(logprobs), log_softmax[tokens], rtol=1e-5, atol=1e-5)


def test_rows_are_independent_and_seeded():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    temperature = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    args = (np.zeros(4, np.int32), np.ones(4, np.float32), np.array([5, 9, 9, 1], np.uint32),
            np.array([3, 7, 7, 2], np.int32))
    first, _ = sampling.sample(logits, temperature, *args)
    first = np.asarray(first)
    assert first[0] == logits[0].argmax() and first[3] == logits[3].argmax()
    # Row 1 alone, batched with other rows, gives the same token (same seed and position).
    alone, _ = sampling.sample(logits[1:2], temperature[1:2], *(a[1:2] for a in args))
    assert int(np.asarray(alone)[0]) == first[1]
    # Rows 1 and 2 differ only in their logits: each follows its own row.
    swapped, _ = sampling.sample(logits[[2, 1]], temperature[[1, 2]], *(a[[1, 2]] for a in args))
    assert list(np.asarray(swapped)) == [first[2], first[1]]
