"""Sentences for the synthetic corpus: packaged word lists, spoken numbers and a small template grammar.

`data/words.txt` holds 3000 common English words: the space-prefixed lowercase tokens of mistral-common's
bundled tekken vocabulary, in merge-rank order (a frequency proxy), kept when Debian's `wamerican` word list
has them (which drops sub-word fragments); words under four letters only from a short hand-picked list.
`data/names.txt` holds first names, cities, weekdays and months. Transcripts are lowercase words without
punctuation, so the model learns exactly what it hears.
"""
import hashlib
import importlib.resources

import numpy as np

_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
        "sixteen seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
# One sentence in this many (by a hash of its text) is reserved for held-out sets: training never uses it.
_HELD_OUT_MODULUS = 10


def _load(name: str) -> list[str]:
    text = importlib.resources.files("jaxstream.synth").joinpath("data", name).read_text()
    return [line.strip().lower() for line in text.splitlines() if line.strip()]


def number_words(n: int) -> list[str]:
    """0..9999 as spoken English words ("nineteen eighty four" style for years 1100..1999)."""
    if not 0 <= n <= 9999:
        raise ValueError(f"number out of range 0..9999: {n}")
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    if 1100 <= n <= 1999 and n % 100:
        return number_words(n // 100) + (["oh"] if n % 100 < 10 else []) + number_words(n % 100)
    if n < 1000:
        rest = n % 100
        return [_ONES[n // 100], "hundred"] + (number_words(rest) if rest else [])
    rest = n % 1000
    return number_words(n // 1000) + ["thousand"] + (number_words(rest) if rest else [])


def is_held_out_sentence(words: list[str]) -> bool:
    """Whether a sentence belongs to the held-out pool (a fixed hash split, independent of any seed)."""
    digest = hashlib.sha256(" ".join(words).encode()).digest()
    return int.from_bytes(digest[:4], "little") % _HELD_OUT_MODULUS == 0


class SentenceSampler:
    """Draws word sequences: mostly vocabulary words (mildly frequency-weighted), with names and numbers."""

    def __init__(self, min_words: int = 3, max_words: int = 8):
        self.words = _load("words.txt")
        self.names = _load("names.txt")
        ranks = np.arange(len(self.words))
        # A flat-ish weighting: common words are a little more frequent, rare words still seen often.
        weights = 1.0 / np.sqrt(ranks + 200.0)
        self.word_probs = weights / weights.sum()
        self.min_words, self.max_words = min_words, max_words

    @property
    def vocabulary(self) -> set[str]:
        spoken_numbers = set(_ONES) | set(_TENS[2:]) | {"hundred", "thousand", "oh"}
        return set(self.words) | set(self.names) | spoken_numbers

    def _number(self, rng: np.random.Generator) -> list[str]:
        kind = rng.integers(3)
        if kind == 0:
            return number_words(int(rng.integers(0, 100)))
        if kind == 1:
            return number_words(int(rng.integers(100, 1000)))
        return number_words(int(rng.integers(1900, 2030)))

    def sample(self, rng: np.random.Generator) -> list[str]:
        length = int(rng.integers(self.min_words, self.max_words + 1))
        words = [str(w) for w in rng.choice(self.words, size=length, p=self.word_probs)]
        extra = rng.random()
        if extra < 0.25:
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(self.names)))
        elif extra < 0.4:
            number = self._number(rng)
            position = int(rng.integers(0, len(words) + 1))
            words[position:position] = number
        return words[: self.max_words + 3]

    def sample_split(self, rng: np.random.Generator, held_out: bool) -> list[str]:
        """A sentence from the training pool or (held_out=True) the disjoint held-out pool."""
        while True:
            words = self.sample(rng)
            if is_held_out_sentence(words) == held_out:
                return words
