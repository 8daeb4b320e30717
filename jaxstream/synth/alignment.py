"""Word times for a synthesizer that reports none, from syntheses of the sentence's suffixes.

An engine speaks the sentence, then each suffix of it (all but its first 1, 2, ..., n - 1 words). A suffix and
the sentence come from the same voice and settings, so their spectra match word for word; only the suffix's first
word is said as a phrase start. Aligning the whole suffix to the end of the sentence (dynamic time warping with an
open start, on log-mel frames) puts the suffix's first sound on the sentence's timeline: that is where its first
word starts in the sentence. Each word then ends with its last sound before the next word's start (a pause
belongs to no word). Suffixes, not prefixes: a prefix ends its last word as a phrase end, which turns a reduced
function word into a stressed one ("a" as /eI/) and misplaced words far more often (Pico: 12 of 189 word
boundaries out of order against none). Measured against espeak-ng's own word times (tests/test_synth_pico.py),
starts and ends come ~20 ms late for half the words (the aligner starts a word at its first sound, espeak-ng
at its first phoneme) and within one 80 ms decoder slot for 98 of 100.
"""
from collections.abc import Callable

import numpy as np

from jaxstream.models import audio as front_end

# Below this a sample counts as silence: where a word's sound ends (here and in engines.py's espeak-ng times; the
# synthesizers write digital silence between words).
SILENCE_LEVEL = 3e-3
_FRAME_PAIRS = 2  # log-mel frames averaged per alignment frame: 20 ms, a quarter of a decoder slot
_MIN_WORD_SECONDS = 0.02


def alignment_features(audio: np.ndarray) -> np.ndarray:
    """(frames, mel bins) log-mel of 16 kHz audio, 20 ms frames."""
    mel = np.asarray(front_end.log_mel(audio), np.float32)
    frames = mel.shape[0] // _FRAME_PAIRS * _FRAME_PAIRS
    return mel[:frames].reshape(-1, _FRAME_PAIRS, mel.shape[1]).mean(axis=1)


def open_end_alignment(prefix: np.ndarray, whole: np.ndarray) -> int:
    """The frame of `whole` on which the last frame of `prefix` lands when all of `prefix` is aligned to a start
    of `whole`: dynamic time warping on the Euclidean frame distance with steps (1, 1), (1, 2) and (2, 1),
    so neither side runs more than twice as fast as the other (free steps let a repeated word's suffix collapse
    onto its second occurrence), weighted symmetrically (a step's weights add up to the frames it advances on
    both sides). A path's cost divided by the frames it covers is then its mean distance: the end is the one
    where that is least, so a longer stretch of `whole` is not favoured for its own sake. Reversing both aligns
    a suffix to an end."""
    distance = np.sqrt(np.maximum((prefix**2).sum(1)[:, None] + (whole**2).sum(1)[None, :]
                                  - 2.0 * prefix @ whole.T, 0.0))
    rows, columns = distance.shape
    # Two columns of padding on the left (j - 1 and j - 2 for the first columns), never reached.
    padded = np.pad(distance, ((0, 0), (2, 0)), constant_values=np.inf)
    cost = np.full((rows, columns + 2), np.inf)
    cost[0, 2] = 2.0 * distance[0, 0]
    for i in range(1, rows):
        here = padded[i, 2:]
        best = np.minimum(cost[i - 1, 1:-1] + 2.0 * here, cost[i - 1, :-2] + 2.0 * padded[i, 1:-1] + here)
        if i > 1:
            best = np.minimum(best, cost[i - 2, 1:-1] + 2.0 * padded[i - 1, 2:] + here)
        cost[i, 2:] = best
    return int(np.argmin(cost[-1, 2:] / (np.arange(1, columns + 1) + rows)))


def _sound_range(audio: np.ndarray) -> tuple[int, int] | None:
    loud = np.flatnonzero(np.abs(audio) > SILENCE_LEVEL)
    return (int(loud[0]), int(loud[-1]) + 1) if loud.size else None


def word_spans_from_suffixes(words: list[str], speak: Callable[[list[str]], np.ndarray],
                             audio: np.ndarray) -> list[tuple[float, float]] | None:
    """(start, end) seconds of each word in `audio`, which is `speak(words)`; `speak` returns 16 kHz audio of
    any list of words. None when the alignment is not plausible: a word without sound or starts out of order."""
    rate = front_end.SAMPLING_RATE
    sound = _sound_range(audio)
    if sound is None:
        return None
    reversed_whole = alignment_features(audio)[::-1]
    starts = [sound[0]]
    for k in range(1, len(words)):
        suffix = speak(words[k:])
        suffix_sound = _sound_range(suffix)
        if suffix_sound is None:
            return None
        # From its first sound on, keeping at least two alignment frames of audio (a lone "it" is short).
        kept = min(suffix_sound[0], suffix.size - front_end.WINDOW_SIZE - 2 * _FRAME_PAIRS * front_end.HOP_LENGTH)
        frame = open_end_alignment(alignment_features(suffix[max(kept, 0):])[::-1], reversed_whole)
        start = (reversed_whole.shape[0] - 1 - frame) * _FRAME_PAIRS * front_end.HOP_LENGTH
        heard = _sound_range(audio[start : sound[1]])  # the aligner may land in the pause before the word
        starts.append(start + (heard[0] if heard else 0))
    starts.append(sound[1])
    spans = []
    for start, following in zip(starts, starts[1:]):
        heard = _sound_range(audio[start:following])
        if heard is None or (heard[1] - heard[0]) < _MIN_WORD_SECONDS * rate:
            return None
        spans.append((start / rate, (start + heard[1]) / rate))
    return spans
