"""Jitted pure step programs `(params, state, batch) -> (outputs, state)`, compiled ahead of time.

The model is split once (`graphdef, params = nnx.split(model)`, the params kept as a flat list of arrays)
and merged inside each trace; the device state (KV pages and per-slot rows, see `kv_cache.DeviceCache`) is
donated to every call and rebound from its result. Every (program, batch bucket) pair is lowered and
compiled at start-up, and calls go to the compiled executables, so serving cannot recompile.

A process keeps the jitted step functions it made, by what defines their programs (the step and its static
arguments, the model's graph and parameter structure, the placement): an engine built again in the same process
(tests, a notebook that rebuilds its engine, `eval` over several delays) gets JAX's in-memory traces and
executables back instead of tracing and lowering every program again, which took most of a warm build (the
embedded model, persistent compilation cache warm: 4.4 s of its 6.1 s).
"""
import collections
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.engine import sampling
from jaxstream.engine.kv_cache import NULL_PAGE
from jaxstream.engine.requests import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxstream.models.text_lm import select_logit_rows
from jaxstream.models.voxtral import ConvState

logger = logging.getLogger(__name__)


class Programs:
    """The compiled step programs of one model over one `DeviceCache`."""

    def __init__(self, model, cache, *, param_shardings=None, state_shardings=None, batch_sharding=None):
        self.graphdef, params = nnx.split(model)
        if param_shardings is not None:
            params = jax.device_put(params, param_shardings)
        # Programs take the parameters as a flat list of arrays: flattening the nnx State at every call cost
        # ~70 us of host time per dispatch (a Python callback per Variable); a list flattens in C++.
        self.param_leaves, self._param_tree = jax.tree_util.tree_flatten(params)
        if param_shardings is not None:
            param_shardings = self._param_tree.flatten_up_to(param_shardings)
        self.cache = cache
        self._shardings = (param_shardings, state_shardings, batch_sharding)
        self._compiled = {}
        self._batch_shapes = {}  # key -> the batch's shapes and dtypes (a follower rebuilds batches from them)
        # A multihost.Leader when processes of a multi-host job mirror every dispatch; set after warm-up.
        self.leader = None

    def compile(self, key, step, batch) -> None:
        """Compiles `step(model, state, batch) -> (outputs, state)` for the shapes of `batch` (numpy)."""
        start = time.perf_counter()
        param_sh, state_sh, batch_sh = self._shardings
        kwargs = {}
        if state_sh is not None:
            batch_tree = jax.tree_util.tree_map(lambda _: batch_sh, batch)
            kwargs = dict(in_shardings=(param_sh, state_sh, batch_tree), out_shardings=(batch_sh, state_sh))
        jitted = _jitted_step(step, self.graphdef, self._param_tree, kwargs)
        self._compiled[key] = jitted.lower(self.param_leaves, self.cache.state, batch).compile()
        self._batch_shapes[key] = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
        if logger.isEnabledFor(logging.DEBUG):
            memory, shown = self.memory(key), ""
            if memory is not None:
                gb = [size / 1e9 for size in (memory.argument_size_in_bytes, memory.alias_size_in_bytes,
                                              memory.temp_size_in_bytes)]
                shown = " (GB: arguments {:.3f}, aliased {:.3f}, temporaries {:.3f})".format(*gb)
            logger.debug("compiled program %s in %.2f s%s", key, time.perf_counter() - start, shown)

    def memory(self, key):
        """XLA's account of program `key`'s device memory (argument, alias, temp sizes, ...), or None where the
        backend gives none: the donated state should be aliased whole and the temporaries small (a copy of a
        page pool shows as temporaries the pool's size)."""
        return self._compiled[key].memory_analysis()

    @property
    def params(self):
        """The model's parameters as an nnx State (the tree `nnx.split` gave)."""
        return jax.tree_util.tree_unflatten(self._param_tree, self.param_leaves)

    def __contains__(self, key) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def keys(self) -> list:
        """Program keys in compile order (the same in every process that built the same engine)."""
        return list(self._compiled)

    def empty_batch(self, key) -> dict[str, np.ndarray]:
        """Zeros shaped like the batches of program `key`."""
        return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), self._batch_shapes[key])

    def hlo_text(self, key) -> str:
        """The compiled program's optimized HLO (what a profile's operation names refer to)."""
        return self._compiled[key].as_text()

    def run(self, key, batch):
        """Dispatches one compiled program (asynchronously) and rebinds the donated state."""
        if self.leader is not None:
            self.leader.publish(key, batch)
        outputs, self.cache.state = self._compiled[key](self.param_leaves, self.cache.state, batch)
        return outputs


