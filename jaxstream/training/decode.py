"""Greedy streaming transcription for the training-time eval hook (the WER every N steps).

Offline-equivalent decoding exactly as the real model runs: the padded stream's audio embeddings come from
one `audio_step` (the encoder is causal, so this equals streaming), the prompt BOS + STREAMING_PAD x
(32 + n_delay) is prefilled, then one `text_step` per 80 ms slot feeds back the argmax token. Outputs
cover positions prompt_length .. N - 1 (the last slot is never fed, as in HF `generate`).
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.models import audio as front_end
from jaxstream.models.tokenizers import Tokenizer
from jaxstream.training import targets

_EVAL_BUCKET_SLOTS = 32


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len"))
def _greedy(graphdef, params, mel, n_delay, *, prompt_len: int):
    model = nnx.merge(graphdef, params)
    batch, num_slots = mel.shape[0], mel.shape[1] // model.cfg.mel_frames_per_token
    conv_state, (enc_cache, enc_table), (cache, table) = model.init_caches(batch, cache_dtype=mel.dtype)
    zeros = jnp.zeros((batch,), jnp.int32)
    embeds, _, _ = model.audio_step(mel, conv_state, enc_cache, enc_table, zeros,
                                    jnp.full((batch,), num_slots, jnp.int32))
    ids = targets.StreamTokens()
    prompt = jnp.full((batch, prompt_len), ids.pad, jnp.int32).at[:, 0].set(ids.bos)
    ones = jnp.ones((batch,), jnp.int32)
    logits, cache = model.text_step(prompt, embeds[:, :prompt_len], n_delay, cache, table, zeros,
                                    jnp.full((batch,), prompt_len, jnp.int32),
                                    logits_at=jnp.full((batch,), prompt_len - 1))
    first = jnp.argmax(logits, -1).astype(jnp.int32)

    def step(carry, position):
        token, cache = carry
        embed = jax.lax.dynamic_slice_in_dim(embeds, position, 1, axis=1)
        logits, cache = model.text_step(token[:, None], embed, n_delay, cache, table, zeros + position, ones)
        next_token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return (next_token, cache), next_token

    positions = jnp.arange(prompt_len, num_slots - 1, dtype=jnp.int32)
    _, rest = jax.lax.scan(step, (first, cache), positions)
    return jnp.concatenate([first[:, None], rest.T], axis=1)  # tokens at positions prompt_len .. num_slots - 1


def transcribe_batch(graphdef, params, audios: list[np.ndarray], n_delay: int) -> list[list[int]]:
    """Generated token ids (controls included) of each utterance at delay `n_delay` slots."""
    prompt_len = front_end.prompt_length(n_delay)
    slots = [targets.num_stream_slots(audio.size, n_delay) for audio in audios]
    padded_slots = -(-max(slots) // _EVAL_BUCKET_SLOTS) * _EVAL_BUCKET_SLOTS
    mel = np.stack([front_end.log_mel(np.pad(targets.padded_audio(audio, n_delay),
                                             (0, (padded_slots - n) * front_end.SAMPLES_PER_SLOT)))
                    for audio, n in zip(audios, slots)])
    tokens = np.asarray(_greedy(graphdef, params, jnp.asarray(mel), jnp.full((len(audios),), float(n_delay)),
                                prompt_len=prompt_len))
    return [row[: n - prompt_len].tolist() for row, n in zip(tokens, slots)]


def transcribe_corpus(graphdef, params, tokenizer: Tokenizer, corpus_dir: str, records: list[dict], n_delay: int,
                      batch_size: int = 16) -> list[str]:
    """Greedy transcripts of manifest records (batched by similar length); audio at other rates than 16 kHz
    (a telephone held-out set's 8 kHz) is resampled, as for any transcription."""
    order = sorted(range(len(records)), key=lambda i: records[i]["duration"])
    texts: list[str] = [""] * len(records)
    for first in range(0, len(order), batch_size):
        chosen = order[first : first + batch_size]
        audios = [front_end.load_audio(os.path.join(corpus_dir, records[i]["path"])) for i in chosen]
        for index, ids in zip(chosen, transcribe_batch(graphdef, params, audios, n_delay)):
            texts[index] = tokenizer.decode(ids)
    return texts


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus-level WER after Whisper's English normalisation of both sides (the Open ASR convention)."""
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    normalize = EnglishTextNormalizer()
    refs = [normalize(text) for text in references]
    hyps = [normalize(text) for text in hypotheses]
    pairs = [(r, h) for r, h in zip(refs, hyps) if r.strip()]
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))
