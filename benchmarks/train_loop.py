"""The training loop's throughput on a real corpus, numpy's BLAS on one thread against its default, side by side.

    python benchmarks/train_loop.py CORPUS --tokenizer RUN/tokenizer.model
    python benchmarks/train_loop.py CORPUS --tokenizer RUN/tokenizer.model --config configs/tiny.toml --blocks 6

Runs the recipe's jitted train step on the background `BatchStream` as `jaxstream train` does, in alternating
blocks of steps: numpy's BLAS (the host front end's mel filterbank product, in the loader thread) limited to
one thread, then at its default thread count, and so on. Reports the median wall seconds per step in each
setting, the wait for the batch included and the steps that compile new batch shapes (a length bucket, a label
width) left out. A block's first batches were built under the previous setting (the loader prefetches four).
Compare the two settings only within one run: this machine drifts. On the 2-core CPU (tiny recipe, 3 x 40
steps each): 713 ms per step with one BLAS thread against 794 ms with OpenBLAS's default two, which is why
`jaxstream` commands run with one.
"""
import argparse
import contextlib
import time

import jax
import numpy as np
from flax import nnx
from threadpoolctl import threadpool_limits

from jaxstream.models import audio as front_end
from jaxstream.models.tokenizers import SentencePieceTokenizer
from jaxstream.models.voxtral import VoxtralRealtime
from jaxstream.synth import read_manifest
from jaxstream.training import load_train_config
from jaxstream.training.config import with_vocab_size
from jaxstream.training.data import BatchStream
from jaxstream.training.step import init_ctc_head, make_optimizer, make_train_step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus")
    parser.add_argument("--tokenizer", required=True, help="a run's tokenizer.model (sentencepiece)")
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--block", type=int, default=40, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per setting")
    args = parser.parse_args(argv)

    tokenizer = SentencePieceTokenizer(args.tokenizer)
    cfg = with_vocab_size(load_train_config(args.config), tokenizer.vocab_size)
    model = VoxtralRealtime(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(cfg.optimizer)
    weights = {"model": params, "ctc_head": init_ctc_head(cfg.model)}
    opt_state = optimizer.init(weights)
    train_step = make_train_step(graphdef, cfg.model, cfg.optimizer)
    delays = tuple(front_end.n_delay_from_ms(ms) for ms in cfg.delays_ms)
    stream = BatchStream(args.corpus, read_manifest(args.corpus), tokenizer, batch_size=cfg.batch_size,
                         delays_slots=delays, seed=cfg.seed)

    compiled = set()  # a step that compiles new batch shapes is left out of the timings
    settings = {"BLAS on 1 thread": lambda: threadpool_limits(limits=1, user_api="blas"),
                "BLAS default": contextlib.nullcontext}
    seconds = {name: [] for name in settings}
    for _ in range(args.blocks):
        for name, limit in settings.items():
            with limit():
                for _ in range(args.block):
                    began = time.perf_counter()
                    batch = next(stream)
                    weights, opt_state, _ = jax.block_until_ready(train_step(weights, opt_state, batch))
                    shapes = tuple(array.shape for array in batch)  # slots and the CTC labels' width
                    if shapes in compiled:
                        seconds[name].append(time.perf_counter() - began)
                    compiled.add(shapes)
    stream.close()
    print(f"{jax.devices()[0].device_kind}, batch {cfg.batch_size}, {args.blocks} x {args.block} steps per setting")
    for name in settings:
        print(f"{name:18s} median {1000 * np.median(seconds[name]):6.1f} ms/step ({len(seconds[name])} steps)")


if __name__ == "__main__":
    main()
