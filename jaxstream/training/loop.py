"""The training loop: tokenizer, model init, jitted steps, Orbax checkpoints with resume, WER evaluation.

Layout of a run directory OUT:
  tokenizer.model          sentencepiece, trained on the corpus text + the synth vocabulary (first run)
  checkpoints/<step>/      Orbax: weights (model + CTC head) + optimizer state (the last few are kept; resume
                           picks the newest)
  model/                   the latest params as a loadable jaxstream checkpoint (`jaxstream.models.load_model`)
  best/                    the params with the best held-out WER so far, same format
  log.jsonl                one JSON object per logged step / evaluation; a step's `cpu_seconds` is the CPU
                           time its process has used so far (all threads), so a run's cost is the sum of each
                           sitting's last value
"""
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.models import audio as front_end
from jaxstream.errors import UserError
from jaxstream.models.checkpoint_metadata import inspect_checkpoint
from jaxstream.models.config import VoxtralConfig
from jaxstream.models.loading import LoadedModel, load_model
from jaxstream.models.orbax_writer import save_checkpoint
from jaxstream.models.tokenizers import SentencePieceTokenizer
from jaxstream.models.voxtral import VoxtralRealtime
from jaxstream.synth import SentenceSampler, read_manifest
from jaxstream.training.config import TrainConfig, with_total_steps, with_vocab_size
from jaxstream.training.data import CTC_CLASSES, BatchStream, LongStreams
from jaxstream.training.decode import transcribe_corpus, word_error_rate
from jaxstream.training.phonemes import PHONEME_CLASSES, PhonemeLexicon
from jaxstream.training.spelling import init_word_embeddings
from jaxstream.training.spm import train_sentencepiece
from jaxstream.training.step import init_ctc_head, learning_rate_schedule, make_optimizer, make_train_step

TOKENIZER_FILE = "tokenizer.model"


@dataclasses.dataclass
class RunPaths:
    out: Path

    @property
    def tokenizer(self) -> Path:
        return self.out / TOKENIZER_FILE

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def log(self) -> Path:
        return self.out / "log.jsonl"


def ensure_tokenizer(paths: RunPaths, records: list[dict], vocab_size: int, model_type: str) -> SentencePieceTokenizer:
    """The run's tokenizer, trained on the corpus transcripts on the first run. A "word" model also gets the
    packaged word list, so every word of a word-list corpus has its piece; subword models (BPE, unigram)
    spell any word, and byte fallback covers any character."""
    if not paths.tokenizer.is_file():
        texts = [record["text"] for record in records]
        if model_type == "word":
            texts += sorted(SentenceSampler().vocabulary)
        train_sentencepiece(texts, os.fspath(paths.tokenizer), vocab_size, model_type)
    return SentencePieceTokenizer(paths.tokenizer)


class InitialModel(NamedTuple):
    loaded: LoadedModel
    ctc_head: dict | None  # the training-only CTC head, when the source is a `jaxstream train` run


def load_initial_model(source: str, paths: RunPaths) -> InitialModel:
    """The float32 model to fine-tune from; its tokenizer becomes the run's (`train` copies it once every check
    has passed; kept if the run already has it).

    `source` is a model (name or directory) or a `jaxstream train` run directory: then its exported model
    and, from its latest checkpoint, the auxiliary CTC head, which would otherwise restart from random and
    drag the trained encoder back through CTC's all-blank plateau.
    """
    import orbax.checkpoint as ocp

    run = RunPaths(Path(source).absolute())  # Orbax restores from absolute paths only
    ctc_head = None
    if run.checkpoints.is_dir() and (run.out / "model").is_dir():
        with ocp.CheckpointManager(run.checkpoints) as manager:
            step = manager.latest_step()
            if step is not None:
                ctc_head = manager.restore(step, args=ocp.args.StandardRestore())["weights"].get("ctc_head")
        source = os.fspath(run.out / "model")
    loaded = load_model(source, dtype=jnp.float32)
    if not isinstance(loaded.config, VoxtralConfig) or loaded.tokenizer_path is None \
            or loaded.tokenizer_path.name != TOKENIZER_FILE:
        raise UserError(f"--init-from {source}: not a jaxstream-trained speech model (a Voxtral config and a "
                        f"{TOKENIZER_FILE} are required)")
    if paths.tokenizer.is_file() and paths.tokenizer.read_bytes() != loaded.tokenizer_path.read_bytes():
        raise UserError(f"--init-from {source}: {paths.tokenizer} is a different tokenizer; use a fresh --out")
    head = None if ctc_head is None else {key: jnp.asarray(value) for key, value in ctc_head.items()}
    return InitialModel(loaded, head)


