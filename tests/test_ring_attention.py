"""ring_attention: every implementation against the dense float64 oracle (shared test base), streaming
through several calls, the dispatcher, input validation and in-place writes under donation.

Pallas kernels run in the CPU interpreters: the generic one (interpret=True, Triton-style specs) and the
TPU one (pltpu.InterpretParams: SMEM/VMEM, DMA, race detection on two simulated cores).
"""
import functools
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jaxstream.tpu_kernels import ring_attention
from jaxstream.tpu_kernels.ring_attention import api, cpu, pallas_common, positions, reference, xla

from ring_attention_base import ACCELERATOR_TOLERANCE, CASES, REACH_CASES, Case, RingAttentionTestBase, build

BACKEND = jax.default_backend()


class TestXla(RingAttentionTestBase):
    implementation = "xla"
    marks_whole_heads = True


class TestCpu(RingAttentionTestBase):
    """The C++ kernel (float32 only: other dtypes take the XLA path)."""
    implementation = "cpu"
    dtypes = ("float32",)
    takes_fp8_pages = False


class TestPallasInterpret(RingAttentionTestBase):
    """bfloat16, as the GPU runs it (float32: TestPallasTpuInterpreter, the same kernel)."""
    implementation = "pallas"
    interpret = True
    dtypes = ("bfloat16",)
    hides_visible_non_finite = True


class TestPallasTpuInterpreter(RingAttentionTestBase):
    implementation = "pallas"
    interpret = pltpu.InterpretParams()
    dtypes = ("float32",)
    reach_cases = False
    hides_visible_non_finite = True


class TestPallasTpuKernelInterpret(RingAttentionTestBase):
    implementation = "pallas_tpu"
    interpret = True
    dtypes = ("bfloat16",)
    hides_visible_non_finite = True


class TestPallasTpuKernelTpuInterpreter(RingAttentionTestBase):
    implementation = "pallas_tpu"
    interpret = pltpu.InterpretParams()
    dtypes = ("float32",)
    reach_cases = False
    hides_visible_non_finite = True


@pytest.mark.gpu
@pytest.mark.tpu
@pytest.mark.skipif(BACKEND not in ("gpu", "tpu"), reason="needs a GPU or TPU (e.g. JAX_PLATFORMS=cuda pytest ...)")
class TestCompiledOnAccelerator(RingAttentionTestBase):
    """The kernel the dispatcher picks on this accelerator, compiled (Triton on GPU, Mosaic on TPU)."""

    implementation = {"tpu": "pallas_tpu", "gpu": "pallas"}.get(BACKEND)
    tolerance = ACCELERATOR_TOLERANCE
    hides_visible_non_finite = True


