"""Export-lowering checks of the Pallas kernels of ring_attention for TPU (Mosaic) and CUDA (Triton),
run from a CPU host with `jax.export`, at the Voxtral decoder and encoder shapes.

They catch lowering errors and backend restrictions (Triton's power-of-two shapes, scalar prefetch or
scratch on Triton, Mosaic-only primitives) but do not run the Mosaic or PTX compilers.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxstream.tpu_kernels.ring_attention import pallas, pallas_tpu

pytestmark = pytest.mark.lowering

# (sessions, chunk, kv_heads, group, head_dim, page_size, window, num_pages)
SHAPES = {
    "decoder_decode": (8, 1, 8, 4, 128, 256, 8192, 512),
    "decoder_prefill": (8, 64, 8, 4, 128, 256, 8192, 512),
    "encoder_chunk": (4, 16, 32, 1, 64, 128, 750, 64),
    # Odd sessions, chunk, group, window and pool; pages and head_dim powers of two, as Triton needs.
    "odd_sizes": (3, 5, 2, 3, 64, 32, 70, 13),
}
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


def _arguments(sessions, chunk, kv_heads, group, head_dim, page_size, window, num_pages):
    spec = jax.ShapeDtypeStruct
    pages = spec((num_pages, kv_heads, page_size, head_dim), jnp.bfloat16)
    new = spec((sessions, chunk, kv_heads, head_dim), jnp.bfloat16)
    counts = spec((sessions,), jnp.int32)
    return (spec((sessions, chunk, kv_heads * group, head_dim), jnp.bfloat16), new, new, pages, pages,
            spec((sessions, -(-window // page_size)), jnp.int32), counts, counts)


def _export(function, platform, arguments):
    # Pallas-Triton's custom call is not on export's list of stable custom calls.
    checks = [export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["cuda"])] if platform == "cuda" else []
    return export.export(jax.jit(function), platforms=[platform], disabled_checks=checks)(*arguments).mlir_module()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kernel,platform", [("pallas_tpu", "tpu"), ("pallas", "tpu"), ("pallas", "cuda")])
def test_kernel_lowers(kernel, platform, shape):
    sizes = SHAPES[shape]
    window = sizes[6]
    if kernel == "pallas" and platform == "tpu":
        sizes = sizes[:7] + (24,)  # The portable kernel holds a head's whole pool in VMEM on TPU.
    function = {"pallas": pallas.ring_attention_pallas, "pallas_tpu": pallas_tpu.ring_attention_pallas_tpu}[kernel]
    module = _export(functools.partial(function, window=window, platform=platform), platform, _arguments(*sizes))
    assert CUSTOM_CALL[platform] in module


@pytest.mark.parametrize("kernel,platform", [("pallas_tpu", "tpu"), ("pallas", "tpu"), ("pallas", "cuda")])
def test_kernel_lowers_over_fp8_pages(kernel, platform):
    """An fp8 KV cache (`EngineConfig.kv_cache_dtype`): bfloat16 queries and new rows over float8_e4m3fn pages."""
    sizes = SHAPES["decoder_decode"]
    if kernel == "pallas" and platform == "tpu":
        sizes = sizes[:7] + (24,)
    arguments = list(_arguments(*sizes))
    arguments[3] = arguments[4] = jax.ShapeDtypeStruct(arguments[3].shape, jnp.float8_e4m3fn)
    function = {"pallas": pallas.ring_attention_pallas, "pallas_tpu": pallas_tpu.ring_attention_pallas_tpu}[kernel]
    module = _export(functools.partial(function, window=sizes[6], platform=platform), platform, arguments)
    assert CUSTOM_CALL[platform] in module and "f8E4M3FN" in module


def test_tpu_kernel_is_refused_for_gpu():
    arguments = _arguments(*SHAPES["decoder_decode"])
    with pytest.raises(NotImplementedError, match="needs a TPU"):
        _export(functools.partial(pallas_tpu.ring_attention_pallas_tpu, window=8192, platform="cuda"), "cuda",
                arguments)
