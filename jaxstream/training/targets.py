"""Delayed-streams training targets, exactly in Voxtral Realtime's layout (spec §1.2, §4).

A stream of N = 32 + ceil(samples / 1280) + n_delay + 11 slots (left pad, audio, right pad). The token fed at
position p is BOS at 0, STREAMING_PAD for the rest of the prompt (positions 1 .. 32 + n_delay), then the
target stream: per slot either STREAMING_PAD, or a word's STREAMING_WORD marker followed by its text pieces
on the next slots. A word whose audio ends in padded slot e (its last sample is in slot e) starts at
position e + n_delay + 1, the first position whose prediction (made at position e + n_delay) has seen
n_delay whole slots after the word: so the first word of an utterance can appear exactly at the first
generated position. A word that cannot start there because the previous word still occupies the slots
starts on the next free slot. The logits at position p are trained to predict the token at p + 1 for
p = prompt_length - 1 .. N - 2 (the last slot is never fed, as in HF `generate`).
"""
import dataclasses
import math

import numpy as np

from jaxstream.models import audio as front_end

SLOT_SECONDS = front_end.SLOT_SECONDS


@dataclasses.dataclass(frozen=True)
class StreamTokens:
    """Streaming control ids (Voxtral's layout)."""

    bos: int = 1
    pad: int = 32
    word: int = 33


def num_stream_slots(num_samples: int, n_delay: int) -> int:
    """Slots of the padded stream: left pad + audio (rounded up to whole slots) + n_delay + 11."""
    return front_end.N_LEFT_PAD_TOKENS + math.ceil(num_samples / front_end.SAMPLES_PER_SLOT) + n_delay + 1 + \
        front_end.END_OF_STREAM_BUFFER_SLOTS


def word_end_slot(end_seconds: float) -> int:
    """Padded slot holding the word's last sample."""
    last_sample = max(int(math.ceil(end_seconds * front_end.SAMPLING_RATE)) - 1, 0)
    return front_end.N_LEFT_PAD_TOKENS + last_sample // front_end.SAMPLES_PER_SLOT


def stream_tokens(word_ends: list[float], word_pieces: list[list[int]], n_delay: int, num_slots: int,
                  ids: StreamTokens = StreamTokens()) -> tuple[np.ndarray, int]:
    """Input tokens [num_slots] int32 of one stream, and the position just after its last text piece.

    Pieces that would fall past the end of the stream are dropped (the right pad of n_delay + 11 slots
    makes that rare: only a very long last word).
    """
    tokens = np.full(num_slots, ids.pad, np.int32)
    tokens[0] = ids.bos
    next_free = front_end.prompt_length(n_delay)
    for end, pieces in zip(word_ends, word_pieces):
        start = max(word_end_slot(end) + n_delay + 1, next_free)
        emitted = [ids.word, *pieces][: max(num_slots - start, 0)]
        tokens[start : start + len(emitted)] = emitted
        next_free = start + len(emitted)
    return tokens, next_free


def loss_mask(num_slots: int, n_delay: int) -> np.ndarray:
    """[num_slots] float32: 1 where the logits at p are trained (on the token at p + 1)."""
    mask = np.zeros(num_slots, np.float32)
    mask[front_end.prompt_length(n_delay) - 1 : num_slots - 1] = 1.0
    return mask


def padded_audio(audio: np.ndarray, n_delay: int) -> np.ndarray:
    """The stream the model hears: 32 silent slots, the audio, then the end-of-stream silence."""
    return front_end.pad_for_offline(np.asarray(audio, np.float32), n_delay)
