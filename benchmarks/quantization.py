"""Weight-only int8 (`--quantization int8`) against float weights: parameter bytes, the KV pages the engine's pools
get at a fixed device memory, and the time of one compiled realtime decode dispatch side by side.

    python benchmarks/quantization.py                                   # CPU-sized: real widths, 2 + 2 layers
    python benchmarks/quantization.py --encoder-layers 32 --decoder-layers 26 --dtype bfloat16   # the 4B, on a device

1. Parameter bytes (jax arrays' nbytes) of the model benchmarked, and of Voxtral Realtime 4B (abstract, nothing
   allocated) in bfloat16.
2. Pages: `fit_pools` as the engine runs it, for the 4B at `--memory-gb` of device memory in bfloat16 (a TPU v5e
   chip: 16). The engine reads the free memory after the parameters are placed (`bytes_limit - bytes_in_use`; a
   CPU's MemAvailable), so what int8 frees goes to the pools with nothing else to do: here the reading is that of a
   device of `--memory-gb` holding the parameters. Streams: how many the pools hold at full windows (window
   admission commits them), and of `--stream-seconds` at the default delay (demand admission: the pages they fill).
3. Step time: the decode program of `--rows` rows, one 80 ms step, `--fill` positions behind every row, float and
   int8 called in turns (median of `--reps`). On a CPU only the ratio means anything; absolute times need the
   accelerator the engine runs on.

The model is Voxtral-shaped with the real widths, heads, windows and vocabulary (the 403 M-parameter tied embedding
and LM head included) and random weights; only its layer counts are cut, so that float32 fits a CPU host.
"""
import argparse
import dataclasses
import math
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream import allocator
from jaxstream.engine import builders, sharding
from jaxstream.engine.benchmark import SyntheticTokenizer
from jaxstream.engine.config import EngineConfig
from jaxstream.models.audio import DEFAULT_DELAY_MS, SLOT_SECONDS, n_delay_from_ms, prompt_length
from jaxstream.models.config import VOXTRAL_MINI_4B
from jaxstream.models.loading import abstract_model
from jaxstream.models.quantization import quantize_model
from jaxstream.models.voxtral import VoxtralRealtime
from realtime_step import filled_batch

GB = 1e9


def param_bytes(model) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def abstract_bytes(model) -> int:
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def pages_at(memory_bytes: float, weights_bytes: int, engine_cfg: EngineConfig) -> list:
    """The 4B's pools as `fit_pools` sizes them on a device of `memory_bytes` that holds `weights_bytes`."""
    placement = sharding.Placement(None, engine_cfg.tp_axis)
    free = memory_bytes - weights_bytes
    with mock.patch.object(builders, "_free_device_bytes", return_value=free):  # that device's reading
        return builders.fit_pools(builders.realtime_stack_specs(VOXTRAL_MINI_4B, engine_cfg), engine_cfg, placement,
                                  stream_pages=builders.planned_stream_pages(VOXTRAL_MINI_4B, engine_cfg))


