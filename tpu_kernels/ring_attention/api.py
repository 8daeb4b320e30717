"""Public entry point of `ring_attention`: input validation and the implementation dispatcher."""
import numbers

import jax
import jax.numpy as jnp

from jaxstream.tpu_kernels.ring_attention import cpu, pallas, pallas_common, pallas_tpu
from jaxstream.tpu_kernels.ring_attention.xla import ring_attention_xla

IMPLEMENTATIONS = ("xla", "cpu", "pallas", "pallas_tpu")
# Tried in order by implementation=None; the first whose check passes runs. XLA always works.
DEFAULT_ORDER = {"tpu": ("pallas_tpu", "pallas", "xla"), "gpu": ("pallas", "xla"), "cpu": ("cpu", "xla")}

# check_supported of every implementation but XLA (which always runs): `unsupported_reason` asks them.
_CHECKS = {"cpu": cpu.check_supported, "pallas": pallas.check_supported, "pallas_tpu": pallas_tpu.check_supported}
# The Pallas kernels, the only ones that can run in an interpreter.
_PALLAS = {"pallas": pallas.ring_attention_pallas, "pallas_tpu": pallas_tpu.ring_attention_pallas_tpu}


def ring_attention(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, implementation=None,
                   scale=None, interpret=False):
    """Attention of C new positions per session over a paged ring KV cache, writing the new K/V.

    Shapes: q [S, C, Hq, D]; k_new/v_new [S, C, Hkv, D]; k_pages/v_pages [num_pages, Hkv, page_size, D];
    page_table [S, pages_per_window] int32 (valid page indices; point unallocated entries at a null page);
    lengths, num_new [S] int32, 0 <= num_new <= C. Query i of session s (position lengths[s] + i) attends to
    keys at positions in (pos - window, pos], read before the chunk is written. Rows i >= num_new[s] are
    padding: not written, and their outputs are to be ignored (a session with num_new = 0 gets zeros).
    Returns (out [S, C, Hq, D], k_pages, v_pages); donate the pages to update them in place.

    The pages may hold another floating dtype than q (an fp8 KV cache): they are read into q's dtype, and k_new /
    v_new are rounded to the pages' dtype before anything attends to them, so an output is the same whether a key
    was read from the pages or came in the chunk.

    Traced inputs out of contract are not checked, but every implementation treats them alike: num_new
    is clipped to [0, C]; a page-table entry outside the pool reads the page XLA's gather reads (a negative
    one counts from the end of the pool, then the index is clamped into it), never memory past the pool,
    and the new rows it would take are not written (dropped), so a bad entry never overwrites another
    session's page.

    Non-finite keys and values: one at a position a query cannot see (outside its window, after it, never
    written, a padding row) never affects that query. One it can see makes its output non-finite where the
    float64 oracle's is ("cpu"; "xla" too, though a chunk of several positions there makes the whole output
    of that query head NaN). The one allowed difference: the Pallas kernels replace every non-finite value
    by 0 before its product with the probabilities, one select per block for all its queries, so a NaN or
    inf value a query can see leaves its output finite there (a non-finite key it can see still makes it NaN).

    implementation: "xla", "cpu" (a C++ kernel for XLA:CPU, float32), "pallas" (portable: TPU, GPU Triton),
    "pallas_tpu" (TPU-tuned), or None for the best available on the default backend ("pallas_tpu" on TPU,
    "pallas" on GPU, "cpu" on CPU, "xla" where those cannot run).
    interpret: run an explicitly named Pallas implementation in the Pallas interpreter (tests on CPU):
    True for the generic interpreter, or a `pltpu.InterpretParams(...)` for the TPU one.
    """
    _validate(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window, scale)
    window, scale = int(window), None if scale is None else float(scale)  # Static, hashable jit arguments.
    name = choose_implementation(k_pages, implementation=implementation, interpret=interpret)
    if k_pages.dtype != k_new.dtype:
        # Pages of another dtype (an fp8 KV cache): the chunk attends to its keys and values as they are stored,
        # so an output does not depend on whether a key came from the chunk or from the pages (on how a
        # prompt was cut into chunks, or a stream into steps).
        k_new, v_new = (x.astype(k_pages.dtype).astype(x.dtype) for x in (k_new, v_new))
    args = (q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new)
    if name == "xla":
        return ring_attention_xla(*args, window=window, scale=scale)
    if name == "cpu":
        return cpu.ring_attention_cpu(*args, window=window, scale=scale)
    return _PALLAS[name](*args, window=window, scale=scale, interpret=interpret)


