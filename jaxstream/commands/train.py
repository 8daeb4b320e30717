"""`jaxstream train`: train a small Voxtral-architecture streaming model (the embedded tiny model's recipe)."""
import argparse
import os

from jaxstream.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a streaming speech model on a synthetic corpus",
        description="Trains with delayed-streams targets (AdamW, warmup + cosine, clipping), keeps Orbax "
                    "checkpoints in OUT/checkpoints (rerun the same command to resume), exports the latest "
                    "model to OUT/model and the best held-out one to OUT/best (jaxstream checkpoints).")
    parser.add_argument("--config", default="tiny",
                        help="recipe TOML: a path or a preset name in jaxstream.configs (default: tiny)")
    parser.add_argument("--corpus", required=True, nargs="+", metavar="DIR",
                        help="training corpus written by `jaxstream synth`, or several (their utterances pooled)")
    parser.add_argument("--eval-corpus", help="held-out corpus for the periodic WER (jaxstream synth --held-out)")
    parser.add_argument("--out", required=True, help="run directory (checkpoints, tokenizer, exported models)")
    parser.add_argument("--init-from", metavar="MODEL|RUN",
                        help="fine-tune with a fresh optimizer, starting from a model's weights and tokenizer (a "
                             "name such as tiny, or a directory) or from an earlier run directory (which also "
                             "carries its training-only CTC head); the architecture must match the recipe's")
    parser.add_argument("--steps", type=int, help="total steps (default: the recipe's optimizer.total_steps)")
    parser.add_argument("--until-step", type=int, metavar="N",
                        help="stop after step N with a checkpoint, keeping the schedule (rerun to go on)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def resolve_config_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    import importlib.resources

    preset = importlib.resources.files("jaxstream.configs").joinpath(f"{name}.toml")
    if preset.is_file():
        return os.fspath(preset)
    raise UserError(f"config {name!r} is neither a file nor a preset in jaxstream.configs")


def run(args: argparse.Namespace) -> int:
    from jaxstream.synth.corpus import MANIFEST_NAME
    from jaxstream.training import load_train_config, train

    corpora = [("--corpus", corpus) for corpus in args.corpus]
    if args.eval_corpus:
        corpora.append(("--eval-corpus", args.eval_corpus))
    for flag, corpus in corpora:
        if not os.path.exists(corpus):
            raise UserError(f"{flag} {corpus}: no such directory")
        if not os.path.isdir(corpus):
            raise UserError(f"{flag} {corpus}: not a directory (a corpus is the folder `jaxstream synth` wrote)")
        if not os.path.isfile(os.path.join(corpus, MANIFEST_NAME)):
            raise UserError(f"{flag} {corpus} has no {MANIFEST_NAME}: generate it with `jaxstream synth`")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    if args.until_step is not None and args.until_step < 1:
        raise UserError(f"--until-step must be at least 1, got {args.until_step}")
    try:
        cfg = load_train_config(resolve_config_path(args.config))
    except (TypeError, ValueError) as exc:
        raise UserError(f"bad training config {args.config}: {exc}") from None
    if args.steps is not None:  # checked here, against the recipe's warmup and cooldown
        cfg = _with_steps(cfg, args.steps)
    metrics = train(cfg, args.corpus, args.out, eval_corpus_dir=args.eval_corpus, init_from=args.init_from,
                    until_step=args.until_step, progress=not args.no_progress)
    if "loss" not in metrics:
        print(f"{args.out} is already at step {metrics['step']}: nothing to train")
        return 0
    print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                   for key, value in metrics.items()))
    return 0


def _with_steps(cfg, steps: int):
    """The recipe run for `steps` in all; a run too short for its warmup and cooldown is a mistake of the
    flag (the recipe is fine), so the message names the flag, its minimum, and --until-step for a short run."""
    from jaxstream.training.config import with_total_steps

    try:
        return with_total_steps(cfg, steps)
    except ValueError:  # OptimizerConfig's check: the cooldown must fit after the warmup
        opt = cfg.optimizer
        raise UserError(f"--steps {steps} is shorter than the recipe's warmup and cooldown ({opt.warmup_steps} + "
                        f"{opt.cooldown_steps} steps): --steps must be at least "
                        f"{opt.warmup_steps + opt.cooldown_steps}; for a short run on the recipe's schedule, "
                        f"stop early with --until-step {steps} instead") from None
