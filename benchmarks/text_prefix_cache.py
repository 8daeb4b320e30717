"""Automatic prefix caching of a text LM (engine/text_prefix_cache.py), off and on side by side in one run: requests
sharing a system prompt of K tokens with distinct tails, arriving together, and one prompt sampled n = 8 times.
Prints the positions each engine computed, the prefix-cache hits and the wall time of each scenario.

    python benchmarks/text_prefix_cache.py                      # a random 4-layer model, K = 512
    python benchmarks/text_prefix_cache.py --system-tokens 1024 --requests 32 --hidden 512

The engines are driven directly (no event loop), both built alike but for `enable_prefix_caching`; each scenario
runs on both, first on a warm-up request of its own shapes. On a CPU the wall-time ratio is what to read, not the
times: prefill positions cost more next to decode steps on an accelerator.
"""
import argparse
import dataclasses
import time

import numpy as np
from flax import nnx

from jaxstream.engine.builders import build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.parallel_sampling import child_ids, child_params
from jaxstream.engine.requests import SamplingParams
from jaxstream.models import TextLM
from jaxstream.models.config import TextConfig


def random_model(args) -> TextLM:
    heads = args.hidden // 64
    cfg = TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                     num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64,
                     max_positions=args.max_model_len)
    return TextLM(cfg, rngs=nnx.Rngs(args.seed))


def computed(core) -> int:
    """Positions the core computed so far (the tick log's tokens advanced)."""
    return sum(stats.steps for stats in core.tick_stats.window(0, core.ticks_recorded))


def run(core, requests) -> dict:
    """Adds `requests` [(request id, prompt, params)] at once and runs the core until they end."""
    outputs = {}
    positions, hits, start = computed(core), core.prefix_cache_counts[1], time.perf_counter()
    for request_id, prompt, params in requests:
        outputs[request_id] = []
        core.add_chunk(request_id, prompt, params, first=True, resumable=False, sink=outputs[request_id].append)
    while core.has_work():
        core.step()
    tokens = {rid: [t for out in items for t in out.outputs[0].token_ids] for rid, items in outputs.items()}
    return {"positions": computed(core) - positions, "hits": core.prefix_cache_counts[1] - hits,
            "seconds": time.perf_counter() - start, "tokens": tokens}


def scenarios(args, rng):
    """(name, warm-up requests, measured requests) pairs; prompts of the warm-up share nothing with the rest."""
    def ids(length):
        return rng.integers(3, args.vocab, length).tolist()

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def system_prompt(tag):
        system = ids(args.system_tokens)
        return [(f"{tag}{i}", system + ids(args.tail_tokens), greedy) for i in range(args.requests)]

    def parallel(tag):
        params = SamplingParams(n=args.n, temperature=1.0, seed=args.seed, max_tokens=args.max_tokens)
        prompt = ids(args.prompt_tokens)
        return [(child, prompt, child_params(params, i)) for i, child in enumerate(child_ids(tag, args.n))]

    return [(f"shared system prompt ({args.requests} requests, K = {args.system_tokens} + {args.tail_tokens})",
             system_prompt("warm"), system_prompt("r")),
            (f"n = {args.n} on one {args.prompt_tokens}-token prompt", parallel("warm"), parallel("n"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=512, help="K, the shared system prompt's tokens")
    parser.add_argument("--tail-tokens", type=int, default=32, help="each request's own tokens after it")
    parser.add_argument("--requests", type=int, default=16, help="requests sharing the system prompt")
    parser.add_argument("--n", type=int, default=8, help="completions of the parallel-sampling prompt")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the parallel-sampling prompt's tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="model width (heads of 64)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = random_model(args)
    config = EngineConfig(max_sessions=args.max_sessions, page_size=args.page_size, max_model_len=args.max_model_len,
                          batch_buckets=(args.max_sessions,), prefill_buckets=((1, 256), (4, 64)))
    cores = {caching: build_text_core(model, dataclasses.replace(config, enable_prefix_caching=caching))
             for caching in (False, True)}
    print(f"{'scenario':<58} {'positions off':>13} {'on':>7} {'ratio':>6} {'hits':>6} {'wall off':>9} "
          f"{'on':>7} {'ratio':>6}")
    for name, warm_up, requests in scenarios(args, np.random.default_rng(args.seed)):
        results = {}
        for caching, core in cores.items():
            run(core, warm_up)
            results[caching] = run(core, requests)
        off, on = results[False], results[True]
        same = "" if off["tokens"] == on["tokens"] else "  (tokens differ!)"
        print(f"{name:<58} {off['positions']:>13} {on['positions']:>7} {on['positions'] / off['positions']:>6.2f} "
              f"{on['hits']:>6} {off['seconds']:>8.2f}s {on['seconds']:>6.2f}s "
              f"{on['seconds'] / off['seconds']:>6.2f}{same}")


if __name__ == "__main__":
    main()