def choose_implementation(k_pages, *, implementation=None, interpret=False, platform=None):
    """Name of the implementation `ring_attention` runs for these pages on `platform` (default backend).

    Raises ValueError for an unknown name, or for an explicit name that cannot run here, with the reason.
    """
    _check_arguments(implementation, interpret)
    if implementation is not None:
        reason = unsupported_reason(implementation, k_pages, interpret=interpret, platform=platform)
        if reason:
            raise ValueError(f"ring_attention implementation {implementation!r} is unavailable: {reason}"
                             f"{_interpreter_advice(implementation, interpret, platform)}")
        return implementation
    for name in DEFAULT_ORDER.get(platform or jax.default_backend(), ("xla",)):
        if not unsupported_reason(name, k_pages, platform=platform):
            return name
    return "xla"


def unsupported_reason(implementation, k_pages, *, interpret=False, platform=None):
    """Why `implementation` cannot run these pages on `platform` (default backend), or None when it can.

    The dispatcher's own check, for callers that pick an implementation ahead of the first call (an engine's
    configuration): the reason is a phrase to show as is, e.g. "the C++ kernel takes float32 pages, not
    bfloat16" (the dispatcher's ValueError adds the implementation's name and, for Pallas off TPU and GPU, the
    `interpret` option). k_pages: the page pool, or a `jax.ShapeDtypeStruct` of it (the C++ kernel takes
    float32, Triton power-of-two pages, the portable kernel on TPU a pool that fits VMEM). "xla" always runs,
    and so does None (the best available, falling back to "xla"). Asking about "cpu" on CPU builds the C++
    kernel, or finds it in its cache. Raises ValueError for an unknown name, or `interpret` with a kernel
    that has no interpreter.
    """
    _check_arguments(implementation, interpret)
    if implementation in (None, "xla"):
        return None
    try:
        _CHECKS[implementation](k_pages, interpret=interpret, platform=platform)
    except NotImplementedError as reason:
        return str(reason)
    return None


def _check_arguments(implementation, interpret):
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown ring_attention implementation {implementation!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)} or None")
    if interpret and implementation not in _PALLAS:
        raise ValueError(f"interpret={interpret!r} needs implementation='pallas' or 'pallas_tpu', "
                         f"got {implementation!r}")


def _interpreter_advice(implementation, interpret, platform):
    """What a caller of `ring_attention` (a test on CPU) can do instead when Pallas has no compiler here."""
    if implementation in _PALLAS and not interpret and pallas_common.compiled_target(platform) is None:
        return "; pass interpret=True to run them in the Pallas interpreter"
    return ""


def _validate(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window, scale):
    def fail(message):
        raise ValueError(f"ring_attention: {message}")

    arrays = dict(q=q, k_new=k_new, v_new=v_new, k_pages=k_pages, v_pages=v_pages, page_table=page_table,
                  lengths=lengths, num_new=num_new)
    ranks = dict(q=4, k_new=4, v_new=4, k_pages=4, v_pages=4, page_table=2, lengths=1, num_new=1)
    for name, array in arrays.items():
        if jnp.ndim(array) != ranks[name]:
            fail(f"{name} must have rank {ranks[name]}, got shape {jnp.shape(array)}")
    for name in ("page_table", "lengths", "num_new"):
        if arrays[name].dtype != jnp.int32:
            fail(f"{name} must be int32, got {arrays[name].dtype}")
    for name in ("q", "k_new", "v_new", "k_pages", "v_pages"):
        if not jnp.issubdtype(arrays[name].dtype, jnp.floating):
            fail(f"{name} must be a floating-point array, got {arrays[name].dtype}")
    if k_new.shape != v_new.shape:
        fail(f"k_new {k_new.shape} and v_new {v_new.shape} differ in shape")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        fail(f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} {v_pages.dtype} differ")
    sessions, chunk, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, page_head_dim = k_pages.shape
    for name in ("k_new", "page_table", "lengths", "num_new"):
        if arrays[name].shape[0] != sessions:
            fail(f"{name} has {arrays[name].shape[0]} sessions but q has {sessions}")
    if chunk < 1 or k_new.shape[1] != chunk:
        fail(f"k_new/v_new chunk length {k_new.shape[1]} must equal q's chunk length {chunk} (>= 1)")
    if k_new.shape[2] != num_kv_heads:
        fail(f"k_new has {k_new.shape[2]} KV heads but the pages have {num_kv_heads}")
    if num_q_heads % num_kv_heads:
        fail(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if not head_dim == k_new.shape[3] == page_head_dim:
        fail(f"head_dim differs: q {head_dim}, k_new {k_new.shape[3]}, pages {page_head_dim}")
    if num_pages < 1 or page_size < 1 or page_table.shape[1] < 1:
        fail(f"empty page pool {k_pages.shape} or page table {page_table.shape}")
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
        fail(f"window must be a positive Python int, got {window!r}")
    ring = page_table.shape[1] * page_size
    if ring < window:
        fail(f"the page table holds {page_table.shape[1]} pages of {page_size} positions = {ring} < window {window}; "
             f"it needs ceil(window / page_size) = {-(-window // page_size)} entries")
    if scale is not None and not isinstance(scale, numbers.Real):
        fail(f"scale must be a Python float or None, got {scale!r}")
