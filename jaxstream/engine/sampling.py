"""On-device sampling with per-row parameters, in vLLM's order: allowed_token_ids and bad words (a slot's bitmask);
min_tokens' bans and `logit_bias`; repetition, frequency and presence penalties; then (sampled rows) temperature,
min_p, top-k, top-p and a seeded draw.

Each row draws with the key `fold_in(PRNGKey(seed), position)`, `position` being the index the sampled
token will have in the session's sequence, so a seeded session samples the same tokens whatever it is
batched with and whether or not it was preempted and recomputed.

The penalties read per-slot state kept on the device (`context_counts`), which the step that feeds tokens
updates (`count_fed_tokens`): one int32 per (slot, vocabulary id), `2 * count + seen`. `seen` says the id is
in the slot's context: every token fed through the model since the session took the slot, which is the
cumulative prompt and the chunk's outputs but the one just sampled (fed by the next step, or, the last of a
chunk, never: vLLM's streaming-input rule discards it from the context, and so from the penalties).
`count` counts the fed tokens at or past the row's `output_start` (where the chunk's outputs begin), and
starts again when a new chunk moves `output_start`. A row fed from position 0 (a new session, or one
recomputing after preemption) starts from nothing, so a recompute rebuilds the same state.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Ids a row may ban (vLLM's min_tokens: EOS and stop ids until min_tokens outputs); a fixed width keeps the
# batch's shapes static, so no request compiles a program.
MAX_BANNED_IDS = 16
# A slot's two bitmasks of the ids it may sample: structured outputs' grammar (applied before the logprobs, as vLLM
# applies it before its sampler) and allowed_token_ids less the bad words' bans (applied after them, as vLLM's
# sampler does: sample_masks.py).
GRAMMAR_MASK, SAMPLE_MASK = 0, 1


class Penalties(NamedTuple):
    """A batch's penalties: the slots' `context_counts` [slots, V], each row's slot [S] (padding rows any valid
    one), and its presence, frequency and repetition penalties [S]."""

    counts: jax.Array
    slot: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array


def count_fed_tokens(counts, start, batch):
    """`context_counts` [slots, V] and `start` [slots] (the `output_start` the counts are of) after the batch
    feeds its tokens: `token_ids` [S, C] at positions `lengths` + [0, `num_new`) of the rows' `slot` (-1:
    padding), whose outputs begin at `output_start` [S]."""
    num_slots = counts.shape[0]
    slot = batch["slot"]
    live = (slot >= 0) & (batch["num_new"] > 0)
    fresh = live & (batch["lengths"] == 0)
    new_chunk = live & (start[jnp.clip(slot, 0, num_slots - 1)] != batch["output_start"])
    reset = fresh | new_chunk

    def forget(counts):
        # Only rows that start a session or a chunk pay for touching their whole vocabulary row.
        rows = counts[jnp.clip(slot, 0, num_slots - 1)]
        rows = jnp.where(fresh[:, None], 0, jnp.where(new_chunk[:, None], rows & 1, rows))
        return counts.at[jnp.where(reset, slot, num_slots)].set(rows, mode="drop")

    counts = jax.lax.cond(jnp.any(reset), forget, lambda counts: counts, counts)
    start = start.at[jnp.where(live, slot, num_slots)].set(batch["output_start"], mode="drop")
    tokens = batch["token_ids"]
    offsets = jnp.arange(tokens.shape[1])[None, :]
    fed = live[:, None] & (offsets < batch["num_new"][:, None])
    rows = jnp.where(fed, slot[:, None], num_slots)
    is_output = batch["lengths"][:, None] + offsets >= batch["output_start"][:, None]
    counts = counts.at[rows, tokens].add(jnp.where(is_output, 2, 0), mode="drop")
    # Duplicates within the batch read the same sum and write the same value.
    seen = counts[jnp.clip(rows, 0, num_slots - 1), tokens] | 1
    return counts.at[rows, tokens].set(seen, mode="drop"), start


def filtered_logits(logits, temperature, top_k, top_p, min_p=None):
    """[S, V] logits -> temperature-scaled logits with the tokens outside min-p / top-k / top-p set to -inf.

    min_p 0 (or None) keeps every token, as do top_k <= 0 or >= V and top_p >= 1. Like vLLM, min-p applies
    first (a token is dropped when its probability is below min_p times the likeliest's), then top-k, and
    top-p then keeps the smallest set of the remaining tokens whose probability reaches top_p.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    if min_p is not None:
        # p < min_p * p_max  <=>  scaled - max(scaled) < log(min_p): no softmax, and min_p = 0 keeps everything.
        floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The top token is always kept; a token is kept while the mass above it is still below top_p. A row
    # with top_p >= 1 keeps everything: its float32 cumsum can reach 1.0 before the tail (vLLM skips it).
    keep_sorted = (mass_before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((scaled >= cutoff) & (scaled >= kth), scaled, -jnp.inf)


def allowed_only(logits, masks, slot, which: int, rows):
    """`logits` [S, V] with -inf where a `rows` [S] row's bitmask has a 0: `masks[slot, which]`, `masks` being the
    slots' bitmasks [slots, 2, ceil(V / 32)] (int32, bit i of word w for id 32 w + i; GRAMMAR_MASK or SAMPLE_MASK),
    `slot` [S] the rows' slots. A batch without such a row is left as it was, and gathers no bitmask."""

    def apply(logits):
        words = masks[jnp.clip(slot, 0, masks.shape[0] - 1), which]
        bits = (words[:, :, None] >> jnp.arange(32, dtype=words.dtype)) & 1
        allowed = bits.reshape(words.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
        return jnp.where(rows[:, None] & ~allowed, -jnp.inf, logits)

    return jax.lax.cond(jnp.any(rows), apply, lambda logits: logits, logits)


def _with_logit_bias(logits, ids, biases):
    """Adds `biases` [S, MAX_LOGIT_BIAS] at `ids` (-1 pads), when some row has any."""
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]

    def add(logits):
        return logits.at[rows, jnp.where(ids < 0, vocab, ids)].add(biases, mode="drop")

    return jax.lax.cond(jnp.any(ids >= 0), add, lambda logits: logits, logits)


def _with_penalties(logits, penalties: Penalties):
    """vLLM's `apply_penalties`, when some row has any: repetition over the context, then OpenAI's frequency and
    presence over the chunk's outputs. A row without penalties (0, 0, 1) is left exactly as it was."""

    def apply(logits):
        state = penalties.counts[penalties.slot]
        count = (state >> 1).astype(jnp.float32)
        repetition = jnp.where((state & 1).astype(bool), penalties.repetition[:, None], 1.0)
        logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
        logits = logits - penalties.frequency[:, None] * count
        return logits - penalties.presence[:, None] * (count > 0)

    active = (penalties.presence != 0) | (penalties.frequency != 0) | (penalties.repetition != 1)
    return jax.lax.cond(jnp.any(active), apply, lambda logits: logits, logits)


def sample(logits, temperature, top_k, top_p, seed, position, banned_ids=None, *, min_p=None, logit_bias=None,
           penalties: Penalties | None = None, sample_masks=None):
    """[S, V] logits and per-row params -> (tokens [S] int32, logprobs [S] f32 of the raw logits).

    temperature == 0 is greedy. The filtering pass (a sort over the vocabulary) runs only when some row
    samples. `sample_masks` is (the slots' bitmasks, the rows' slots [S], the rows [S] sampled under their slot's
    SAMPLE_MASK: `allowed_only`); `banned_ids` [S, MAX_BANNED_IDS] (-1 pads) are ids a row must not sample;
    `logit_bias` is (ids, biases) [S, MAX_LOGIT_BIAS] (-1 pads); `min_p` [S]; `penalties` as `Penalties`. Like
    vLLM's default `logprobs_mode` ("raw_logprobs"), none of them changes the logprobs, which are those of the raw
    logits.
    """
    raw = jnp.asarray(logits, jnp.float32)
    logits = raw
    if sample_masks is not None:  # vLLM's order: allowed_token_ids and bad words, then min_tokens and logit_bias
        masks, slot, rows = sample_masks
        logits = allowed_only(logits, masks, slot, SAMPLE_MASK, rows)
    if banned_ids is not None:
        vocab = logits.shape[-1]
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, jnp.where(banned_ids < 0, vocab, banned_ids)].set(-jnp.inf, mode="drop")
    if logit_bias is not None:
        logits = _with_logit_bias(logits, *logit_bias)
    if penalties is not None:
        logits = _with_penalties(logits, penalties)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, position)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        masked = filtered_logits(logits, temperature, top_k, top_p, min_p)
        drawn = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
