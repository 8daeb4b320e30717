"""How many Voxtral Realtime 4B streams of each length fit at once in the page pools `fit_pools` sizes, for each
`EngineConfig.planned_stream_seconds`, on devices of several memory sizes. Nothing runs on a device: the pools are
sized as the engine sizes them at start-up, from the free memory a device of that size reports once it holds the
parameters (bfloat16 activations and KV, the defaults otherwise: 64 sessions, demand admission).

    python benchmarks/pool_plan.py
    python benchmarks/pool_plan.py --memory-gb 16 24 --plans none 30 60 --lengths 10 60 600 --quantization int8

A stream of L seconds holds, in each pool, the pages `realtime_admission.stream_pages` gives for its slots (prompt,
audio, end padding at the default delay: `stream_slot_bound`), its whole window past it. "streams of L s" is how many
such streams both pools hold at once (at most `max_sessions`); under demand admission more start, and the newest
move to host memory while the pools are short.
"""
import argparse
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.engine import builders, sharding
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.realtime_admission import stream_pages
from jaxstream.models.audio import n_delay_from_ms, stream_slot_bound
from jaxstream.models.config import VOXTRAL_MINI_4B
from jaxstream.models.loading import abstract_model

GB = 1e9
CFG = VOXTRAL_MINI_4B


def weight_bytes(quantization: str | None) -> int:
    model = abstract_model(CFG, jnp.bfloat16, quantization=quantization)
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def fitted_pools(memory_bytes: float, weights: int, engine_cfg: EngineConfig) -> dict:
    """The pools `build_realtime_core` sizes on a device of `memory_bytes` that holds `weights` bytes of parameters."""
    placement = sharding.Placement(None, engine_cfg.tp_axis)
    with mock.patch.object(builders, "_free_device_bytes", return_value=memory_bytes - weights):
        specs = builders.fit_pools(builders.realtime_stack_specs(CFG, engine_cfg), engine_cfg, placement,
                                   stream_pages=builders.planned_stream_pages(CFG, engine_cfg))
    return {spec.name: spec for spec in specs}


def streams_of(pools: dict, seconds: float, max_sessions: int) -> int:
    slots = stream_slot_bound(seconds, n_delay_from_ms(CFG.default_delay_ms), CFG.n_left_pad_tokens)
    pages = stream_pages(pools, slots, CFG.downsample_factor)
    return min([max_sessions] + [(pools[name].num_pages - 1) // pages[name] for name in pools])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-gb", type=float, nargs="+", default=[16, 24, 32, 48])
    parser.add_argument("--plans", nargs="+", default=["none", "30", "60", "120", "300"],
                        help="planned_stream_seconds values ('none': full windows)")
    parser.add_argument("--lengths", type=float, nargs="+", default=[10, 60, 300, 660],
                        help="stream lengths in seconds to count (660: past the 4B's 11-minute decoder window)")
    parser.add_argument("--quantization", choices=("none", "int8"), nargs="+", default=["none", "int8"])
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype (default auto: "
                        "bfloat16 pages; fp8: 8-bit pages)")
    args = parser.parse_args(argv)
    plans = [None if plan == "none" else float(plan) for plan in args.plans]
    header = " ".join(f"{f'{length:g} s':>7}" for length in args.lengths)
    print(f"Voxtral Realtime 4B, bfloat16, KV cache {args.kv_cache_dtype}, EngineConfig defaults but "
          f"planned_stream_seconds; streams that fit at once (at most {EngineConfig().max_sessions}):")
    print(f"{'memory':>6} {'weights':>7} {'plan':>5} {'encoder pages':>13} {'decoder pages':>13} {header}")
    for quantization in args.quantization:
        weights = weight_bytes(None if quantization == "none" else quantization)
        for memory in args.memory_gb:
            for plan in plans:
                engine_cfg = EngineConfig(dtype="bfloat16", planned_stream_seconds=plan,
                                          kv_cache_dtype=args.kv_cache_dtype)
                pools = fitted_pools(memory * GB, weights, engine_cfg)
                counts = " ".join(f"{streams_of(pools, length, engine_cfg.max_sessions):7d}"
                                  for length in args.lengths)
                label = "full" if plan is None else f"{plan:g}"
                print(f"{memory:5g}G {quantization:>7} {label:>5} {pools['encoder'].num_pages - 1:13d} "
                      f"{pools['decoder'].num_pages - 1:13d} {counts}")
            print()


if __name__ == "__main__":
    main()
