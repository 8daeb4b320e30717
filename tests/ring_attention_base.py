"""Shared parametrised tests of `ring_attention`; each implementation subclasses `RingAttentionTestBase`
(tests/test_ring_attention.py). It lives with the tests, not in the kernel package, so that installing
jaxstream needs no pytest.

Every case builds a batch of sessions with an explicit random K/V history, fills a page pool from it with
the numpy layout rule (`reference.write_positions`), runs one `ring_attention` call and checks the output
against the dense float64 oracle over the full history and the returned pages against the numpy write.
Inputs are rounded to the test dtype first, so the oracle sees exactly the values the kernel sees.
"""
import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.tpu_kernels.ring_attention import api, reference

# On CPU each case compiles its own small programs (the Pallas interpreters' most of all) and runs them once, so
# compiling is most of its time: with XLA:CPU's LLVM at level 0, test_ring_attention.py took 126 s instead of 158
# on 2 cores (session 52). Only here: the suite-wide flag made the engines' steps too slow for the serve tests'
# deadlines.
FAST_COMPILE = {"xla_backend_optimization_level": 0}

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


def with_history(case, args, history, k_history, v_history):
    """`args`/`history` of `build` redone for other histories of the same sessions: pools written from them
    (over the pools as built) and the chunk rows taken from them."""
    lengths = history["lengths"]
    history = dict(history, k_history=k_history, v_history=v_history)
    args = dict(args)
    dtype = args["q"].dtype
    for name, hist in (("k", k_history), ("v", v_history)):
        history[f"{name}_pool"] = reference.write_positions(history[f"{name}_pool"], history["page_table"], hist,
                                                            np.zeros_like(lengths), lengths)
        args[f"{name}_pages"] = jnp.asarray(history[f"{name}_pool"], dtype)
        args[f"{name}_new"] = jnp.asarray(np.stack([hist[s, lengths[s]: lengths[s] + case.chunk]
                                                    for s in range(len(lengths))]), dtype)
    return args, history


