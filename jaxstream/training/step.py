"""Loss, optimizer and the jitted train step: teacher forcing through the model's own streaming steps.

The forward pass is the inference code path: `audio_step` runs the shared 31 silent left-pad slots once
(batch of one), its conv state and encoder KV are broadcast to every row, then one `audio_step` chunk
covers the rest of each stream; the decoder runs the whole token stream as one chunk on a fresh cache (the
body of `text_step`, with the tied head applied only from slot 31 on, the first position ever trained).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxstream.models import audio as front_end
from jaxstream.models.config import VoxtralConfig
from jaxstream.models.layers import init_kv_cache
from jaxstream.models.text_lm import tied_logits
from jaxstream.models.voxtral import ConvState, init_conv_state, time_condition
from jaxstream.training.data import CTC_CLASSES, SHARED_PREFIX_SLOTS, Batch


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 2e-3
    warmup_steps: int = 200
    total_steps: int = 3000
    final_lr_fraction: float = 0.05
    # 0: cosine decay from the end of warmup to the last step. N > 0: hold the peak lr, then cosine over the
    # last N steps (warmup-stable-decay), so more of a short run learns at the peak lr.
    cooldown_steps: int = 0
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b2: float = 0.98
    # Weight of an auxiliary CTC loss on the encoder frames (a training-only linear head over characters or
    # phonemes, `[train] ctc_targets`): it teaches the encoder to carry the words long before the decoder
    # has learned to read them, which otherwise stalls early training at "always STREAMING_PAD".
    ctc_weight: float = 0.0
    # Weight of an auxiliary cross entropy on the audio embeddings, scored against the tied embedding matrix
    # (no extra parameters): audio slot s is trained to predict the token the stream feeds n_delay slots
    # later (`aligned_piece_loss`), so the decoder's job becomes copying from a fixed, delay-given offset.
    aligned_piece_weight: float = 0.0

    def __post_init__(self):
        longest = max(self.total_steps - self.warmup_steps, 0)
        if not 0 <= self.cooldown_steps <= longest:
            raise ValueError(f"[optimizer] cooldown_steps must be between 0 and total_steps - warmup_steps "
                             f"({longest}), got {self.cooldown_steps}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0, then cosine to `final_lr_fraction` of the peak over the rest of the run, or over
    its last `cooldown_steps` after holding the peak."""
    decay_start = cfg.total_steps - cfg.cooldown_steps if cfg.cooldown_steps else cfg.warmup_steps
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
         optax.constant_schedule(cfg.learning_rate),  # empty without a cooldown: both boundaries are the same
         optax.cosine_decay_schedule(cfg.learning_rate, max(cfg.total_steps - decay_start, 1),
                                     alpha=cfg.final_lr_fraction)],
        boundaries=[cfg.warmup_steps, decay_start])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(learning_rate_schedule(cfg), b2=cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=_decay_mask))


