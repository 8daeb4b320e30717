"""Portable Pallas kernel of `ring_attention`: one source for TPU Mosaic, GPU Triton and the interpreters.

Grid (S, Hkv, row blocks), one program per session, KV head and block of folded query rows (on Triton
blocks of at most ROW_BLOCK rows, so a long chunk's queries, state and output fit in shared memory; one
block elsewhere). Its blocks are those query rows [rows, D], the chunk keys/values [C_pad, D], and the
*whole page pool* of its KV head
[num_pages, page_size, D]: on Triton a block is only a pointer, so the kernel reads just the pages it
indexes; on TPU the pool slice is copied to VMEM, so this kernel suits small pools there (tests, small
configs) and `pallas_tpu` is the TPU production path. Per-session scalars (lengths, num_new, the
flattened page table) are plain inputs. Two in-kernel loops with data-dependent trip counts share one
online-softmax state: first over the valid chunk keys, then over the logical pages that hold positions
inside the window, each page located through the page table. The new rows are scattered into the pages
after the kernel (read before write), in place when the caller donates the pages.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxstream.tpu_kernels.ring_attention import pallas_common as common
from jaxstream.tpu_kernels.ring_attention import positions
from jaxstream.tpu_kernels.ring_attention.xla import write_new_entries

# On TPU the whole pool slice of a head (K and V, double-buffered) must fit in scoped VMEM.
TPU_POOL_VMEM_BUDGET = 8 * 1024 * 1024
# Triton tiles: folded query rows per program, and keys per step of the loops over the chunk and over each
# page. Triton stages the operands of both dots of a step in shared memory (227 KiB on an H100/H200): a
# whole 150-token chunk of GQA pairs at float32 asked for 481 KiB, 64 rows against whole 256-entry pages
# of head_dim 128 for 272 KiB.
ROW_BLOCK = 64
KEY_BLOCK = 64


def check_supported(k_pages, *, interpret=False, platform=None):
    """Raise NotImplementedError (with the reason) when this kernel cannot run the given shapes here."""
    target = common.target_of(interpret, platform)
    num_pages, _, page_size, head_dim = k_pages.shape
    if target == "gpu":
        if not common.triton_available():
            raise NotImplementedError("the Pallas Triton backend cannot be imported")
        for name, size in (("page_size", page_size), ("head_dim", head_dim)):
            if size < common.MIN_TILE or size != common.next_power_of_two(size):
                raise NotImplementedError(f"Triton needs {name} to be a power of two >= {common.MIN_TILE}, got {size}")
    if target == "tpu" and not interpret:
        pool_bytes = 4 * num_pages * page_size * head_dim * jnp.dtype(k_pages.dtype).itemsize
        if pool_bytes > TPU_POOL_VMEM_BUDGET:
            raise NotImplementedError(f"the page pool of one KV head ({pool_bytes} bytes for K and V, double-buffered) "
                                      f"exceeds the VMEM budget of the portable kernel; use 'pallas_tpu'")


def _kernel(lengths_ref, num_new_ref, table_ref, q_ref, k_chunk_ref, v_chunk_ref, k_pool_ref, v_pool_ref, out_ref, *,
            window, group, pages_per_window, scale, chunk_block, page_block):
    session = pl.program_id(0)
    length = lengths_ref[session]
    num_new = num_new_ref[session]
    num_pages, page_size = k_pool_ref.shape[:2]
    ring = pages_per_window * page_size
    q = q_ref[...]
    rows, head_dim = q.shape
    first_row = pl.program_id(2) * rows
    block = common.chunk_block(k_chunk_ref.shape[0], chunk_block)

    def chunk_body(b, carry):
        start = pl.multiple_of(b * block, block)
        return common.chunk_step(q, k_chunk_ref, v_chunk_ref, start, block, num_new, group, window, scale, carry,
                                 first_row)

    # Chunk keys after this block's last token are never visible to it.
    keys = jnp.minimum(num_new, lax.div(first_row + rows - 1, group) + 1)
    carry = lax.fori_loop(0, pl.cdiv(keys, block), chunk_body, common.initial_state(rows, head_dim))
    first, count = positions.visible_pages(length, num_new, window, page_size, pages_per_window)

    def page_body(t, carry):
        logical = lax.rem(first + t, pages_per_window)
        page = positions.page_read(table_ref[session * pages_per_window + logical], num_pages)
        # Static steps over the page; the last one takes what is left of a page that is not a whole number of
        # blocks (pages of 80 or 96 in the interpreter; Triton's pages are powers of two, whole blocks).
        for start in range(0, page_size, page_block):
            entries = pl.ds(start, min(page_block, page_size - start))
            carry = common.page_step(q, k_pool_ref[page, entries, :], v_pool_ref[page, entries, :],
                                     logical * page_size + start, length, group, window, ring, scale, carry, first_row)
        return carry

    _, l, acc = lax.fori_loop(0, count, page_body, carry)
    out_ref[...] = common.normalise(l, acc, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "platform"))
def ring_attention_pallas(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, scale=None,
                          interpret=False, platform=None):
    """`ring_attention` with the portable kernel. `platform` ("tpu" | "gpu") overrides the default backend,
    for lowering to another platform with `jax.export`."""
    check_supported(k_pages, interpret=interpret, platform=platform)
    target = common.target_of(interpret, platform)
    sessions, _, _, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    pages_per_window = page_table.shape[1]
    q_rows, k_chunk, v_chunk, num_new, group, scale = common.kernel_operands(q, k_new, v_new, num_kv_heads,
                                                                             num_new, scale)
    rows = q_rows.shape[2]
    chunk_keys = k_chunk.shape[2]
    scalars = [lengths, num_new, page_table.reshape(-1)]
    if target != "tpu":  # Triton-style whole blocks need power-of-two sizes.
        scalars = [common.pad_axis(x, 0, common.next_power_of_two(x.shape[0])) for x in scalars]

    # Powers of two, so the blocks tile the padded rows (and on Triton the pages) exactly.
    if target == "tpu":
        row_block, chunk_block, page_block = rows, common.CHUNK_BLOCK, page_size
    else:
        row_block, chunk_block, page_block = min(rows, ROW_BLOCK), KEY_BLOCK, min(page_size, KEY_BLOCK)
    rows_spec = pl.BlockSpec((None, None, row_block, head_dim), lambda s, h, r: (s, h, r, 0))
    chunk_spec = pl.BlockSpec((None, None, chunk_keys, head_dim), lambda s, h, r: (s, h, 0, 0))
    pool_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda s, h, r: (0, h, 0, 0))
    kernel = functools.partial(_kernel, window=window, group=group, pages_per_window=pages_per_window, scale=scale,
                               chunk_block=chunk_block, page_block=page_block)
    out = pl.pallas_call(
        kernel,
        grid=(sessions, num_kv_heads, rows // row_block),
        in_specs=[*(common.scalar_spec(target, x.shape[0]) for x in scalars), rows_spec, chunk_spec, chunk_spec,
                  pool_spec, pool_spec],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        name="ring_attention_pallas",
        **common.call_kwargs(target, interpret, ("parallel", "parallel", "parallel")),
    )(*scalars, q_rows, k_chunk, v_chunk, k_pages, v_pages)

    k_pages, v_pages = write_new_entries(k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, after=out)
    return common.unfold_output(out, q.shape), k_pages, v_pages