def export_model(params, cfg: TrainConfig, graphdef, tokenizer_path: Path, destination: Path) -> None:
    """Writes `params` as a jaxstream Orbax checkpoint (what `load_model` reads); replaces `destination`."""
    model = nnx.merge(graphdef, params)
    save_checkpoint(LoadedModel(model, cfg.model, tokenizer_path), destination, overwrite=True)


def evaluate(graphdef, params, tokenizer, corpus_dir: str, records: list[dict],
             delay_ms: int) -> tuple[float, list[str]]:
    hypotheses = transcribe_corpus(graphdef, params, tokenizer, corpus_dir, records,
                                   front_end.n_delay_from_ms(delay_ms))
    return word_error_rate([r["text"] for r in records], hypotheses), hypotheses


def read_corpora(corpus_dirs: list[str]) -> list[dict]:
    """The manifest records of several corpora, pooled, each path made to include its corpus folder."""
    return [{**record, "path": os.path.join(corpus_dir, record["path"])}
            for corpus_dir in corpus_dirs for record in read_manifest(corpus_dir)]


def held_out_sample(records: list[dict], count: int) -> list[dict]:
    """`count` records spread evenly over `records`, in their order (all of them if there are no more). A
    `jaxstream synth` manifest is sorted by id, so by speaker: its first rows would be a few voices only, and
    the held-out WER that picks `RUN/best` would be theirs."""
    if count >= len(records):
        return list(records)
    return [records[index * len(records) // count] for index in range(count)]


def train(cfg: TrainConfig, corpus_dir: str | list[str], out_dir: str, *, eval_corpus_dir: str | None = None,
          steps: int | None = None, until_step: int | None = None, init_from: str | None = None,
          progress: bool = True) -> dict:
    """Trains (or resumes) a run; returns the final metrics. `corpus_dir` is a corpus folder or a list of
    them (pooled; a resumed run may be given more than it started with). `steps` overrides the recipe's total;
    `until_step` stops this call after that step, with a checkpoint, leaving the schedule as it is (a later
    call resumes there: a long run spread over sittings);
    `init_from` (a model name or directory, or an earlier run's directory) starts from that model's weights
    and tokenizer instead of a fresh initialisation, with a fresh optimizer and schedule (fine-tuning)."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    if steps:
        cfg = with_total_steps(cfg, steps)  # before any work: the override must fit the schedule
    paths = RunPaths(Path(out_dir).resolve())
    nearest = next(path for path in (paths.out, *paths.out.parents) if path.exists())
    if not nearest.is_dir():  # found now rather than by the mkdir below, after the corpus and models are read
        raise UserError(f"--out {out_dir}: {nearest} is not a directory")
    records = read_corpora([corpus_dir] if isinstance(corpus_dir, str) else list(corpus_dir))
    untimed = sum(1 for record in records if not record["words"])
    if untimed:
        raise UserError(f"{corpus_dir}: {untimed} utterances have no word timings (flite sets are for evaluation "
                        f"only); training needs `jaxstream synth` corpora from espeak-ng or Festival")
    check_corpus_audio(records)
    eval_records = held_out_sample(read_manifest(eval_corpus_dir), cfg.eval_utterances) if eval_corpus_dir else []
    check_corpus_audio([{**r, "path": os.path.join(eval_corpus_dir, r["path"])} for r in eval_records], rate=None)
    total_steps = cfg.optimizer.total_steps
    last_step = min(total_steps, until_step or total_steps)
    start = _latest_step(paths)
    if last_step < start:
        raise UserError(f"{paths.out} is already at step {start}, past the requested last step {last_step} "
                        f"(--steps, --until-step or the recipe's total_steps)")
    if last_step == start:
        return {"step": start}  # nothing left to train
    # Every check runs before anything is written to OUT: a failed call must not leave a tokenizer that the
    # next call would take for the run's.
    initial = load_initial_model(init_from, paths) if init_from else None
    if initial is not None:
        cfg = with_vocab_size(cfg, SentencePieceTokenizer(initial.loaded.tokenizer_path).vocab_size)
        if initial.loaded.config != cfg.model:
            raise UserError(f"--init-from {init_from}: its architecture differs from the recipe's [model]: "
                            + ", ".join(_differences(initial.loaded.config, cfg.model)))
    ctc_classes = PHONEME_CLASSES if cfg.ctc_targets == "phonemes" else CTC_CLASSES
    if initial is not None and initial.ctc_head is not None and initial.ctc_head["bias"].shape != (ctc_classes,):
        raise UserError(f"--init-from {init_from}: its CTC head predicts {initial.ctc_head['bias'].shape[0]} "
                        f"classes; the recipe's ctc_targets = {cfg.ctc_targets!r} need {ctc_classes}")
    if start:  # the tokenizer exists: a resumed run keeps the architecture it was trained with
        cfg = with_vocab_size(cfg, SentencePieceTokenizer(paths.tokenizer).vocab_size)
        exported = inspect_checkpoint(paths.out / "model").config
        if exported != cfg.model:
            raise UserError(f"{paths.out} was trained with another architecture than the recipe's [model]: "
                            + ", ".join(_differences(exported, cfg.model)) + "; use a fresh --out")
    try:
        paths.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if initial is not None and not paths.tokenizer.is_file():
        shutil.copyfile(initial.loaded.tokenizer_path, paths.tokenizer)
    tokenizer = ensure_tokenizer(paths, records, cfg.spm_vocab_size, cfg.spm_model_type)
    cfg = with_vocab_size(cfg, tokenizer.vocab_size)
    optimizer = make_optimizer(cfg.optimizer)

    ctc_head = None
    if initial is not None:
        model, ctc_head = initial.loaded.model, initial.ctc_head
    else:
        model = VoxtralRealtime(cfg.model, rngs=nnx.Rngs(cfg.seed))
        if cfg.spelling_init:
            embed = model.language_model.embed_tokens
            embed.embedding[...] = jnp.asarray(init_word_embeddings(np.asarray(embed.embedding[...]), tokenizer,
                                                                    cfg.seed))
    if ctc_head is None:
        ctc_head = init_ctc_head(cfg.model, cfg.seed, ctc_classes)
    # Built after the checks above: it asks espeak-ng for the whole vocabulary (~10 s for eight accents).
    lexicon = PhonemeLexicon(records) if cfg.ctc_targets == "phonemes" else None
    graphdef, params = nnx.split(model, nnx.Param)
    # Committed to one device, like the arrays a resume restores and the step returns, so a fresh run, a resumed
    # one and every later step share one compiled program per batch shape (jit keys committed and uncommitted
    # arguments apart; optax creates its step counts uncommitted).
    weights = jax.device_put({"model": params, "ctc_head": ctc_head}, jax.local_devices()[0])
    opt_state = jax.device_put(optimizer.init(weights), jax.local_devices()[0])
    manager = ocp.CheckpointManager(paths.checkpoints, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    if start:
        restored = manager.restore(start, args=ocp.args.StandardRestore({"weights": weights, "opt_state": opt_state}))
        weights, opt_state = restored["weights"], restored["opt_state"]
    train_step = make_train_step(graphdef, cfg.model, cfg.optimizer)

    best_wer = _best_wer(paths)
    delays = tuple(front_end.n_delay_from_ms(ms) for ms in cfg.delays_ms)
    # Each record's path names its corpus folder (read_corpora).
    stream = BatchStream("", records, tokenizer, batch_size=cfg.batch_size, delays_slots=delays,
                         seed=cfg.seed, first_step=start + 1, vtlp_range=cfg.vtlp_range,
                         ctc_labels=lexicon.ctc_labels if lexicon else None,
                         long_streams=LongStreams(cfg.long_stream_fraction, cfg.long_stream_seconds,
                                                  cfg.long_streams_from_step) if cfg.long_stream_fraction else None)
    schedule = learning_rate_schedule(cfg.optimizer)
    metrics: dict = {}
    bar = tqdm(total=last_step, initial=start, unit="step", disable=not progress, dynamic_ncols=True)
    try:
        for step in range(start + 1, last_step + 1):
            batch = next(stream)
            began = time.perf_counter()
            weights, opt_state, step_metrics = train_step(weights, opt_state, batch)
            params = weights["model"]
            metrics = {key: float(value) for key, value in step_metrics.items()}
            # The rate this step applied (optax counts the updates before it).
            metrics.update(step=step, learning_rate=float(schedule(step - 1)),
                           seconds=round(time.perf_counter() - began, 3), cpu_seconds=round(time.process_time(), 1))
            bar.update()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}")
            _log(paths, metrics)
            if step % cfg.checkpoint_every == 0 or step == last_step:
                manager.save(step, args=ocp.args.StandardSave({"weights": weights, "opt_state": opt_state}))
                manager.wait_until_finished()
                export_model(params, cfg, graphdef, paths.tokenizer, paths.out / "model")
            if eval_records and (step % cfg.eval_every == 0 or step == total_steps):
                wer, hypotheses = evaluate(graphdef, params, tokenizer, eval_corpus_dir, eval_records,
                                           cfg.eval_delay_ms)
                _log(paths, {"step": step, "eval_wer": wer, "delay_ms": cfg.eval_delay_ms,
                             "examples": [[r["text"], h] for r, h in zip(eval_records[:3], hypotheses[:3])]})
                bar.write(f"step {step}: held-out WER {100 * wer:.2f}% at {cfg.eval_delay_ms} ms")
                metrics["eval_wer"] = wer
                if wer < best_wer:
                    best_wer = wer
                    export_model(params, cfg, graphdef, paths.tokenizer, paths.out / "best")
                    (paths.out / "best" / "eval.json").write_text(json.dumps({"step": step, "wer": wer}) + "\n")
    finally:
        bar.close()
        stream.close()
        manager.close()
    return metrics


def _differences(model: VoxtralConfig, recipe: VoxtralConfig) -> list[str]:
    """'encoder.hidden_size: model 128, recipe 96' for each config field that differs."""
    def flat(fields: dict, prefix: str = "") -> dict:
        items = {}
        for key, value in fields.items():
            items.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return items

    ours, theirs = flat(dataclasses.asdict(model)), flat(dataclasses.asdict(recipe))
    return [f"{key}: model {ours[key]}, recipe {theirs.get(key)}" for key in ours if ours[key] != theirs.get(key)]


def _latest_step(paths: RunPaths) -> int:
    """The run's newest checkpoint step (0 for a new run), read without creating anything."""
    if not paths.checkpoints.is_dir():
        return 0
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(paths.checkpoints) as manager:
        return manager.latest_step() or 0


def check_corpus_audio(records: list[dict], rate: int | None = front_end.SAMPLING_RATE) -> None:
    """UserError unless every record's audio file exists (and, with `rate`, is sampled at it): found before
    training starts rather than as a batch loader's failure. Reads only the files' headers."""
    import soundfile

    for record in records:
        try:
            found = soundfile.info(record["path"]).samplerate
        except (OSError, RuntimeError) as exc:
            raise UserError(f"cannot read the corpus audio {record['path']}: {exc}") from None
        if rate is not None and found != rate:
            raise UserError(f"{record['path']} is sampled at {found} Hz; training needs {rate} Hz audio (a "
                            f"telephone --held-out corpus is for --eval-corpus only)")


def _best_wer(paths: RunPaths) -> float:
    report = paths.out / "best" / "eval.json"
    return json.loads(report.read_text())["wer"] if report.is_file() else float("inf")


def _log(paths: RunPaths, record: dict) -> None:
    with open(paths.log, "a") as f:
        f.write(json.dumps({"time": round(time.time(), 1), **record}) + "\n")


def parameter_count(params) -> int:
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))