def _decay_mask(params):
    """Weight decay on matrices only (not norms, biases or the conv stem's biases)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _single_page_cache(num_layers, num_heads, window, head_dim, dtype):
    # Page 0 is the pool's null page; page 1 holds the shared prefix (every row reads it, writes are discarded).
    return init_kv_cache(num_layers, 2, num_heads, window, head_dim, dtype)


def stream_logits(model, cfg: VoxtralConfig, mel_rest, tokens, n_delay, *, attention_impl="xla"):
    """Whole streams: mel_rest [B, 8 (T - 31), n_mel] (slots 31..T-1), tokens [B, T] -> (logits [B, T - 31, V]
    at positions 31.. (no position before is ever trained), encoder frames [B, 4 (T - 31), H], audio_embeds
    [B, T, D]).

    Attention defaults to the XLA path: training differentiates through it, and only that path has a
    backward of its own. The Pallas kernels have none; the CPU kernel's is the XLA path's, recomputing the
    forward (the tiny recipe's step, `benchmarks/train_step.py`: 860-864 ms through it, 805-813 through XLA).
    """
    batch, num_slots = tokens.shape
    enc = cfg.encoder
    dtype = mel_rest.dtype
    enc_cache = _single_page_cache(enc.num_layers, enc.num_heads, enc.sliding_window, enc.head_dim, dtype)
    prefix_mel = jnp.full((1, SHARED_PREFIX_SLOTS * cfg.mel_frames_per_token, enc.num_mel_bins),
                          (front_end.GLOBAL_LOG_MEL_MAX - 8.0 + 4.0) / 4.0, dtype)
    one_page = jnp.ones((1, 1), jnp.int32)
    prefix_embeds, conv_state, enc_cache = model.audio_step(
        prefix_mel, init_conv_state(cfg, 1, dtype), enc_cache, one_page, jnp.zeros((1,), jnp.int32),
        jnp.full((1,), SHARED_PREFIX_SLOTS, jnp.int32), attention_impl=attention_impl)
    conv_state = ConvState(*(jnp.broadcast_to(s, (batch,) + s.shape[1:]) for s in conv_state))
    # audio_step's own three stages (encoder, 4-frame stacking, adapter), spelled out to keep the encoder
    # frames for the auxiliary CTC head.
    rest_slots = num_slots - SHARED_PREFIX_SLOTS
    frames, _, _ = model.audio_tower(
        mel_rest, conv_state, enc_cache, jnp.ones((batch, 1), jnp.int32),
        jnp.full((batch,), SHARED_PREFIX_SLOTS * cfg.downsample_factor, jnp.int32),
        jnp.full((batch,), rest_slots * cfg.mel_frames_per_token, jnp.int32), attention_impl=attention_impl)
    stacked = frames.reshape(batch, rest_slots, cfg.downsample_factor * enc.hidden_size)
    rest_embeds = model.multi_modal_projector(stacked)
    audio_embeds = jnp.concatenate(
        [jnp.broadcast_to(prefix_embeds, (batch,) + prefix_embeds.shape[1:]), rest_embeds], axis=1)
    text = cfg.text
    cache = _single_page_cache(text.num_layers, text.num_kv_heads, text.attention_window, text.head_dim, dtype)
    # text_step's body, with the tied head applied to positions 31.. only.
    embed = model.language_model.embed_tokens
    t_cond = time_condition(n_delay, text.hidden_size, embed.dtype)
    hidden, _ = model.language_model(embed(tokens) + audio_embeds.astype(embed.dtype), cache,
                                     jnp.ones((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32),
                                     jnp.full((batch,), num_slots, jnp.int32), t_cond=t_cond,
                                     attention_impl=attention_impl)
    logits = tied_logits(hidden[:, SHARED_PREFIX_SLOTS:], embed.embedding[...])
    return logits, frames, audio_embeds


def aligned_targets(tokens, n_delay):
    """(targets [B, T - 31], valid [B, T - 31]) of audio slots 31..T-1: the token fed at slot + n_delay, i.e.
    STREAMING_PAD mostly, a word's STREAMING_WORD one slot after its last sample and its pieces on the
    following slots; valid is 0 where that position lies past the stream."""
    num_slots = tokens.shape[1]
    positions = jnp.arange(SHARED_PREFIX_SLOTS, num_slots)[None, :] + n_delay.astype(jnp.int32)[:, None]
    targets = jnp.take_along_axis(tokens, jnp.minimum(positions, num_slots - 1), axis=1)
    return targets, (positions < num_slots).astype(jnp.float32)


def aligned_piece_loss(model, audio_embeds, batch: Batch):
    """Mean cross entropy of the audio embeddings (slots 31..) against the tied embedding on `aligned_targets`."""
    embedding = model.language_model.embed_tokens.embedding[...]
    targets, valid = aligned_targets(batch.tokens, batch.n_delay)
    logits = jnp.einsum("btd,vd->btv", audio_embeds[:, SHARED_PREFIX_SLOTS:].astype(jnp.float32),
                        embedding.astype(jnp.float32))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (losses * valid).sum() / jnp.maximum(valid.sum(), 1.0)


def init_ctc_head(cfg: VoxtralConfig, seed: int = 0, num_classes: int = CTC_CLASSES) -> dict:
    """The training-only CTC head on the encoder frames (not part of the shipped model): `num_classes` is
    CTC_CLASSES for character targets, `phonemes.PHONEME_CLASSES` for phoneme targets."""
    hidden = cfg.encoder.hidden_size
    kernel = jax.random.normal(jax.random.key(seed), (hidden, num_classes)) / hidden**0.5
    return {"kernel": kernel, "bias": jnp.zeros((num_classes,))}


def auxiliary_ctc_loss(head: dict, frames, batch: Batch):
    """Mean per-label CTC loss of the encoder frames (20 ms each, from slot 31 on); blank = class 0."""
    logits = frames.astype(jnp.float32) @ head["kernel"] + head["bias"]
    num_frames = frames.shape[1]
    valid = (batch.frames_valid[:, None] > jnp.arange(num_frames)[None, :]).astype(jnp.float32)
    losses = optax.ctc_loss(logits, 1.0 - valid, batch.chars, batch.char_padding, blank_id=0)
    return losses.sum() / jnp.maximum((1.0 - batch.char_padding).sum(), 1.0)


def stream_loss(weights: dict, graphdef, cfg: VoxtralConfig, batch: Batch, ctc_weight: float = 0.0,
                aligned_piece_weight: float = 0.0):
    """(training loss, metrics): next-token cross entropy over the trained positions (+ the weighted
    auxiliary losses), the token accuracy there. weights = {"model": params, "ctc_head": ...}."""
    model = nnx.merge(graphdef, weights["model"])
    logits, frames, audio_embeds = stream_logits(model, cfg, batch.mel, batch.tokens, batch.n_delay)
    next_tokens = jnp.roll(batch.tokens, -1, axis=1)[:, SHARED_PREFIX_SLOTS:]
    mask = batch.mask[:, SHARED_PREFIX_SLOTS:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, next_tokens)
    weight = jnp.maximum(mask.sum(), 1.0)
    correct = (jnp.argmax(logits, -1) == next_tokens).astype(jnp.float32)
    stream = (losses * mask).sum() / weight
    metrics = {"loss": stream, "accuracy": (correct * mask).sum() / weight}
    total = stream
    if ctc_weight:
        metrics["ctc"] = auxiliary_ctc_loss(weights["ctc_head"], frames, batch)
        total = total + ctc_weight * metrics["ctc"]
    if aligned_piece_weight:
        metrics["aligned"] = aligned_piece_loss(model, audio_embeds, batch)
        total = total + aligned_piece_weight * metrics["aligned"]
    return total, metrics


# XLA:CPU hands dots, reductions and elementwise fusions to YNNPACK by default. For the backward pass that is
# slow: its elementwise fusions write transposed layouts for the weight-gradient dots (the silu backward of
# an encoder MLP, [512, 4160], took 32 ms per layer). With YNNPACK for the dots alone, the tiny recipe's step
# (benchmarks/train_step.py --config configs/tiny.toml --vocab-size 4000 --batch 16 --slots 96, 2-core
# CPU) took 909 / 901 ms against 1,404 / 1,383 ms, runs alternated. (The XLA ring attention's backward has its
# own span accumulation because of this option: see `_blocked_attention`.) Inference keeps the default: the
# engine's decode programs were slower this way (mid-size model, 32 streams: 49-57 against 42-45 ms a step).
_CPU_TRAINING_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


@functools.cache
def training_compiler_options() -> dict | None:
    """XLA options for compiling training steps on this process's backend (None: the defaults), checked
    once against this XLA (the option is experimental: where it is unknown, training keeps the defaults)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=_CPU_TRAINING_OPTIONS).lower(1.0).compile()
    except Exception:  # noqa: BLE001 - an XLA without the option: the defaults are correct, only slower
        return None
    return _CPU_TRAINING_OPTIONS


@functools.lru_cache(maxsize=8)
def make_train_step(graphdef, cfg: VoxtralConfig, optimizer_cfg: OptimizerConfig):
    """A jitted pure step (weights, opt_state, batch) -> (weights, opt_state, metrics), weights = {"model":
    the model's nnx.Param state, "ctc_head": `init_ctc_head(...)`}, opt_state = `make_optimizer(optimizer_cfg)
    .init(weights)`; weights and state are donated. One step per (model structure, config, optimizer recipe)
    per process, so a run resumed or fine-tuned in the same process reuses its compiled program (~10 s even
    for a one-layer model)."""
    optimizer = make_optimizer(optimizer_cfg)

    def loss_fn(weights, batch):
        return stream_loss(weights, graphdef, cfg, batch, optimizer_cfg.ctc_weight,
                           optimizer_cfg.aligned_piece_weight)

    @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=training_compiler_options())
    def train_step(weights, opt_state, batch: Batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights, batch)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        weights = optax.apply_updates(weights, updates)
        return weights, opt_state, {**metrics, "grad_norm": optax.tree.norm(grads)}

    return train_step