@pytest.mark.parametrize("implementation", ["pallas", "pallas_tpu"])
def test_tpu_interpreter_detects_no_races(implementation):
    """Both kernels on two simulated TPU cores with race detection: a decode row, a chunk crossing the
    wrap point and an idle session, split over the parallel grid axes."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    except ImportError:
        pytest.skip("this jax does not expose the TPU interpreter's race state")
    case = Case(lengths=(30, 7, 40), num_new=(4, 1, 0), chunk=4, window=24, page_size=16, group=2, head_dim=64)
    args, history = build(case, "float32", seed=5)
    interpret = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    out, _, _ = jax.block_until_ready(ring_attention(**args, window=case.window, implementation=implementation,
                                                     interpret=interpret))
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    expected = reference.dense_attention(history["q"], history["k_history"], history["v_history"],
                                         history["lengths"], history["num_new"], window=case.window)
    valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
    np.testing.assert_allclose(np.asarray(out)[valid], expected[valid], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation,interpret", [("xla", False), ("cpu", False), ("pallas_tpu", True)])
def test_stream_of_calls_matches_dense(implementation, interpret):
    """Chunked prefill then decode through the API, pages allocated on first use from a shuffled free
    list and the returned pages fed back: every step matches dense attention over the whole history."""
    window, page_size, chunk, group, head_dim, sessions = 10, 4, 6, 2, 16, 2
    pages_per_window = -(-window // page_size)
    rng = np.random.default_rng(11)
    total = 30
    k_history = rng.standard_normal((sessions, total + chunk, 1, head_dim)).astype(np.float32)
    v_history = rng.standard_normal((sessions, total + chunk, 1, head_dim)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, 1 + sessions * pages_per_window)))
    page_table = np.zeros((sessions, pages_per_window), np.int32)
    k_pages = jnp.asarray(rng.standard_normal((1 + len(free), 1, page_size, head_dim)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((1 + len(free), 1, page_size, head_dim)), jnp.float32)
    lengths = np.zeros(sessions, np.int32)
    call = functools.partial(ring_attention, window=window, implementation=implementation, interpret=interpret)
    # Session 1 starts two steps late and prefills in shorter chunks.
    plan = [((6, 0), chunk), ((6, 0), chunk), ((5, 4), chunk), ((1, 4), chunk), ((1, 4), chunk)]
    plan += [((1, 1), 1)] * 9
    for num_new, size in plan:
        num_new = np.asarray(num_new, np.int32)
        for s in range(sessions):
            for p in range(lengths[s], lengths[s] + num_new[s]):
                logical = (p // page_size) % pages_per_window
                if p < pages_per_window * page_size and p % page_size == 0:
                    page_table[s, logical] = free.pop()
        q = rng.standard_normal((sessions, size, group, head_dim)).astype(np.float32)
        new = [np.stack([h[s, lengths[s]: lengths[s] + size] for s in range(sessions)]) for h in (k_history, v_history)]
        out, k_pages, v_pages = call(jnp.asarray(q), jnp.asarray(new[0]), jnp.asarray(new[1]), k_pages, v_pages,
                                     jnp.asarray(page_table), jnp.asarray(lengths), jnp.asarray(num_new))
        expected = reference.dense_attention(q, k_history, v_history, lengths, num_new, window=window)
        valid = np.arange(size)[None, :] < num_new[:, None]
        np.testing.assert_allclose(np.asarray(out)[valid], expected[valid], atol=2e-5, rtol=2e-5)
        lengths = lengths + num_new
    assert lengths.tolist() == [28, 21]


@pytest.mark.parametrize("implementation,interpret", [("xla", False), ("cpu", False), ("pallas", True)])
def test_nan_queries_leave_the_writes_intact(implementation, interpret):
    """The write is ordered after the attention through the output; NaN there must not leak into pages."""
    case = CASES["paged_chunk_gqa4"]
    args, history = build(case, "float32", seed=3)
    args["q"] = args["q"].at[0].set(jnp.nan)
    _, k_pages, v_pages = ring_attention(**args, window=case.window, scale=case.scale,
                                         implementation=implementation, interpret=interpret)
    stop = history["lengths"] + history["num_new"]
    for name, written in (("k", k_pages), ("v", v_pages)):
        expected = reference.write_positions(history[f"{name}_pool"], history["page_table"],
                                             history[f"{name}_history"], history["lengths"], stop)
        np.testing.assert_array_equal(np.asarray(written), expected)


# Every implementation that runs on a CPU host: XLA, the C++ kernel, both Pallas kernels in both interpreters.
ON_CPU = [("xla", False), ("cpu", False), ("pallas", True), ("pallas", pltpu.InterpretParams()), ("pallas_tpu", True),
          ("pallas_tpu", pltpu.InterpretParams())]


@pytest.mark.parametrize("implementation,interpret", ON_CPU)
def test_num_new_past_the_chunk_counts_as_the_chunk(implementation, interpret):
    """num_new > C is out of contract but traced (not validated): every implementation takes it as C, in its
    output and in its write. The write once applied its last-R-rows rule to the unclipped count, dropping
    every row from C + R on, rows the kernels had attended to (R = 8 here)."""
    case = Case(lengths=(0, 30, 5), num_new=(4, 4, 4), chunk=4, window=8, page_size=4, group=2, head_dim=16)
    args, history = build(case, "float32", seed=7)
    args["num_new"] = jnp.asarray([5, 12, 40], jnp.int32)
    out, k_pages, v_pages = ring_attention(**args, window=case.window, implementation=implementation,
                                           interpret=interpret)
    expected = reference.dense_attention(history["q"], history["k_history"], history["v_history"],
                                         history["lengths"], history["num_new"], window=case.window)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)
    stop = history["lengths"] + case.chunk
    for name, written in (("k", k_pages), ("v", v_pages)):
        np.testing.assert_array_equal(np.asarray(written), reference.write_positions(
            history[f"{name}_pool"], history["page_table"], history[f"{name}_history"], history["lengths"], stop))


# Runs one ring_attention call from an .npz of its arguments in a process of its own (a kernel that reads
# outside the pool may crash it) and saves the output.
_CALL_IN_A_PROCESS = """
import sys
import jax.numpy as jnp
import numpy as np
from jaxstream.tpu_kernels.ring_attention import api
arguments = dict(np.load(sys.argv[1]))
window = int(arguments.pop("window"))
out, _, _ = api.ring_attention(**{name: jnp.asarray(x) for name, x in arguments.items()}, window=window,
                               implementation=sys.argv[3])