def _merged_step(step, graphdef, param_tree, params, state, batch):
    return step(nnx.merge(graphdef, jax.tree_util.tree_unflatten(param_tree, params)), state, batch)


_JITTED_STEPS = 64  # the jitted step functions a process keeps (each holds its buckets' executables)
_jitted_steps: collections.OrderedDict = collections.OrderedDict()
_jitted_steps_lock = threading.Lock()  # engines may be built on several threads at once


def _jitted_step(step, graphdef, param_tree, jit_kwargs):
    """The process's jitted `_merged_step` of `step` for this model structure and placement (module docstring).
    `step` is a module-level function or a `functools.partial` of one: a partial is keyed by what it holds, not by
    identity, so that every engine's partial of the same step finds it. A model or step with unhashable static
    parts gets a jitted step of its own, as every engine did before."""
    if isinstance(step, functools.partial):
        step_key = (step.func, step.args, tuple(sorted(step.keywords.items())))
    else:
        step_key = step
    placement = jax.tree_util.tree_flatten(jit_kwargs)
    key = (step_key, graphdef, param_tree, tuple(placement[0]), placement[1])
    try:
        hash(key)
    except TypeError:
        key = None
    with _jitted_steps_lock:
        jitted = None if key is None else _jitted_steps.get(key)
        if jitted is None:
            jitted = jax.jit(functools.partial(_merged_step, step, graphdef, param_tree), donate_argnums=(1,),
                             **jit_kwargs)
            if key is not None:
                _jitted_steps[key] = jitted
                if len(_jitted_steps) > _JITTED_STEPS:
                    _jitted_steps.popitem(last=False)
        else:
            _jitted_steps.move_to_end(key)
    return jitted


# -- text language models (TextLM, ToyLM) --------------------------------------------------------------
# State: stack "text"; slot rows "context_counts" [V] int32 and "counts_start" (sampling.count_fed_tokens: what
# the penalties read).

# The most logits a block of prompt positions holds at once (float32 [rows, positions, V]): 64 MB, whatever the
# bucket and the vocabulary, where the logits of a whole (4, 512) bucket over a 131k vocabulary would take 1 GB.
PROMPT_BLOCK_ELEMENTS = 1 << 24
# The outputs only a prefill (C > 1) program has: the prompt logprobs of its positions (`prompt_logprobs`).
PROMPT_OUTPUTS = ("prompt_logprob", "prompt_rank", "prompt_top_ids", "prompt_top_logprobs")


