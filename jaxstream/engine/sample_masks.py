"""vLLM's `allowed_token_ids` and `bad_words`: the ids a text request may sample at a step, as a bitmask in its slot.

vLLM's sampler takes its raw logprobs first, then sets to -inf the logits of the ids outside `allowed_token_ids` and
those the bad words ban, then min_tokens' and logit_bias' (vllm/v1/sample/sampler.py): neither changes the logprobs.
Here one bitmask a slot holds both (sampling.SAMPLE_MASK, beside structured outputs' grammar bitmask, which applies
before the logprobs), and `sampling.sample` applies it after taking the logprobs; a batch without a row that uses it
pays one `lax.cond` and transfers nothing more.

Bad words (vLLM's `SamplingParams.update_from_tokenizer` and v1 `apply_bad_words`): each word, its leading spaces
stripped, is tokenized alone and after one space (that form kept only when it starts with another token and has as
many); the last token of a sequence is banned at a step when the chunk's outputs end with its other tokens, so a
one-token word is never sampled. The sequences are tokenized once per distinct list (a request's n children share
it); the bans follow the outputs on the host (`SampleMask.bans`), and a slot's bitmask is written only when the bans
its next step needs differ from what it holds (`SampleMasks.writes`): a multi-token word's bans come and go, the rest
is written once a chunk.
"""
import functools

import numpy as np

from jaxstream.engine import sampling
from jaxstream.engine.requests import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS, SamplingParams
from jaxstream.engine.structured_outputs import mask_words
from jaxstream.errors import InvalidRequestError

_TOKENIZED_LISTS = 64  # distinct bad-word lists whose tokenization is kept


def bad_word_sequences(words, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (vLLM's tokenization and refusals, in its words: InvalidRequestError). Too many
    tokens are refused as soon as the count passes the bound (vLLM counts every word's first), on the engine thread
    that serves everyone: 128 words of 1,000 characters took 46 ms to tokenize, 1 ms so."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words need a tokenizer and this model has none; use logit_bias instead")
    sequences: list[tuple[int, ...]] = []
    total = 0
    for word in words:
        for spaced in (False, True):
            try:
                ids = tuple(tokenizer.encode((" " if spaced else "") + word.lstrip()))
            except ValueError as exc:  # a lone surrogate
                raise InvalidRequestError(f"bad_words: {exc}") from None
            if not ids:
                if not spaced:
                    raise InvalidRequestError("bad_words entries must tokenize to at least one token.")
                continue
            # The spaced form only where the space makes another first token (a word of its own), as vLLM.
            if not spaced or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
                total += len(ids)
                if len(sequences) > MAX_BAD_WORDS:
                    raise InvalidRequestError(f"Too many bad words after tokenization: {len(sequences)}. The max "
                                              f"number is {MAX_BAD_WORDS}.")
                if total > MAX_BAD_WORDS_TOKENS:
                    raise InvalidRequestError(f"Too many total bad word tokens: {total}. The max is "
                                              f"{MAX_BAD_WORDS_TOKENS}.")
    outside = [token for ids in sequences for token in ids if not 0 <= token < vocab_size]
    if outside:
        raise InvalidRequestError(f"The model vocabulary size is {vocab_size}, but the following tokens were specified "
                                  f"as bad: {outside}. All token id values should be integers satisfying: 0 <= "
                                  f"token_id <= {vocab_size - 1}.")
    return tuple(sequences)


class SampleMask:
    """One chunk's: the bitmask of the ids it may sample (`allowed_token_ids`, less its one-token bad words) and its
    longer bad words, by their last token but one."""

    __slots__ = ("base", "_after")

    def __init__(self, words: int, allowed_token_ids, sequences):
        bits = np.zeros(words * 32, bool)
        if allowed_token_ids is None:
            bits[:] = True
        else:
            bits[np.asarray(allowed_token_ids, np.int64)] = True
        bits[[ids[0] for ids in sequences if len(ids) == 1]] = False
        self.base = np.packbits(bits, bitorder="little").view("<u4")  # bit i of word w: id 32 w + i
        self._after: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for ids in sequences:
            if len(ids) > 1:
                self._after.setdefault(ids[-2], []).append((ids[:-2], ids[-1]))

    def bans(self, outputs: list[int]) -> frozenset[int]:
        """The last tokens of the longer bad words whose other tokens end `outputs` (the chunk's)."""
        if not outputs:
            return frozenset()
        end = len(outputs) - 1
        return frozenset(last for before, last in self._after.get(outputs[-1], ())
                         if len(before) <= end and tuple(outputs[end - len(before):end]) == before)

    def row(self, bans: frozenset[int]) -> np.ndarray:
        """The int32 bitmask of the ids allowed at a step where `bans` are banned."""
        row = self.base.copy()
        ids = np.fromiter(bans, np.int64, len(bans))
        np.bitwise_and.at(row, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return row.view(np.int32)


class SampleMasks:
    """A text scheduler's: makes a chunk's `SampleMask` and knows what each slot's bitmask holds."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._words = mask_words(vocab_size)
        self._sequences = functools.lru_cache(_TOKENIZED_LISTS)(self._tokenized)
        self._written: dict[int, tuple[SampleMask, frozenset[int]]] = {}  # slot -> (mask, bans) it holds

    def _tokenized(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        return bad_word_sequences(words, self._tokenizer, self._vocab_size)

    def for_params(self, params: SamplingParams) -> SampleMask | None:
        """The chunk's mask, None when it restricts nothing; InvalidRequestError for bad words vLLM refuses."""
        if params.allowed_token_ids is None and params.bad_words is None:
            return None
        sequences = self._sequences(params.bad_words) if params.bad_words else ()
        return SampleMask(self._words, params.allowed_token_ids, sequences)

    def writes(self, rows) -> list[tuple[int, int, functools.partial]]:
        """(slot, SAMPLE_MASK, what makes its bitmask) for structured_outputs.write_masks: of the batch's (session,
        start, count) rows that sample under a mask (`samples_under`), those whose slot holds another (a new chunk,
        bans that changed, a slot that was another session's); recorded as written."""
        writes = []
        for session, start, count in rows:
            if not samples_under(session, start, count):
                continue
            held = (session.sample_mask, session.sample_mask.bans(session.outputs))
            if self._written.get(session.slot) != held:
                self._written[session.slot] = held
                writes.append((session.slot, sampling.SAMPLE_MASK, functools.partial(held[0].row, held[1])))
        return writes

    def forget(self, slot: int | None = None) -> None:
        """What `slot` (every slot, by default) holds is no longer known: a restore filled it with an evicted
        session's rows, or the device state was rebuilt."""
        if slot is None:
            self._written.clear()
        else:
            self._written.pop(slot, None)


def samples_under(session, start: int, count: int) -> bool:
    """Whether a row of `session` from `start` samples under its chunk's mask."""
    return session.sample_mask is not None and start + count == session.num_tokens
