"""TPU-tuned Pallas kernel of `ring_attention` (Mosaic; also runs in both CPU interpreters).

Grid (S, Hkv, P) with P = pages per window; step b of a (session, head) program visits the b-th logical
page of the range that holds positions inside the window (`positions.visible_pages`). The page table,
lengths and num_new are scalar-prefetched, so the K/V index map reads the physical page of step b from
the page table and each step DMAs exactly one page [page_size, D] of the pool. Steps past the visible
range clamp to the last visible page: a repeated block index issues no DMA and `pl.when` skips the
compute, so empty, short or idle sessions and pages outside the window cost neither bandwidth nor
flops. The online-softmax state (m, l lane-replicated [rows, 128], acc [rows, D], f32) lives in VMEM
scratch: step 0 initialises it and attends to the chunk itself, every visible step adds one page, the
last step normalises into the output block, whose index is constant over b. The new rows are scattered
into the pages after the kernel (read before write), in place when the caller donates the pages.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxstream.tpu_kernels.ring_attention import pallas_common as common
from jaxstream.tpu_kernels.ring_attention import positions
from jaxstream.tpu_kernels.ring_attention.xla import write_new_entries


def check_supported(k_pages, *, interpret=False, platform=None):
    """Raise NotImplementedError (with the reason) when this kernel cannot run here."""
    if common.target_of(interpret, platform) == "gpu":
        raise NotImplementedError("'pallas_tpu' needs a TPU (scalar prefetch and VMEM scratch); use 'pallas' on GPU")
    del k_pages  # Any page shape fits: a block is one page, whose last two dims are full array dims.


def _kernel(lengths_ref, num_new_ref, table_ref, q_ref, k_chunk_ref, v_chunk_ref, k_page_ref, v_page_ref, out_ref,
            m_scratch, l_scratch, acc_scratch, *, window, group, pages_per_window, scale):
    session, step = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[session]
    num_new = num_new_ref[session]
    page_size = k_page_ref.shape[0]
    first, count = positions.visible_pages(length, num_new, window, page_size, pages_per_window)

    def load_state():
        # m and l are replicated over 128 lanes (a full vreg row on TPU); any lane holds the value.
        return (jnp.max(m_scratch[...], axis=-1, keepdims=True), jnp.max(l_scratch[...], axis=-1, keepdims=True),
                acc_scratch[...])

    def store_state(carry):
        m, l, acc = carry
        m_scratch[...] = jnp.broadcast_to(m, m_scratch.shape)
        l_scratch[...] = jnp.broadcast_to(l, l_scratch.shape)
        acc_scratch[...] = acc

    @pl.when(step == 0)
    def _start_with_the_chunk():
        q = q_ref[...]
        block = common.chunk_block(k_chunk_ref.shape[0])

        def chunk_body(b, carry):
            start = pl.multiple_of(b * block, block)
            return common.chunk_step(q, k_chunk_ref, v_chunk_ref, start, block, num_new, group, window, scale, carry)

        store_state(lax.fori_loop(0, pl.cdiv(num_new, block), chunk_body, common.initial_state(*q.shape)))

    @pl.when(step < count)
    def _visit_page():
        logical = lax.rem(first + step, pages_per_window)
        carry = common.page_step(q_ref[...], k_page_ref[...], v_page_ref[...], logical * page_size, length, group,
                                 window,
                                 pages_per_window * page_size, scale, load_state())
        store_state(carry)

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        _, l, acc = load_state()
        out_ref[...] = common.normalise(l, acc, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "platform"))
def ring_attention_pallas_tpu(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, scale=None,
                              interpret=False, platform=None):
    """`ring_attention` with the TPU-tuned kernel. `platform="tpu"` lowers for TPU from another host
    (`jax.export`); `interpret` runs it in the generic (True) or TPU (`pltpu.InterpretParams`) interpreter."""
    check_supported(k_pages, interpret=interpret, platform=platform)
    sessions, _, _, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    pages_per_window = page_table.shape[1]
    q_rows, k_chunk, v_chunk, num_new, group, scale = common.kernel_operands(q, k_new, v_new, num_kv_heads,
                                                                             num_new, scale)
    rows = q_rows.shape[2]

    def page_map(s, h, b, lengths_ref, num_new_ref, table_ref):
        first, count = positions.visible_pages(lengths_ref[s], num_new_ref[s], window, page_size, pages_per_window)
        logical = lax.rem(first + jnp.minimum(b, jnp.maximum(count - 1, 0)), pages_per_window)
        return positions.page_read(table_ref[s * pages_per_window + logical], num_pages), h, 0, 0

    def per_session(s, h, b, *_):
        return s, h, 0, 0

    rows_spec = pl.BlockSpec((None, None, rows, head_dim), per_session)
    chunk_spec = pl.BlockSpec((None, None, k_chunk.shape[2], head_dim), per_session)
    page_spec = pl.BlockSpec((None, None, page_size, head_dim), page_map)
    kernel = functools.partial(_kernel, window=window, group=group, pages_per_window=pages_per_window, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(sessions, num_kv_heads, pages_per_window),
            in_specs=[rows_spec, chunk_spec, chunk_spec, page_spec, page_spec],
            out_specs=rows_spec,
            scratch_shapes=[pltpu.VMEM((rows, common.LANES), jnp.float32),
                            pltpu.VMEM((rows, common.LANES), jnp.float32),
                            pltpu.VMEM((rows, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        name="ring_attention_pallas_tpu",
        **common.call_kwargs("tpu", interpret, ("parallel", "parallel", "arbitrary")),
    )(lengths, num_new, page_table.reshape(-1), q_rows, k_chunk, v_chunk, k_pages, v_pages)

    k_pages, v_pages = write_new_entries(k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, after=out)
    return common.unfold_output(out, q.shape), k_pages, v_pages
