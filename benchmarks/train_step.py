"""Where a training step's time goes, against a dense matmul measured in the same run.

    python benchmarks/train_step.py                      # the tiny recipe, batch 16 x 112 slots
    python benchmarks/train_step.py --config tiny --batch 16 --slots 112 --json out.json
    python benchmarks/train_step.py --profile 40         # also: where the step's thread time goes

Times (median of --reps after a warm-up) the jitted forward+backward of: the whole step's loss
(`stream_loss` with the recipe's auxiliary weights), the encoder alone (conv stem + transformer), one
encoder layer's ring attention, and one tied-head cross entropy; reports XLA's FLOP count of the whole
step and the achieved GFLOP/s as a fraction of a square f32 matmul's on the same device. On the 2-core CPU
the tiny recipe's step runs at about a quarter of matmul speed, three quarters of it in the encoder (its
attention and the elementwise work at width 128): run this before and after changing the model code or the
recipe's shapes. `--profile N` traces a few steps with the JAX profiler and lists the N costliest groups of
XLA thunks, each named by the JAX operation it came from (`transpose(jvp(...))` is the backward pass) and its
output shape, in milliseconds of thread time per step.
"""
import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream import allocator
from jaxstream.commands.train import resolve_config_path
from jaxstream.errors import UserError
from jaxstream.models.layers import init_kv_cache
from jaxstream.models.tokenizers import NUM_CONTROL_IDS
from jaxstream.models.voxtral import VoxtralRealtime
from jaxstream.tpu_kernels.ring_attention import ring_attention
from jaxstream.training import load_train_config
from jaxstream.training.config import with_vocab_size
from jaxstream.training.data import CTC_CLASSES, SHARED_PREFIX_SLOTS, Batch
from jaxstream.training.step import init_ctc_head, stream_logits, stream_loss, training_compiler_options

from ring_attention import timed_alternately  # benchmarks/ring_attention.py (this script's directory is on sys.path)


def timed_jit(function, *args, reps):
    """Median seconds of a jitted `function(*args)` after one warm-up (compile) call, compiled as training
    steps are."""
    jitted = jax.jit(function, compiler_options=training_compiler_options())
    [seconds] = timed_alternately([lambda: jitted(*args)], reps)
    return seconds


def thread_time_by_operation(hlo_text: str, call, reps=3) -> collections.Counter:
    """Thread milliseconds per call of each (JAX operation, output shape) of a compiled module (its
    `as_text()`), from a profiler trace of `reps` calls of `call` (which runs it and waits for the result)
    joined to the module's HLO metadata."""
    operations = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*op_name=\"([^\"]*)\"", line)
        if found:
            operations[found.group(1)] = (found.group(3), found.group(2))
    call()
    totals = collections.Counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(reps):
                call()
        (path,) = glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz")
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    for event in events:
        name = event.get("args", {}).get("hlo_op")
        if event.get("ph") == "X" and name and not event["name"].startswith("ThunkExecutor"):
            totals[operations.get(name, ("(no JAX operation) " + name, ""))] += event["dur"] / 1000 / reps
    return totals


def random_batch(rng, model_cfg, batch, slots, n_delay):
    """A training batch of the recipe's shapes (random features and tokens: the cost does not depend on them)."""
    rest = slots - SHARED_PREFIX_SLOTS
    chars = 64
    return Batch(
        mel=rng.standard_normal((batch, model_cfg.mel_frames_per_token * rest, model_cfg.encoder.num_mel_bins)
                                ).astype(np.float32),
        tokens=rng.integers(NUM_CONTROL_IDS, model_cfg.text.vocab_size, (batch, slots)).astype(np.int32),
        mask=np.ones((batch, slots), np.float32), n_delay=np.full((batch,), n_delay, np.float32),
        chars=rng.integers(1, CTC_CLASSES, (batch, chars)).astype(np.int32),
        char_padding=np.zeros((batch, chars), np.float32),
        frames_valid=np.full((batch,), model_cfg.downsample_factor * rest, np.int32))