class RingAttentionTestBase:
    """Subclasses set `implementation` and `interpret`, and may narrow the sweep with `dtypes` and drop the
    reach cases (`reach_cases`: the XLA path's buckets; a Pallas kernel runs them once, in one interpreter)
    and the fp8 pages (`takes_fp8_pages`: the C++ kernel takes float32 pages only).
    `hides_visible_non_finite`: the Pallas kernels zero every non-finite value, even one a query can see (the
    op's one documented difference from the float64 oracle, api.ring_attention). `marks_whole_heads`: a
    query head that sees one is non-finite in its whole output, not only where the oracle is (the XLA path's
    chunks)."""

    implementation = None
    interpret = False
    dtypes = ("float32", "bfloat16")
    reach_cases = True
    tolerance = TOLERANCE
    hides_visible_non_finite = False
    marks_whole_heads = False
    takes_fp8_pages = True

    def run(self, args, window, **kwargs):
        op = functools.partial(api.ring_attention, window=window, implementation=self.implementation,
                               interpret=self.interpret, **kwargs)
        # On an accelerator the production compile is what is under test.
        return jax.jit(op, compiler_options=FAST_COMPILE if jax.default_backend() == "cpu" else None)(**args)

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

    @pytest.mark.parametrize("page_dtype", ["float8_e4m3fn", "float8_e5m2"])
    def test_fp8_pages_match_dense_oracle_over_the_stored_values(self, page_dtype):
        """float32 queries and new keys/values over fp8 pages (an fp8 KV cache): the output is the float64
        oracle's over the whole history as fp8 stores it, the chunk's own rows included (rounded before they are
        attended to, not only when written), and the pages after the write hold the chunk rounded to fp8. (Decode
        steps over fp8 pages: tests/test_kv_cache_dtype.py's engine.)"""
        case_name = "paged_prefill_wrap"  # chunks that wrap the ring, a fresh prompt longer than it, an idle session
        case = CASES[case_name]
        if not self.takes_fp8_pages:
            pytest.skip("this implementation refuses pages other than float32")
        args, history = build(case, "float32", seed=zlib.crc32(f"{case_name}/{page_dtype}".encode()))
        stored = {name: round_to(history[f"{name}_history"], page_dtype) for name in ("k", "v")}
        rounded_args, rounded = with_history(case, args, history, stored["k"], stored["v"])
        args = dict(args, k_pages=rounded_args["k_pages"].astype(page_dtype),
                    v_pages=rounded_args["v_pages"].astype(page_dtype))  # k_new / v_new stay unrounded
        out, k_pages, v_pages = self.run(args, case.window, scale=case.scale)
        assert out.dtype == jnp.float32 and k_pages.dtype == v_pages.dtype == jnp.dtype(page_dtype)
        expected = reference.dense_attention(history["q"], stored["k"], stored["v"], history["lengths"],
                                             history["num_new"], window=case.window, scale=case.scale)
        valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
        np.testing.assert_allclose(np.asarray(out)[valid], expected[valid], atol=self.tolerance["float32"],
                                   rtol=self.tolerance["float32"])
        stop = history["lengths"] + history["num_new"]
        for name, written in (("k", k_pages), ("v", v_pages)):
            expected_pool = reference.write_positions(rounded[f"{name}_pool"], history["page_table"], stored[name],
                                                      history["lengths"], stop)
            np.testing.assert_array_equal(np.asarray(written.astype(jnp.float32)), round_to(expected_pool, page_dtype))

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

    @pytest.mark.parametrize("page_size", [80, 96])
    def test_pages_longer_than_a_key_block(self, page_size):
        """Pages longer than the portable kernel's 64-key steps but not a whole number of them (its last step
        over a page is a partial one), against the oracle; where a kernel cannot take such pages (Triton:
        powers of two), the dispatcher's reason skips it."""
        case = Case(lengths=(0, 150, 70, 300), num_new=(3, 1, 2, 1), chunk=3, window=130, page_size=page_size,
                    group=3, head_dim=64)
        args, _ = build(case, self.dtypes[0], seed=page_size)
        try:
            api.choose_implementation(args["k_pages"], implementation=self.implementation, interpret=self.interpret)
        except ValueError as reason:
            pytest.skip(str(reason))
        self.check_against_oracle(case, self.dtypes[0], seed=page_size)

    @pytest.mark.parametrize("group", [1, 4])
    def test_a_value_a_query_cannot_see_never_reaches_it(self, group):
        """Non-finite keys and values at positions some queries of a chunk see and others do not: an old
        position that slid out of the later queries' windows, chunk rows after the earlier queries. A query
        that cannot see one matches the float64 oracle (a zero probability must not turn it into 0 x NaN,
        whatever other queries of its block see); one that can is non-finite where the oracle is, except in
        the kernels that zero every non-finite value (`hides_visible_non_finite`). Windows of two pages, or one
        where a kernel takes no 8-entry page (Triton)."""
        dtype = self.dtypes[0]
        case = Case(lengths=(40, 9), num_new=(4, 3), chunk=4, window=16, page_size=8, group=group, head_dim=16,
                    shuffled=False)
        args, history = build(case, dtype, seed=zlib.crc32(f"unseen/{group}".encode()))
        if api.unsupported_reason(self.implementation, args["k_pages"], interpret=self.interpret):
            case = dataclasses.replace(case, page_size=16)
            args, history = build(case, dtype, seed=zlib.crc32(f"unseen/{group}".encode()))
        k_history, v_history = history["k_history"].copy(), history["v_history"].copy()
        # Session 0's queries (positions 40..43) see positions 25 + i .. 40 + i.
        v_history[0, 25, 0, 3] = np.nan  # query 0 alone sees it
        k_history[0, 26, 0] = np.nan  # queries 0 and 1: every output element of KV head 0's query heads
        v_history[0, 43, 0, 5] = np.nan  # the chunk's last row: query 3 alone
        v_history[1, 10, 1, 0] = np.inf  # session 1's chunk row 1: its queries 1 and 2, not query 0
        args, history = with_history(case, args, history, k_history, v_history)
        out, _, _ = self.run(args, case.window)
        expected = reference.dense_attention(history["q"], k_history, v_history, history["lengths"],
                                             history["num_new"], window=case.window)
        out = np.asarray(out.astype(jnp.float32))
        valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
        out, expected = out[valid], expected[valid]
        clean = np.isfinite(expected)
        assert not clean.all() and clean.any()  # the case has both
        if self.marks_whole_heads:
            np.testing.assert_array_equal(np.isfinite(out).all(-1), clean.all(-1))
            clean = np.broadcast_to(clean.all(-1, keepdims=True), clean.shape)
        elif not self.hides_visible_non_finite:
            np.testing.assert_array_equal(np.isfinite(out), clean)
        np.testing.assert_allclose(out[clean], expected[clean], atol=self.tolerance[dtype], rtol=self.tolerance[dtype])

    def test_writes_through_an_entry_outside_the_pool_are_dropped(self):
        """A page-table entry outside [0, num_pages) is out of contract; the shared scatter once wrote through a
        negative one into the page counted from the end of the pool (jnp indexing), which may be another
        session's. Now such rows are dropped: every page of the pool after the call equals the one before,
        except for the rows written through valid entries (oracle: the layout rule, row by row, in numpy)."""
        dtype = self.dtypes[0]
        # W = 24, pages of 16 (P = 2, R = 32). Session 0 writes 2..5 into logical page 0; 1 writes 30, 31 into
        # logical page 1 and 32, 33 into 0; 2 writes 31 into 1 and 32, 33 into 0; 3 writes 64..67 into 0.
        case = Case(lengths=(2, 30, 31, 64), num_new=(4, 4, 3, 4), chunk=4, window=24, page_size=16, group=4,
                    head_dim=64)
        args, history = build(case, dtype, seed=zlib.crc32(b"bad write entries"))
        num_pages = args["k_pages"].shape[0]
        table = history["page_table"].copy()
        # From the end (the last page), the most negative in range (page 0), past the end, before the start;
        # session 1 keeps a valid logical page 1, session 2 loses only that one.
        table[0, 0], table[1, 0], table[2, 1], table[3, 0] = -1, -num_pages, num_pages, -num_pages - 3
        args["page_table"] = jnp.asarray(table)
        _, k_pages, v_pages = self.run(args, case.window)
        for name, written in (("k", k_pages), ("v", v_pages)):
            expected = history[f"{name}_pool"].copy()
            for s, length in enumerate(history["lengths"]):
                for p in range(length, length + history["num_new"][s]):
                    page = table[s, (p // case.page_size) % table.shape[1]]
                    if 0 <= page < num_pages:
                        expected[page, :, p % case.page_size] = history[f"{name}_history"][s, p]
            assert (expected != history[f"{name}_pool"]).any(), "the case writes some rows"
            np.testing.assert_array_equal(np.asarray(written.astype(jnp.float32)), expected,
                                          err_msg=f"{name}_pages after a call with entries outside the pool")
