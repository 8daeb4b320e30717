"""Spelling-based initialisation of a word-level vocabulary's embeddings (training only).

With one piece per word, a random embedding per word gives the audio side an arbitrary target for each of
thousands of classes, each seen a few dozen times. Starting each word's row at the (normalised) sum of
hashed random vectors of its character n-grams, as fastText does, makes words that sound alike start out
alike: the encoder can reach a word's embedding by summing what it heard, and the rows stay free parameters
afterwards. The shipped model is unchanged; only its starting point is.
"""
import zlib

import numpy as np

NGRAM_ORDERS = (1, 2, 3)
NUM_BUCKETS = 1 << 15


def char_ngrams(word: str) -> list[str]:
    """The word's letters, then its 2- and 3-grams with boundary marks (`<` and `>`)."""
    marked = f"<{word}>"
    grams = list(word) if 1 in NGRAM_ORDERS else []
    for order in (n for n in NGRAM_ORDERS if n > 1):
        grams += [marked[i : i + order] for i in range(len(marked) - order + 1)]
    return grams


def spelling_vectors(words: list[str], dim: int, seed: int) -> np.ndarray:
    """[len(words), dim] float32 unit rows: the sum of each word's hashed n-gram vectors, normalised."""
    table = np.random.default_rng(seed).standard_normal((NUM_BUCKETS, dim)).astype(np.float32)
    vectors = np.zeros((len(words), dim), np.float32)
    for row, word in enumerate(words):
        for gram in char_ngrams(word):
            vectors[row] += table[zlib.crc32(gram.encode("utf-8")) % NUM_BUCKETS]
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-6)


def word_rows(tokenizer) -> tuple[list[int], list[str]]:
    """(token ids, words) of the tokenizer's whole-word pieces: pieces that begin a word (`▁...`, decoded
    with a leading space) and spell something after it. Byte and control pieces are left out."""
    ids, words = [], []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(token_id)
        if piece.startswith(b" ") and len(piece) > 1:
            ids.append(token_id)
            words.append(piece[1:].decode("utf-8", errors="replace"))
    return ids, words


def init_word_embeddings(embedding: np.ndarray, tokenizer, seed: int) -> np.ndarray:
    """A copy of `embedding` [V, D] whose whole-word rows are their spelling vectors, scaled to the mean
    norm of the rows they replace."""
    ids, words = word_rows(tokenizer)
    out = np.array(embedding, np.float32, copy=True)
    if ids:
        scale = float(np.linalg.norm(out[ids], axis=1).mean())
        out[ids] = scale * spelling_vectors(words, out.shape[1], seed)
    return out