np.save(sys.argv[2], np.asarray(out))
"""


@pytest.mark.parametrize("implementation,interpret", ON_CPU)
def test_out_of_range_page_entries_read_as_xla_reads_them(implementation, interpret, tmp_path):
    """Page-table entries are promised valid but traced, so not checked: one outside the pool must not read
    memory past it (the C++ kernel read garbage, or crashed the process). Every implementation reads such an
    entry as XLA's gather does: counted from the end of the pool when negative, then clamped into the pool.
    Oracle: the float64 dense attention over the history those pages hold. The C++ kernel runs in a process of
    its own, so that a crash is a failure here, not a dead test run."""
    # Every session's queries see its logical page 0 (positions 0-15 of session 0, 16-31 of 1 and 2, 32-47 of 3).
    case = Case(lengths=(2, 30, 31, 64), num_new=(4, 4, 3, 4), chunk=4, window=24, page_size=16, group=4,
                head_dim=64)
    args, history = build(case, "float32", seed=9)
    num_pages = args["k_pages"].shape[0]
    table = history["page_table"].copy()
    table[:, 0] = [num_pages, 2**31 - 1, -1, -num_pages - 5]  # Past the end, far past it, from the end, before.
    read = np.clip(np.where(table < 0, table + num_pages, table), 0, num_pages - 1)
    assert read[:, 0].tolist() == [num_pages - 1, num_pages - 1, num_pages - 1, 0]
    args["page_table"] = jnp.asarray(table)
    if implementation == "cpu":
        api.choose_implementation(args["k_pages"], implementation="cpu")  # built here; the process finds it
        np.savez(tmp_path / "arguments.npz", window=case.window, **{k: np.asarray(v) for k, v in args.items()})
        done = subprocess.run([sys.executable, "-c", _CALL_IN_A_PROCESS, str(tmp_path / "arguments.npz"),
                               str(tmp_path / "out.npy"), implementation], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"the call exited with {done.returncode}: {done.stderr[-2000:]}"
        out = np.load(tmp_path / "out.npy")
    else:
        out, _, _ = ring_attention(**args, window=case.window, implementation=implementation, interpret=interpret)
    # The history the pages hold as they are read: each old position of the window from the page it is read from.
    k_history, v_history = history["k_history"].copy(), history["v_history"].copy()
    ring = table.shape[1] * case.page_size
    for s, length in enumerate(history["lengths"]):
        for p in range(max(0, length - ring), length):
            page = read[s, (p // case.page_size) % table.shape[1]]
            k_history[s, p], v_history[s, p] = history["k_pool"][page, :, p % case.page_size], \
                history["v_pool"][page, :, p % case.page_size]
    expected = reference.dense_attention(history["q"], k_history, v_history, history["lengths"], history["num_new"],
                                         window=case.window)
    valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
    np.testing.assert_allclose(np.asarray(out)[valid], expected[valid], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case_name,reach", [
    ("reach_smallest", 64), ("reach_past_smallest", 128), ("reach_at_edge", 256), ("reach_past_edge", 512),
    ("reach_mixed_long_short", 599), ("reach_chunk_mid_bucket", 512)])
def test_reach_cases_take_the_bucket_they_name(case_name, reach):
    """The shared reach cases sit where they say (so every branch of the XLA path and every edge runs)."""
    case = REACH_CASES[case_name]
    assert xla.reach_buckets(case.window) == (64, 128, 256, 512, 599)
    bucket = xla.reach_bucket(jnp.asarray(case.lengths, jnp.int32), jnp.asarray(case.num_new, jnp.int32), case.window)
    assert xla.reach_buckets(case.window)[int(bucket)] == reach


@pytest.mark.parametrize("window,expected", [
    (1, (0,)), (24, (23,)), (129, (128,)), (257, (256,)), (258, (64, 128, 256, 257)),
    (750, (64, 128, 256, 512, 749)), (8192, (64, 128, 256, 512, 1024, 2048, 4096, 8191))])
def test_reach_buckets(window, expected):
    assert xla.reach_buckets(window) == expected


@given(length=st.integers(0, 300), num_new=st.integers(0, 3), window=st.integers(1, 70),
       page_size=st.sampled_from([1, 4, 16, 32]))
@settings(deadline=None)  # Eager jnp calls on a shared CI box; no timing is asserted.
def test_pallas_kernels_visit_only_pages_in_the_window(length, num_new, window, page_size):
    """The page range both Pallas kernels walk (the portable kernel's loop, the TPU kernel's index map) is
    exactly the set of logical pages holding a written position some query can see, each once: pages
    never written or wholly outside the window are not fetched."""
    pages_per_window = -(-window // page_size)
    first, count = (int(x) for x in positions.visible_pages(length, num_new, window, page_size, pages_per_window))
    visited = [(first + t) % pages_per_window for t in range(count)]
    seen = range(max(0, length - window + 1), length) if num_new else range(0)
    assert len(visited) == len(set(visited))
    assert set(visited) == {(p // page_size) % pages_per_window for p in seen}


def test_default_implementation_per_platform(monkeypatch):
    pages = jnp.zeros((4, 2, 16, 64), jnp.bfloat16)
    assert api.choose_implementation(pages) == "xla"  # The tests run on CPU; the C++ kernel is float32 only.
    assert api.choose_implementation(pages.astype(jnp.float32)) == "cpu"
    assert api.choose_implementation(pages.astype(jnp.float32), platform="gpu") == "pallas"
    assert api.choose_implementation(pages, platform="tpu") == "pallas_tpu"
    assert api.choose_implementation(pages, platform="gpu") == "pallas"
    assert api.choose_implementation(jnp.zeros((4, 2, 24, 64)), platform="gpu") == "xla"  # Triton: 2^k pages.
    monkeypatch.setattr(pallas_common, "triton_available", lambda: False)
    assert api.choose_implementation(pages, platform="gpu") == "xla"
    with pytest.raises(ValueError, match="Triton backend cannot be imported"):
        api.choose_implementation(pages, implementation="pallas", platform="gpu")


@pytest.mark.parametrize("implementation,interpret,platform,message", [
    ("flash", False, None, "unknown ring_attention implementation 'flash'"),
    ("pallas", False, "cpu", "pass interpret=True"),
    ("pallas_tpu", False, "gpu", "'pallas_tpu' needs a TPU"),
    (None, True, None, "needs implementation='pallas' or 'pallas_tpu'"),
    ("xla", True, None, "needs implementation='pallas' or 'pallas_tpu'"),
    ("cpu", True, None, "needs implementation='pallas' or 'pallas_tpu'"),
    ("cpu", False, "tpu", r"the C\+\+ kernel runs on CPU, not tpu"),
])
def test_unavailable_implementation_is_a_clear_error(implementation, interpret, platform, message):
    with pytest.raises(ValueError, match=message):
        api.choose_implementation(jnp.zeros((4, 2, 16, 64)), implementation=implementation, interpret=interpret,
                                  platform=platform)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("pages", [(4, 2, 16, 64, "float32"), (4, 2, 16, 64, "bfloat16"), (4, 2, 24, 64, "float32"),
                                   (4096, 8, 256, 128, "bfloat16")])
def test_unsupported_reason_is_the_dispatchers_check(platform, pages):
    """`unsupported_reason` (what an engine asks before it compiles) is the check the dispatcher runs: None
    exactly where an explicit name is accepted, else the reason its ValueError gives after the name (and
    before the advice to use the interpreter, which an engine does not have). Before it, EngineConfig cut the
    reason out of the dispatcher's message."""
    from jaxstream.tpu_kernels import unsupported_reason

    *shape, dtype = pages
    pool = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
    for implementation in api.IMPLEMENTATIONS:
        reason = unsupported_reason(implementation, pool, platform=platform)
        try:
            chosen = api.choose_implementation(pool, implementation=implementation, platform=platform)
        except ValueError as error:
            prefix = f"ring_attention implementation {implementation!r} is unavailable: {reason}"
            assert reason and str(error) in (prefix, prefix + "; pass interpret=True to run them in the Pallas "
                                             "interpreter"), (reason, error)
            assert "interpret" not in reason
        else:
            assert reason is None and chosen == implementation
    assert unsupported_reason(None, pool, platform=platform) is None  # the best available always runs
    with pytest.raises(ValueError, match="unknown ring_attention implementation 'flash'"):
        unsupported_reason("flash", pool)