def text_slot_shapes(vocab_size: int) -> dict:
    """The per-slot rows of a text engine's state (`DeviceCache` slot shapes): one int32 per vocabulary id (0.5 MB
    a slot for a 131k vocabulary). Counts rather than each slot's token history, which vLLM bincounts every step: a
    fixed size whatever `max_model_len` (the history of a 128k context is as large), and a step touches only the
    ids it feeds, and whole rows only of the rows that use penalties or start a session or a chunk."""
    return {"context_counts": ((vocab_size,), jnp.int32), "counts_start": ((), jnp.int32),
            # The ids a slot may sample at its next sampled position, one bit an id: structured outputs' grammar
            # allows them (sampling.GRAMMAR_MASK) and allowed_token_ids and bad words do (sampling.SAMPLE_MASK).
            "token_mask": ((2, (vocab_size + 31) // 32), jnp.int32)}


def count_row_batch(vocab_size: int) -> dict[str, np.ndarray]:
    """The batch of `write_count_row`: a slot (-1: none), its `2 * count + seen` row and the output start."""
    return {"slot": np.full(1, -1, np.int32), "row": np.zeros((1, vocab_size), np.int32),
            "output_start": np.zeros(1, np.int32)}


def write_count_row(model, state, batch):
    """Sets a slot's penalty counts (sampling.count_fed_tokens' row and output start) to the batch's: those of the
    prefix a session took from the prefix cache, counted on the host, as if its prefill had fed that prefix."""
    del model
    slots = state["slots"]
    num_slots = slots["context_counts"].shape[0]
    slot = jnp.where(batch["slot"] >= 0, batch["slot"], num_slots)
    counts = slots["context_counts"].at[slot].set(batch["row"], mode="drop")
    start = slots["counts_start"].at[slot].set(batch["output_start"], mode="drop")
    return {}, {**state, "slots": {**slots, "context_counts": counts, "counts_start": start}}


def write_token_masks(model, state, batch):
    """Sets bitmasks of slots ("token_mask": the batch's `slot`, its `which`) to the batch's `mask`
    (structured_outputs.write_masks)."""
    del model
    slots = state["slots"]
    num_slots = slots["token_mask"].shape[0]
    slot = jnp.where(batch["slot"] >= 0, batch["slot"], num_slots)
    masks = slots["token_mask"].at[slot, batch["which"]].set(batch["mask"], mode="drop")
    return {}, {**state, "slots": {**slots, "token_mask": masks}}


def text_batch(rows: int, chunk: int, pages_per_window: int) -> dict[str, np.ndarray]:
    """An all-padding batch of the text step (rows with num_new = 0, or slot -1, write nothing)."""
    return {
        "token_ids": np.zeros((rows, chunk), np.int32),
        "page_table": np.zeros((rows, pages_per_window), np.int32),
        "lengths": np.zeros(rows, np.int32),
        "num_new": np.zeros(rows, np.int32),
        "temperature": np.zeros(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32),
        "seed": np.zeros(rows, np.uint32),
        "position": np.zeros(rows, np.int32),
        "banned_ids": np.full((rows, sampling.MAX_BANNED_IDS), -1, np.int32),
        "num_top": np.zeros(rows, np.int32),  # how many most likely ids a row's request asks the logprobs of
        "slot": np.full(rows, -1, np.int32),
        "output_start": np.zeros(rows, np.int32),  # the position of the chunk's first output
        "presence": np.zeros(rows, np.float32),
        "frequency": np.zeros(rows, np.float32),
        "repetition": np.ones(rows, np.float32),
        "min_p": np.zeros(rows, np.float32),
        "bias_ids": np.full((rows, MAX_LOGIT_BIAS), -1, np.int32),
        "bias_values": np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
        # Per position, the prompt token after it where the row's request asks for prompt logprobs, else -1.
        "prompt_targets": np.full((rows, chunk), -1, np.int32),
        # Rows sampled under their slot's structured-output bitmask ("token_mask", sampling.GRAMMAR_MASK).
        "guided": np.zeros(rows, bool),
        # Rows sampled under their slot's allowed_token_ids and bad words bitmask (sampling.SAMPLE_MASK).
        "masked": np.zeros(rows, bool),
    }


def text_step(model, state, batch, *, stack, attention_impl):
    """Chunked prefill or decode of S rows, then per-row sampling at each row's last valid position; a prefill
    also gives the prompt logprobs of the positions `prompt_targets` names (`prompt_logprobs`)."""
    features, head, cache = _forward(model, state["stacks"][stack], batch, attention_impl)
    logits = head(select_logit_rows(features, jnp.maximum(batch["num_new"] - 1, 0)))
    slots = state["slots"]
    # Before everything else, as vLLM applies a grammar's bitmask: the logprobs are the masked logits'. The sampling
    # mask (allowed_token_ids, bad words) applies in `sample`, after the logprobs are taken, as in vLLM's sampler.
    logits = sampling.allowed_only(logits, slots["token_mask"], batch["slot"], sampling.GRAMMAR_MASK, batch["guided"])
    counts, start = sampling.count_fed_tokens(slots["context_counts"], slots["counts_start"], batch)
    penalties = sampling.Penalties(counts, jnp.clip(batch["slot"], 0, counts.shape[0] - 1), batch["presence"],
                                   batch["frequency"], batch["repetition"])
    tokens, logprobs = sampling.sample(logits, batch["temperature"], batch["top_k"], batch["top_p"],
                                       batch["seed"], batch["position"], batch["banned_ids"], min_p=batch["min_p"],
                                       logit_bias=(batch["bias_ids"], batch["bias_values"]), penalties=penalties,
                                       sample_masks=(slots["token_mask"], batch["slot"], batch["masked"]))
    top = min(MAX_LOGPROBS, logits.shape[-1])

    def most_likely(_):
        return tuple(jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), top))

    # Only a batch with a row that asks pays for it (on a CPU, as much as greedy sampling over a 131k vocabulary).
    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(batch["num_top"] > 0), most_likely,
        lambda _: (jnp.zeros((logits.shape[0], top), jnp.float32), jnp.zeros((logits.shape[0], top), jnp.int32)),
        None)
    state = {"stacks": {**state["stacks"], stack: cache}, "slots": {**slots, "context_counts": counts,
                                                                   "counts_start": start}}
    outputs = {"tokens": tokens, "logprobs": logprobs, "top_ids": top_ids, "top_logprobs": top_logprobs}
    if batch["token_ids"].shape[1] > 1:  # a decode position is never a prompt token's predecessor
        outputs.update(prompt_logprobs(head, features, batch["prompt_targets"], model.cfg.vocab_size))
    return outputs, state