def parse(argv=None):
    """(arguments, the recipe they ask for); bad arguments exit as argparse's errors do."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny",
                        help="recipe TOML: a path or a preset name in jaxstream.configs, as `jaxstream train "
                        "--config` takes (default: tiny)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="decoder rows, control ids included (default: the recipe's, 1000 control ids + its "
                        "[tokenizer] vocab_size; a trained tokenizer may hold fewer pieces)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--slots", type=int, default=112,
                        help=f"stream slots per row (80 ms each), more than the {SHARED_PREFIX_SLOTS} of the "
                        "shared left-pad prefix")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N costliest operations of the step by thread time")
    args = parser.parse_args(argv)
    # The stream after the shared prefix must hold a slot, and tokens are drawn above the control ids.
    if args.slots <= SHARED_PREFIX_SLOTS:
        parser.error(f"--slots must be more than {SHARED_PREFIX_SLOTS} (the shared left-pad prefix), "
                     f"got {args.slots}")
    if args.vocab_size is not None and args.vocab_size <= NUM_CONTROL_IDS:
        parser.error(f"--vocab-size must be more than {NUM_CONTROL_IDS} (the control ids), got {args.vocab_size}")
    for name in ("batch", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:
        cfg = load_train_config(resolve_config_path(args.config))
    except (UserError, TypeError, ValueError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    if args.vocab_size is not None:
        cfg = with_vocab_size(cfg, args.vocab_size)
    return args, cfg


def main(argv=None):
    args, cfg = parse(argv)
    if argv is None:  # a process of its own: on the allocator the jaxstream commands use
        allocator.reexecute_with_tcmalloc()

    model = VoxtralRealtime(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    weights = {"model": params, "ctc_head": init_ctc_head(cfg.model)}
    batch = random_batch(np.random.default_rng(0), cfg.model, args.batch, args.slots, n_delay=6)
    opt = cfg.optimizer

    def loss(weights):
        return stream_loss(weights, graphdef, cfg.model, batch, opt.ctc_weight, opt.aligned_piece_weight)[0]

    def encoder_output(params):
        _, frames, _ = stream_logits(nnx.merge(graphdef, params), cfg.model, batch.mel, batch.tokens, batch.n_delay)
        return jnp.mean(frames**2)

    enc = cfg.model.encoder
    rest_frames = cfg.model.downsample_factor * (args.slots - SHARED_PREFIX_SLOTS)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((args.batch, rest_frames, enc.num_heads, enc.head_dim)), jnp.float32)
               for _ in range(3))
    k_pages, v_pages = init_kv_cache(1, 2, enc.num_heads, enc.sliding_window, enc.head_dim, jnp.float32)[0]
    page_table = jnp.ones((args.batch, 1), jnp.int32)
    lengths = jnp.full((args.batch,), cfg.model.downsample_factor * SHARED_PREFIX_SLOTS, jnp.int32)
    num_new = jnp.full((args.batch,), rest_frames, jnp.int32)

    def attention(q, k, v):
        out, _, _ = ring_attention(q, k, v, k_pages, v_pages, page_table, lengths, num_new, window=enc.sliding_window)
        return jnp.mean(out**2)

    hidden = jnp.ones((args.batch, args.slots - SHARED_PREFIX_SLOTS, cfg.model.text.hidden_size))
    embedding = jnp.ones((cfg.model.text.vocab_size, cfg.model.text.hidden_size))

    def head(hidden, embedding):
        return jnp.mean(jax.nn.logsumexp(jnp.einsum("btd,vd->btv", hidden, embedding), axis=-1))

    # The step compiled once, as training compiles it: timed, counted and profiled.
    step = jax.jit(jax.grad(loss), compiler_options=training_compiler_options()).lower(weights).compile()
    step_flops = step.cost_analysis()
    step_flops = (step_flops[0] if isinstance(step_flops, list) else step_flops).get("flops", float("nan"))
    n = 1024
    square = jnp.ones((n, n), jnp.float32)
    matmul_gflops = 2 * n**3 / timed_jit(lambda a: a @ a, square, reps=args.reps) / 1e9
    seconds = {
        "step fwd+bwd": timed_alternately([lambda: step(weights)], args.reps)[0],
        "encoder fwd+bwd": timed_jit(jax.grad(encoder_output), params, reps=args.reps),
        "one encoder attention fwd+bwd": timed_jit(jax.grad(attention, argnums=(0, 1, 2)), q, k, v, reps=args.reps),
        "one tied head fwd+bwd": timed_jit(jax.grad(head, argnums=(0, 1)), hidden, embedding, reps=args.reps),
    }
    step_gflops = step_flops / seconds["step fwd+bwd"] / 1e9
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), batch {args.batch} x {args.slots} slots, "
          f"vocabulary {cfg.model.text.vocab_size}")
    for name, value in seconds.items():
        print(f"{name:32s} {1000 * value:9.1f} ms  ({100 * value / seconds['step fwd+bwd']:5.1f} % of the step)")
    print(f"step: {step_flops / 1e9:.1f} GFLOP at {step_gflops:.1f} GFLOP/s = "
          f"{100 * step_gflops / matmul_gflops:.1f} % of a {n}x{n} f32 matmul ({matmul_gflops:.1f} GFLOP/s)")
    if args.profile:
        by_operation = thread_time_by_operation(step.as_text(), lambda: jax.block_until_ready(step(weights)))
        print(f"thread time per step: {sum(by_operation.values()):.1f} ms, the costliest operations:")
        for (operation, shape), ms in by_operation.most_common(args.profile):
            print(f"{ms:8.1f} ms  {operation.removeprefix('jit(loss)/')}  {shape}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "batch": args.batch, "slots": args.slots,
                       "vocab_size": cfg.model.text.vocab_size,
                       "seconds": seconds, "step_gflop": step_flops / 1e9, "step_gflops": step_gflops,
                       "matmul_gflops": matmul_gflops}, f, indent=1)


if __name__ == "__main__":
    main()