def test_portable_kernel_refuses_pools_beyond_tpu_vmem():
    pool = jax.ShapeDtypeStruct((4096, 8, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="VMEM budget"):
        api.choose_implementation(pool, implementation="pallas", platform="tpu")


def _mutated(**changes):
    args, _ = build(CASES["paged_chunk_gqa4"], "float32", seed=0)
    args.update(window=CASES["paged_chunk_gqa4"].window)
    for name, change in changes.items():
        args[name] = change(args[name]) if callable(change) else change
    return args


@pytest.mark.parametrize("changes,message", [
    (dict(q=lambda x: x[:, :, :3]), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    (dict(q=lambda x: x[0]), "q must have rank 4"),
    (dict(k_new=lambda x: x[..., :32], v_new=lambda x: x[..., :32]), "head_dim differs"),
    (dict(v_new=lambda x: x[:, :2]), "k_new .* and v_new .* differ in shape"),
    (dict(k_new=lambda x: x[:, :2], v_new=lambda x: x[:, :2]), "must equal q's chunk length"),
    (dict(lengths=lambda x: x[:2]), "lengths has 2 sessions but q has 4"),
    (dict(page_table=lambda x: x.astype(jnp.float32)), "page_table must be int32"),
    (dict(num_new=lambda x: x.astype(jnp.int16)), "num_new must be int32"),
    (dict(v_pages=lambda x: x.astype(jnp.bfloat16)), "k_pages .* and v_pages .* differ"),
    (dict(k_pages=lambda x: x[:, :1], v_pages=lambda x: x[:, :1]), "k_new has 2 KV heads but the pages have 1"),
    (dict(page_table=lambda x: x[:, :1]), r"= 16 < window 24; it needs ceil\(window / page_size\) = 2 entries"),
    (dict(window=jnp.int32(24)), "window must be a positive Python int"),
    (dict(window=0), "window must be a positive Python int"),
    (dict(q=lambda x: x.astype(jnp.int32)), "q must be a floating-point array"),
])
def test_invalid_inputs_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=f"^ring_attention: .*{message}"):
        ring_attention(**_mutated(**changes))


@pytest.mark.parametrize("implementation,interpret,window", [
    ("xla", False, 24), ("xla", False, 600), ("cpu", False, 600), ("pallas", pltpu.InterpretParams(), 24),
    ("pallas_tpu", pltpu.InterpretParams(), 24)])
def test_pages_are_written_in_place_under_donation(implementation, interpret, window):
    """W = 600 gives the XLA path three reach branches: the pool is read inside them and written after."""
    sessions, chunk, kv_heads, group, head_dim, page_size, num_pages = 2, 4, 4, 2, 64, 16, 1024
    q = jax.ShapeDtypeStruct((sessions, chunk, kv_heads * group, head_dim), jnp.float32)
    new = jax.ShapeDtypeStruct((sessions, chunk, kv_heads, head_dim), jnp.float32)
    pages = jax.ShapeDtypeStruct((num_pages, kv_heads, page_size, head_dim), jnp.float32)
    table = jax.ShapeDtypeStruct((sessions, -(-window // page_size)), jnp.int32)
    counts = jax.ShapeDtypeStruct((sessions,), jnp.int32)
    step = jax.jit(functools.partial(ring_attention, window=window, implementation=implementation, interpret=interpret),
                   donate_argnames=("k_pages", "v_pages"))
    compiled = step.lower(q, new, new, pages, pages, table, counts, counts).compile()
    pool_bytes = num_pages * kv_heads * page_size * head_dim * 4
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == 2 * pool_bytes
    assert memory.temp_size_in_bytes < pool_bytes / 2, "a copy of a page pool was made"
    assert "input_output_alias" in compiled.as_text()


def _dense_history_attention(q, k_new, v_new, k_old, v_old, lengths, num_new, window, scale):
    """Float64 oracle: each session's queries against its whole key history (old positions then the chunk),
    masked to the sliding window, as one plain softmax."""
    outputs = []
    for s in range(q.shape[0]):
        old = int(lengths[s])
        keys = jnp.concatenate([k_old[s, :old], k_new[s]])  # positions 0 .. old + chunk - 1
        values = jnp.concatenate([v_old[s, :old], v_new[s]])
        query_pos = old + np.arange(q.shape[1])[:, None]
        key_pos = np.arange(keys.shape[0])[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window) & (key_pos < old + int(num_new[s]))
        scores = jnp.einsum("chd,khd->hck", q[s], keys) * scale
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        outputs.append(jnp.einsum("hck,khd->chd", jnp.nan_to_num(probs), values))
    return jnp.stack(outputs)


@pytest.mark.parametrize("case_name,implementation", [
    ("long_chunk_blocks", "xla"), ("paged_chunk_gqa4", "xla"), ("reach_past_edge", "xla"),
    ("paged_chunk_gqa4", "cpu")])
def test_gradients_match_dense_float64(case_name, implementation):
    """The XLA path's hand-written attention backward (training runs through it) against autodiff of a
    dense float64 attention: gradients of a random projection of the valid outputs w.r.t. q, k_new, v_new.
    "reach_past_edge" differentiates through the reach switch, taking a branch short of the window. The C++
    kernel's gradients are the XLA path's, behind its forward."""
    case = {**CASES, **REACH_CASES}[case_name]
    args, history = build(case, "float32", seed=zlib.crc32(case_name.encode()))
    scale = case.scale or case.head_dim**-0.5
    valid = (np.arange(case.chunk)[None, :] < history["num_new"][:, None]).astype(np.float64)
    cotangent = np.random.default_rng(0).standard_normal(args["q"].shape) * valid[:, :, None, None]
    group = case.group

    def xla_loss(q, k_new, v_new):
        out, _, _ = api.ring_attention(q, k_new, v_new, args["k_pages"], args["v_pages"], args["page_table"],
                                       args["lengths"], args["num_new"], window=case.window, scale=case.scale,
                                       implementation=implementation)
        return jnp.sum(out * cotangent.astype(np.float32))

    # Both gradients jitted: one compile each rather than one per eager op.
    got = jax.jit(jax.grad(xla_loss, argnums=(0, 1, 2)))(args["q"], args["k_new"], args["v_new"])
    with jax.enable_x64(True):
        def dense_loss(q, k_new, v_new):
            k_rep, v_rep = (jnp.repeat(x, group, axis=2) for x in (k_new, v_new))
            k_old, v_old = (jnp.repeat(jnp.asarray(history[name], jnp.float64), group, axis=2)
                            for name in ("k_history", "v_history"))
            out = _dense_history_attention(q, k_rep, v_rep, k_old, v_old, history["lengths"], history["num_new"],
                                           case.window, scale)
            return jnp.sum(out * cotangent)

        expected = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(
            *(jnp.asarray(np.asarray(args[name]), jnp.float64) for name in ("q", "k_new", "v_new")))
    for name, g, e in zip(("q", "k_new", "v_new"), got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5, rtol=2e-5, err_msg=f"d {name}")


def test_cpu_kernel_build_failure_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    """A compiler that fails leaves no library behind and becomes the reason the dispatcher falls back to
    the XLA path (and the error an explicit implementation="cpu" gets)."""
    monkeypatch.setenv("JAXSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="^false failed: no output$"):
        cpu._kernel()
    assert not list(tmp_path.rglob("*.so"))
    reason = cpu._load_and_register()
    assert reason == "the C++ kernel is unavailable (false failed: no output)"
    monkeypatch.setattr(cpu, "_register", lambda: reason)
    pages = jnp.zeros((4, 2, 16, 64), jnp.float32)
    assert api.choose_implementation(pages) == "xla"
    with pytest.raises(ValueError, match=r"'cpu' is unavailable: the C\+\+ kernel is unavailable \(false failed"):
        api.choose_implementation(pages, implementation="cpu")


def test_cpu_kernel_is_built_once_per_source_and_cpu(monkeypatch, tmp_path):
    """The library lands in the cache under a key of its source, flags, compiler, jaxlib and CPU; the next
    load finds it there instead of compiling again (nor asking the compiler its version again): it starts no
    process."""
    monkeypatch.setenv("JAXSTREAM_CACHE_DIR", str(tmp_path))
    cpu._kernel()
    library = cpu._library_path(cpu._compiler_command(), jax.ffi.include_dir())
    assert library.exists() and library.parent == tmp_path / "kernels" and library.suffix == ".so"
    assert [path.name for path in library.parent.iterdir()] == [library.name]

    def compile_again(*args, **kwargs):
        raise AssertionError(f"compiled again: {args}")

    run, started = cpu._run, []
    monkeypatch.setattr(cpu, "_build", compile_again)
    monkeypatch.setattr(cpu, "_run", lambda command, *args: started.append(command) or run(command, *args))
    cpu._kernel()
    assert started == [], started


def _script(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_cpu_kernel_builds_with_a_compiler_command_taking_arguments(monkeypatch, tmp_path):
    """$CXX is a command line, as make and CMake read it ("ccache g++", "g++ -w"): here a wrapper that logs
    its arguments and runs the rest as a command, as ccache does. The kernel is built by that command, and a
    library another command built is not taken for its own."""
    import shutil

    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler")
    log = tmp_path / "calls"
    wrapper = _script(tmp_path / "cxx wrapper", f'echo "$@" >> "{log}"\nexec "$@"\n')
    monkeypatch.setenv("JAXSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", f"'{wrapper}' {real} -w")
    cpu._kernel()
    include = jax.ffi.include_dir()
    library = cpu._library_path([str(wrapper), real, "-w"], include)
    assert library.exists()
    calls = log.read_text().splitlines()
    assert calls[0] == f"{real} -w --version"  # the version that keys the cache
    assert calls[-1].startswith(f"{real} -w -O3 -march=native") and calls[-1].endswith(".so")
    assert cpu._library_path([real], include) != library != cpu._library_path([real, "-w", "-O0"], include)


def test_a_hanging_compiler_is_a_reason_not_a_hang(monkeypatch, tmp_path):
    """A compiler that never answers (a stuck ccache, a license server) times out, and so does whatever it
    started: the build becomes a reason the dispatcher falls back on, not a first call that never returns."""
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("JAXSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_script(tmp_path / "stuck", f'sleep 20 &\necho $! > "{pid_file}"\nwait\n')))
    monkeypatch.setattr(cpu, "VERSION_TIMEOUT", 1)
    monkeypatch.setattr(cpu, "COMPILE_TIMEOUT", 1)
    with pytest.raises(RuntimeError, match="^stuck did not finish within 1 s$"):
        cpu._kernel()
    assert not list(tmp_path.rglob("*.so"))
    child = int(pid_file.read_text())
    for _ in range(100):  # killed with the compiler's process group: gone, or a zombie until reaped
        try:
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the compiler's child outlived the timeout")


def test_cpu_kernel_source_ships_in_the_package():
    """A non-editable install must carry the C++ source, or the kernel cannot be built there."""
    import fnmatch
    from pathlib import Path

    from setuptools.config.setupcfg import read_configuration

    setup_cfg = Path(__file__).resolve().parents[1] / "setup.cfg"
    patterns = read_configuration(setup_cfg)["options"]["package_data"]["jaxstream.tpu_kernels.ring_attention"]
    assert any(fnmatch.fnmatch(cpu.SOURCE.name, pattern) for pattern in patterns)


@given(data=st.data(), sessions=st.integers(1, 3), chunk=st.integers(1, 70), window=st.integers(1, 150),
       page_size=st.sampled_from([1, 4, 16, 64]), group=st.sampled_from([1, 2, 4, 8, 16]),
       head_dim=st.sampled_from([8, 24, 64, 128]), num_kv_heads=st.integers(1, 2))
@settings(deadline=None, max_examples=30)
def test_cpu_kernel_matches_dense_on_random_shapes(data, sessions, chunk, window, page_size, group, head_dim,
                                                   num_kv_heads):
    """The C++ kernel's index arithmetic over shapes the named cases do not pin down: page runs of any size,
    row blocks split across GQA groups, head dims off its two compiled-in ones, wrapped rings."""
    lengths = tuple(data.draw(st.lists(st.integers(0, 3 * window + 70), min_size=sessions, max_size=sessions)))
    num_new = tuple(data.draw(st.lists(st.integers(0, chunk), min_size=sessions, max_size=sessions)))
    case = Case(lengths=lengths, num_new=num_new, chunk=chunk, window=window, page_size=page_size, group=group,
                head_dim=head_dim, num_kv_heads=num_kv_heads)
    TestCpu().check_against_oracle(case, "float32", seed=zlib.crc32(repr(case).encode()))