def _forward(model, cache, batch, attention_impl):
    """The model over the batch: (features [S, C, ...], head, cache), head(features) being logits. A model with
    `hidden_states` (TextLM) gives its final hidden states and its LM head, so that logits are made only where they
    are wanted; any other (ToyLM) its logits at every position and the identity."""
    args = (batch["token_ids"], cache, batch["page_table"], batch["lengths"], batch["num_new"])
    if hasattr(model, "hidden_states"):
        hidden, cache = model.hidden_states(*args, attention_impl=attention_impl)
        return hidden, model.logits, cache
    logits, cache = model(*args, attention_impl=attention_impl)
    return logits, lambda logits: logits, cache


def prompt_logprobs(head, features, targets, vocab_size: int) -> dict:
    """vLLM's prompt logprobs of a prefill's positions: where `targets` [S, C] names the prompt token after a position
    (-1 elsewhere), the raw log-softmax of its logits at that token, the token's rank (the ids at least as likely,
    itself included: vLLM's) and the MAX_LOGPROBS most likely ids and their logprobs, most likely first.

    Only a batch with a target pays for them: it makes the logits of every position, a block of positions at a time
    (at most PROMPT_BLOCK_ELEMENTS logits), for every row."""
    rows, chunk = targets.shape
    top = min(MAX_LOGPROBS, vocab_size)
    size = max([size for size in range(1, chunk + 1)
                if chunk % size == 0 and rows * size * vocab_size <= PROMPT_BLOCK_ELEMENTS], default=1)

    def block(pieces):
        features, targets = pieces  # [S, size, ...], [S, size]
        logprobs = jax.nn.log_softmax(head(features).astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
        rank = jnp.sum(logprobs >= chosen[..., None], axis=-1, dtype=jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, top)
        return chosen, rank, top_ids, top_logprobs

    def by_block(x):  # [S, C, ...] -> [C / size, S, size, ...]
        return jnp.swapaxes(x.reshape(rows, chunk // size, size, *x.shape[2:]), 0, 1)

    def compute(_):
        if size == chunk:  # one block: no loop to compile
            return block((features, targets))
        blocks = jax.lax.map(block, (by_block(features), by_block(targets)))
        return tuple(jnp.swapaxes(out, 0, 1).reshape(rows, chunk, *out.shape[3:]) for out in blocks)

    def skip(_):
        return (jnp.zeros((rows, chunk), jnp.float32), jnp.zeros((rows, chunk), jnp.int32),
                jnp.zeros((rows, chunk, top), jnp.int32), jnp.zeros((rows, chunk, top), jnp.float32))

    return dict(zip(PROMPT_OUTPUTS, jax.lax.cond(jnp.any(targets >= 0), compute, skip, None)))


# -- Voxtral Realtime transcription ----------------------------------------------------------------------
# State: stacks "encoder" / "decoder"; slot rows "conv1", "conv2" (the conv stem's carried frames) and
# "last_token" (the token sampled last, fed back with the next 80 ms slot without leaving the device).
#
# The silent prefix: every stream starts with the same slots of left-pad silence and the same prompt ids,
# so the engine computes them once per delay (the scheduler's prefix cache) and a new stream's first
# prefill copies those pages into its own ("prefix_enc" / "prefix_dec": [rows, 2, pages] source and
# destination physical pages, null where nothing is copied) and starts its conv stem from the cache's slot
# row ("conv_from").

def realtime_batch(rows: int, slots: int, cfg, enc_pages: int, dec_pages: int, *, with_tokens: bool,
                   prefix_pages: tuple[int, int] = (1, 1)):
    """An all-padding batch of the realtime programs (slot index `-1` rows are padding); prefill batches
    (`with_tokens`) also carry the prefix copies of `prefix_pages` = (encoder, decoder) pages per row."""
    batch = {
        "slot": np.full(rows, -1, np.int32),
        "mel": np.zeros((rows, cfg.mel_frames_per_token * slots, cfg.encoder.num_mel_bins), np.float32),
        "num_slots": np.zeros(rows, np.int32),
        "enc_table": np.zeros((rows, enc_pages), np.int32),
        "dec_table": np.zeros((rows, dec_pages), np.int32),
        "dec_lengths": np.zeros(rows, np.int32),
        "n_delay": np.ones(rows, np.float32),
    }
    if with_tokens:
        batch["token_ids"] = np.zeros((rows, slots), np.int32)
        batch["conv_from"] = np.full(rows, -1, np.int32)
        batch["prefix_enc"] = np.zeros((rows, 2, prefix_pages[0]), np.int32)
        batch["prefix_dec"] = np.zeros((rows, 2, prefix_pages[1]), np.int32)
    return batch


def _gather_rows(rows, slot):
    return rows[jnp.clip(slot, 0, rows.shape[0] - 1)]


def _scatter_rows(rows, slot, values):
    target = jnp.where(slot < 0, rows.shape[0], slot)  # padding rows are dropped
    return rows.at[target].set(values.astype(rows.dtype), mode="drop")


def _copy_prefix(state, batch):
    """Copies the cached prefix pages of the rows that start from it (`prefix_enc` / `prefix_dec`)."""
    stacks = dict(state["stacks"])
    for name, key in (("encoder", "prefix_enc"), ("decoder", "prefix_dec")):
        source, target = batch[key][:, 0].ravel(), batch[key][:, 1].ravel()
        layers = stacks[name]
        target = jnp.where(target == NULL_PAGE, layers[0][0].shape[0], target)  # no copy: dropped
        stacks[name] = [(k.at[target].set(k[source], mode="drop"), v.at[target].set(v[source], mode="drop"))
                        for k, v in layers]
    return {"stacks": stacks, "slots": state["slots"]}


def _audio(model, state, batch, *, fresh, attention_impl):
    """The encoder over the batch's slots; returns (audio_embeds, conv rows to store, encoder cache)."""
    slots = state["slots"]
    source = batch["conv_from"] if fresh else batch["slot"]
    conv1, conv2 = _gather_rows(slots["conv1"], source), _gather_rows(slots["conv2"], source)
    if fresh:  # a session's first chunk starts from zero conv context, whatever its slot held before
        start = (batch["dec_lengths"] == 0)[:, None, None]
        conv1, conv2 = jnp.where(start, 0, conv1), jnp.where(start, 0, conv2)
    enc_lengths = batch["dec_lengths"] * model.cfg.downsample_factor
    embeds, conv, enc = model.audio_step(batch["mel"], ConvState(conv1, conv2), state["stacks"]["encoder"],
                                         batch["enc_table"], enc_lengths, batch["num_slots"],
                                         attention_impl=attention_impl)
    return embeds, conv, enc


def _realtime_state(state, batch, conv, enc, dec, last_token):
    slots = state["slots"]
    return {
        "stacks": {"encoder": enc, "decoder": dec},
        "slots": {"conv1": _scatter_rows(slots["conv1"], batch["slot"], conv.conv1),
                  "conv2": _scatter_rows(slots["conv2"], batch["slot"], conv.conv2),
                  "last_token": _scatter_rows(slots["last_token"], batch["slot"], last_token)},
    }


def realtime_prefill_step(model, state, batch, *, attention_impl):
    """Prompt slots (given tokens + their audio) of S sessions, after copying the cached prefix of those
    that start from it; the greedy token after the last one is kept on device as the session's next input
    and returned."""
    state = _copy_prefix(state, batch)
    embeds, conv, enc = _audio(model, state, batch, fresh=True, attention_impl=attention_impl)
    logits, dec = model.text_step(batch["token_ids"], embeds, batch["n_delay"], state["stacks"]["decoder"],
                                  batch["dec_table"], batch["dec_lengths"], batch["num_slots"],
                                  logits_at=jnp.maximum(batch["num_slots"] - 1, 0), attention_impl=attention_impl)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return {"tokens": token, "logprobs": _chosen_logprob(logits, token)}, _realtime_state(
        state, batch, conv, enc, dec, token)


def realtime_decode_step(model, state, batch, *, eos_id, attention_impl):
    """Up to K 80 ms steps per session in one dispatch: the encoder runs over the K slots as one chunk,
    then K decoder steps each feed the previous greedy token with the slot's audio embedding (on-device
    feedback). Rows stop after `num_slots` steps or after sampling EOS. Returns tokens [S, K] (-1 where
    no step ran) and their log-probabilities [S, K] (0 where no step ran)."""
    embeds, conv, enc = _audio(model, state, batch, fresh=False, attention_impl=attention_impl)
    num_rows, num_steps = embeds.shape[:2]
    token = _gather_rows(state["slots"]["last_token"], batch["slot"])
    zeros = jnp.zeros(num_rows, jnp.int32)

    def body(k, carry):
        token, dec, out, out_logprobs, done = carry
        valid = (k < batch["num_slots"]) & ~done
        embed = jax.lax.dynamic_slice_in_dim(embeds, k, 1, axis=1)
        logits, dec = model.text_step(token[:, None], embed, batch["n_delay"], dec, batch["dec_table"],
                                      batch["dec_lengths"] + k, valid.astype(jnp.int32), logits_at=zeros,
                                      attention_impl=attention_impl)
        sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        token = jnp.where(valid, sampled, token)
        out = out.at[:, k].set(jnp.where(valid, sampled, -1))
        out_logprobs = out_logprobs.at[:, k].set(jnp.where(valid, _chosen_logprob(logits, sampled), 0.0))
        return token, dec, out, out_logprobs, done | (valid & (sampled == eos_id))

    out = jnp.full((num_rows, num_steps), -1, jnp.int32)
    carry = (token, state["stacks"]["decoder"], out, jnp.zeros((num_rows, num_steps), jnp.float32),
             jnp.zeros(num_rows, bool))
    token, dec, out, out_logprobs, _ = jax.lax.fori_loop(0, num_steps, body, carry)
    return {"tokens": out, "logprobs": out_logprobs}, _realtime_state(state, batch, conv, enc, dec, token)


def _chosen_logprob(logits, token):
    """log softmax(logits)[token] per row, in f32 (OpenAI's transcription `logprobs`); one logsumexp over
    the vocabulary, next to the matmul that made the logits."""
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)
