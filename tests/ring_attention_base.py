"""Shared parametrised tests of `ring_attention`; each implementation subclasses `RingAttentionTestBase`
(tests/test_ring_attention.py). It lives with the tests, not in the kernel package, so that installing
jaxstream needs no pytest.

Every case builds a batch of sessions with an explicit random K/V history, fills a page pool from it with
the numpy layout rule (`reference.write_positions`), runs one `ring_attention` call and checks the output
against the dense float64 oracle over the full history and the returned pages against the numpy write.
Inputs are rounded to the test dtype first, so the oracle sees exactly the values the kernel sees.
"""
import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.tpu_kernels.ring_attention import api, reference

TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}
# f32 dots on accelerators may run as TF32 or bf16 passes.
ACCELERATOR_TOLERANCE = {"float32": 5e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: lengths/num_new per session; pages_per_window = ceil(window / page_size)."""

    lengths: tuple
    num_new: tuple
    chunk: int
    window: int
    page_size: int
    group: int
    head_dim: int
    num_kv_heads: int = 2
    shuffled: bool = True
    scale: float | None = None


# Each case mixes several edge cases in one batch (one compile per case and backend keeps CI fast).
CASES = {
    # page_size = W: one fixed ring per session. Empty (0, 0), first token, L = W, L = W + 1, L >> W.
    "fixed_ring_decode": Case(lengths=(0, 0, 16, 17, 100), num_new=(0, 1, 1, 1, 1), chunk=1, window=16,
                              page_size=16, group=4, head_dim=64, shuffled=False),
    # W = 33 with pages of 16 (R = 48): a fresh prompt longer than W and R, a chunk crossing the wrap point
    # (45..51), C > R after a long history, an idle session, and a short padded chunk whose window starts
    # on the last entry of a page (the visited page range must not drop that page).
    "paged_prefill_wrap": Case(lengths=(0, 45, 100, 3, 47), num_new=(64, 7, 64, 0, 5), chunk=64, window=33,
                               page_size=16, group=1, head_dim=128),
    # page_size divides W = R; G = 8; L = W, W + 1, L >> W and an idle long session.
    "paged_decode_gqa8": Case(lengths=(0, 5, 32, 33, 250), num_new=(1, 1, 1, 1, 0), chunk=1, window=32,
                              page_size=16, group=8, head_dim=128, num_kv_heads=1),
    # A training-sized chunk (C > 2 x the XLA path's query block, ending in a partial block) after a short
    # history, a long one, a fresh stream and a padded tail; W = 40 with pages of 16 (R = 48).
    "long_chunk_blocks": Case(lengths=(0, 17, 130, 9), num_new=(150, 150, 150, 100), chunk=150, window=40,
                              page_size=16, group=2, head_dim=64),
    # W = 24 with pages of 16 (R = 32): chunks of 4 crossing the wrap (30..33, 31..33), a page boundary.
    # An explicit softmax scale.
    "paged_chunk_gqa4": Case(lengths=(2, 30, 31, 64), num_new=(4, 4, 3, 4), chunk=4, window=24, page_size=16,
                             group=4, head_dim=64, scale=0.3),
}

# The XLA path gathers only the old positions a batch can reach, in static buckets picked per batch by its
# longest visible history, min(length, W - 1) over sessions with new rows (xla.reach_buckets: 64, 128, 256,
# 512 and 599 old positions for W = 600); the Pallas kernels visit only the pages holding such positions. One
# batch per bucket edge, checked on every implementation (R = 640, so lengths past 640 have wrapped).
REACH_CASES = {
    # The smallest bucket's edge (64 positions) beside a first token and a short history.
    "reach_smallest": Case(lengths=(64, 0, 3), num_new=(1, 1, 1), chunk=1, window=600, page_size=128, group=4,
                           head_dim=64, num_kv_heads=1),
    # One past it, with a two-token chunk: the second bucket.
    "reach_past_smallest": Case(lengths=(65, 20), num_new=(2, 1), chunk=2, window=600, page_size=128, group=2,
                                head_dim=64, num_kv_heads=2),
    # Exactly the first bucket's edge (256 positions) beside an empty session, a first token, and idle
    # sessions (num_new = 0) whose long, wrapped histories must neither widen the reach nor show in their
    # (zero) outputs.
    "reach_at_edge": Case(lengths=(256, 0, 1, 700, 300), num_new=(1, 1, 1, 0, 0), chunk=1, window=600,
                          page_size=128, group=4, head_dim=64, num_kv_heads=1),
    # One past it: the second bucket.
    "reach_past_edge": Case(lengths=(257, 10, 255), num_new=(1, 1, 1), chunk=1, window=600, page_size=128,
                            group=4, head_dim=64, num_kv_heads=1),
    # One long wrapped session among short ones takes the whole window; L = W - 1, W, W + 1 beside it.
    "reach_mixed_long_short": Case(lengths=(2000, 5, 599, 600, 601, 0), num_new=(1, 1, 1, 1, 1, 1), chunk=1,
                                   window=600, page_size=128, group=4, head_dim=64, num_kv_heads=1),
    # A chunk longer than two query blocks in the middle bucket (512 < W - 1): later blocks see only the
    # tail of the gathered history.
    "reach_chunk_mid_bucket": Case(lengths=(400, 3), num_new=(150, 120), chunk=150, window=600, page_size=128,
                                   group=1, head_dim=64, num_kv_heads=1),
}


def round_to(x, dtype):
    """float32 numpy values exactly representable in `dtype`."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def build(case, dtype, seed, garbage=None):
    """Random inputs of `case`: the jnp arguments of ring_attention and the numpy history behind them.
    `garbage` (e.g. NaN) fills every page entry never written and every padding row, instead of noise."""
    rng = np.random.default_rng(seed)
    sessions = len(case.lengths)
    lengths = np.asarray(case.lengths, np.int32)
    num_new = np.asarray(case.num_new, np.int32)
    pages_per_window = -(-case.window // case.page_size)
    heads, dim = case.num_kv_heads, case.head_dim
    history_len = int(max(lengths)) + case.chunk
    k_history = round_to(rng.standard_normal((sessions, history_len, heads, dim)), dtype)
    v_history = round_to(rng.standard_normal((sessions, history_len, heads, dim)), dtype)
    q = round_to(rng.standard_normal((sessions, case.chunk, heads * case.group, dim)), dtype)

    # Page 0 is the null page; every page starts as garbage, so any unmasked stale entry shows up.
    num_pages = 1 + sessions * pages_per_window + 2
    physical = rng.permutation(np.arange(1, num_pages)) if case.shuffled else np.arange(1, num_pages)
    page_table = np.zeros((sessions, pages_per_window), np.int32)
    for s in range(sessions):
        used = min(pages_per_window, -(-int(lengths[s] + num_new[s]) // case.page_size))
        page_table[s, :used] = physical[s * pages_per_window: s * pages_per_window + used]
    k_pool = round_to(rng.standard_normal((num_pages, heads, case.page_size, dim)), dtype)
    v_pool = round_to(rng.standard_normal((num_pages, heads, case.page_size, dim)), dtype)
    if garbage is not None:
        k_pool, v_pool = np.full_like(k_pool, garbage), np.full_like(v_pool, garbage)
        k_history, v_history = k_history.copy(), v_history.copy()
        padding = np.arange(history_len)[None, :] >= (lengths + num_new)[:, None]
        k_history[padding], v_history[padding] = garbage, garbage
    start = np.zeros_like(lengths)
    k_pool = reference.write_positions(k_pool, page_table, k_history, start, lengths)
    v_pool = reference.write_positions(v_pool, page_table, v_history, start, lengths)
    k_new = np.stack([k_history[s, lengths[s]: lengths[s] + case.chunk] for s in range(sessions)])
    v_new = np.stack([v_history[s, lengths[s]: lengths[s] + case.chunk] for s in range(sessions)])
    args = dict(q=q, k_new=k_new, v_new=v_new, k_pages=k_pool, v_pages=v_pool)
    args = {name: jnp.asarray(x, dtype) for name, x in args.items()}
    args.update(page_table=jnp.asarray(page_table), lengths=jnp.asarray(lengths), num_new=jnp.asarray(num_new))
    history = dict(q=q, k_history=k_history, v_history=v_history, k_pool=k_pool, v_pool=v_pool,
                   page_table=page_table, lengths=lengths, num_new=num_new)
    return args, history


class RingAttentionTestBase:
    """Subclasses set `implementation` and `interpret`, and may narrow the sweep with `dtypes` and drop the
    reach cases (`reach_cases`: the XLA path's buckets; a Pallas kernel runs them once, in one interpreter)."""

    implementation = None
    interpret = False
    dtypes = ("float32", "bfloat16")
    reach_cases = True
    tolerance = TOLERANCE

    def run(self, args, window, **kwargs):
        return api.ring_attention(**args, window=window, implementation=self.implementation,
                                  interpret=self.interpret, **kwargs)

    @pytest.mark.parametrize("case_name", sorted(CASES))
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_matches_dense_oracle(self, case_name, dtype):
        if dtype not in self.dtypes:
            pytest.skip(f"{dtype} is covered by another backend class")
        self.check_against_oracle(CASES[case_name], dtype, seed=zlib.crc32(f"{case_name}/{dtype}".encode()))

    @pytest.mark.parametrize("case_name", sorted(REACH_CASES))
    def test_reach_edges_match_dense_oracle(self, case_name):
        """Every reach bucket edge, in the first dtype of the class (the dtype sweep is above)."""
        if not self.reach_cases:
            pytest.skip("the generic-interpreter class of this kernel runs the reach cases")
        self.check_against_oracle(REACH_CASES[case_name], self.dtypes[0], seed=zlib.crc32(case_name.encode()))

    def check_against_oracle(self, case, dtype, seed):
        args, history = build(case, dtype, seed=seed)
        out, k_pages, v_pages = self.run(args, case.window, scale=case.scale)
        assert out.shape == args["q"].shape and out.dtype == args["q"].dtype

        expected = reference.dense_attention(history["q"], history["k_history"], history["v_history"],
                                             history["lengths"], history["num_new"], window=case.window,
                                             scale=case.scale)
        out = np.asarray(out.astype(jnp.float32))
        assert np.all(np.isfinite(out)), "padding or empty rows must stay finite"
        valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
        np.testing.assert_allclose(out[valid], expected[valid], atol=self.tolerance[dtype], rtol=self.tolerance[dtype])
        assert np.all(out[history["num_new"] == 0] == 0), "a session without new rows outputs zeros"

        stop = history["lengths"] + history["num_new"]
        for name, pool, written in (("k", history["k_pool"], k_pages), ("v", history["v_pool"], v_pages)):
            expected_pool = reference.write_positions(pool, history["page_table"], history[f"{name}_history"],
                                                      history["lengths"], stop)
            np.testing.assert_array_equal(np.asarray(written.astype(jnp.float32)), expected_pool,
                                          err_msg=f"{name}_pages after the write")

    @pytest.mark.parametrize("case_name", ["paged_prefill_wrap", "fixed_ring_decode"])
    def test_stale_nan_never_reaches_the_output(self, case_name):
        """NaN in every unwritten page entry, the null page and the padding rows (what a bad input once
        left behind) must not change any output: masked entries are selected away, not multiplied by 0."""
        dtype = self.dtypes[0]
        case = CASES[case_name]
        args, history = build(case, dtype, seed=zlib.crc32(case_name.encode()), garbage=np.nan)
        out, _, _ = self.run(args, case.window, scale=case.scale)
        expected = reference.dense_attention(history["q"], history["k_history"], history["v_history"],
                                             history["lengths"], history["num_new"], window=case.window,
                                             scale=case.scale)
        out = np.asarray(out.astype(jnp.float32))
        valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
        np.testing.assert_allclose(out[valid], expected[valid], atol=self.tolerance[dtype], rtol=self.tolerance[dtype])
        empty = (history["lengths"] == 0) & (history["num_new"] == 0)
        assert np.all(out[empty] == 0), "an empty session outputs zeros"