def report_pages(memory_gb: float, stream_seconds: float) -> None:
    engine_cfg = EngineConfig(dtype="bfloat16")  # the defaults: 64 sessions, demand admission
    # A stream's KV: its prompt (BOS, left pad, delay) and audio slots in the decoder, 4 encoder frames a slot.
    slots = prompt_length(n_delay_from_ms(DEFAULT_DELAY_MS)) + round(stream_seconds / SLOT_SECONDS)
    lengths = {"decoder": slots, "encoder": 4 * slots}
    print(f"\nVoxtral Realtime 4B, bfloat16 activations and KV, {memory_gb:g} GB device, EngineConfig defaults "
          f"(kv_memory_fraction {engine_cfg.kv_memory_fraction}):")
    print(f"{'weights':>8} {'GB':>6} {'encoder pages':>14} {'decoder pages':>14} {'KV GB':>6} {'full windows':>13} "
          f"{f'{stream_seconds:g} s streams':>13}")
    for name in ("float", "int8"):
        weights = abstract_bytes(abstract_model(VOXTRAL_MINI_4B, jnp.bfloat16,
                                                quantization=None if name == "float" else "int8"))
        specs = pages_at(memory_gb * GB, weights, engine_cfg)
        kv = sum(spec.num_pages * spec.bytes_per_page(jnp.bfloat16) for spec in specs)
        windows = min((spec.num_pages - 1) // spec.pages_per_window for spec in specs)
        streams = min((spec.num_pages - 1) // math.ceil(min(lengths[spec.name], spec.ring) / spec.page_size)
                      for spec in specs)
        pages = {spec.name: spec.num_pages for spec in specs}
        print(f"{name:>8} {weights / GB:6.2f} {pages['encoder']:14d} {pages['decoder']:14d} {kv / GB:6.2f} "
              f"{windows:13d} {streams:13d}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="compute and parameter dtype (default: float32 on CPU, "
                        "bfloat16 on accelerators)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--fill", type=int, default=125, help="decoder positions behind each row (default 125: 10 s)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--memory-gb", type=float, default=16.0, help="device memory of the pages table (default 16)")
    parser.add_argument("--stream-seconds", type=float, default=10.0,
                        help="length of the streams the pages table counts (default 10)")
    args = parser.parse_args(argv)
    if argv is None:  # a process of its own: on the allocator the jaxstream commands use
        allocator.reexecute_with_tcmalloc()

    cfg = dataclasses.replace(
        VOXTRAL_MINI_4B, eos_id=-1,
        encoder=dataclasses.replace(VOXTRAL_MINI_4B.encoder, num_layers=args.encoder_layers),
        text=dataclasses.replace(VOXTRAL_MINI_4B.text, num_layers=args.decoder_layers))
    # Full windows for every row (what the program reads is the fill, whatever the pools' size); one batch shape
    # and one step count compiled.
    engine_cfg = EngineConfig(max_sessions=args.rows, batch_buckets=(args.rows,), realtime_step_buckets=(1,),
                              realtime_prefill_buckets=((1, 16),), cache_silent_prefix=False, dtype=args.dtype)
    dtype = builders.engine_dtype(engine_cfg)
    print(f"Voxtral-shaped random model, {args.encoder_layers} encoder + {args.decoder_layers} decoder layers, "
          f"{dtype.name}, on {jax.devices()[0].device_kind}")

    float_model = nnx.jit(lambda: VoxtralRealtime(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))()
    int8_model = quantize_model(float_model)
    float_bytes, int8_bytes = param_bytes(float_model), param_bytes(int8_model)
    print(f"parameters: float {float_bytes / GB:.3f} GB, int8 {int8_bytes / GB:.3f} GB ({int8_bytes / float_bytes:.3f}"
          f" of float)")
    real = [abstract_bytes(abstract_model(VOXTRAL_MINI_4B, jnp.bfloat16, quantization=q)) for q in (None, "int8")]
    print(f"Voxtral Realtime 4B in bfloat16: {real[0] / GB:.2f} GB float, {real[1] / GB:.2f} GB int8 "
          f"({real[1] / real[0]:.3f})")
    report_pages(args.memory_gb, args.stream_seconds)

    tokenizer = SyntheticTokenizer(cfg.text.vocab_size)
    cores = {name: builders.build_realtime_core(model, engine_cfg, tokenizer)
             for name, model in (("float", float_model), ("int8", int8_model))}
    key = ("decode", args.rows, 1)
    rng = np.random.default_rng(0)
    batches = {name: filled_batch(core, args.rows, 1, args.fill, rng) for name, core in cores.items()}
    times = {name: [] for name in cores}
    for rep in range(args.reps + 1):  # the first call of each is a warm-up
        for name, core in cores.items():
            start = time.perf_counter()
            jax.block_until_ready(core.programs.run(key, dict(batches[name])))
            if rep:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    print(f"\ndecode dispatch, {args.rows} rows x 1 step, {args.fill} positions behind each row "
          f"(median of {args.reps}):")
    for name, median in medians.items():
        print(f"{name:>8} {median * 1e3:9.1f} ms")
    print(f"int8 / float: {medians['int8'] / medians['float']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
