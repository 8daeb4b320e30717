"""On-device sampling with per-row parameters: greedy, temperature, top-k, top-p and a seed.

Each row draws with the key `fold_in(PRNGKey(seed), position)`, `position` being the index the sampled
token will have in the session's sequence, so a seeded session samples the same tokens whatever it is
batched with and whether or not it was preempted and recomputed.
"""
import jax
import jax.numpy as jnp

# Ids a row may ban (vLLM's min_tokens: EOS and stop ids until min_tokens outputs); a fixed width keeps the
# batch's shapes static, so no request compiles a program.
MAX_BANNED_IDS = 16


def filtered_logits(logits, temperature, top_k, top_p):
    """[S, V] logits -> temperature-scaled logits with the tokens outside top-k / top-p set to -inf.

    top_k <= 0 or >= V keeps every token; top_p >= 1 keeps every token. Like vLLM, top-k applies first and
    top-p then keeps the smallest set of the remaining tokens whose probability reaches top_p.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
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


def sample(logits, temperature, top_k, top_p, seed, position, banned_ids=None):
    """[S, V] logits and per-row params -> (tokens [S] int32, logprobs [S] f32 of the raw logits).

    temperature == 0 is greedy. The filtering pass (a sort over the vocabulary) runs only when some row
    samples. `banned_ids` [S, MAX_BANNED_IDS] (-1 pads) are ids a row must not sample; like vLLM's logits
    processors they do not change the logprobs, which are those of the raw logits.
    """
    raw = jnp.asarray(logits, jnp.float32)
    logits = raw
    if banned_ids is not None:
        vocab = logits.shape[-1]
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, jnp.where(banned_ids < 0, vocab, banned_ids)].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, position)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        masked = filtered_logits(logits, temperature, top_k, top_p)
        drawn = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
