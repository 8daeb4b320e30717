"""Phoneme targets for the auxiliary CTC: the phonemes espeak-ng spoke, in each utterance's accent.

English spelling is a poor map of sound (`though`, `through`, `tough`), so character CTC asks a tiny encoder
to learn spelling too. The synthetic corpus knows better: espeak-ng spoke each word from its own phoneme
string, looked up in the utterance's accent (`number` ends in 3 in en-us, in a# in en-029). This module asks
espeak-ng for those strings (`-x`: its ASCII phoneme mnemonics, one call per accent for all of a corpus's
words) and turns them into CTC classes: blank, one class per phoneme (stress marks dropped), and a word
boundary between words. A mnemonic names a phoneme, not its sound: each accent's phoneme table realises it
(Scottish English says oU as [o:]).
"""
import logging
import subprocess
from collections.abc import Iterable

import numpy as np

from jaxstream.errors import UserError

# espeak-ng's English phoneme mnemonics: every symbol its eight English accents use for the synthetic
# vocabulary (`jaxstream/synth/words.py`). A symbol outside this set is dropped from a target, with a warning.
PHONEMES = (
    "0", "3", "3:", ";", "?", "@", "@-", "@2", "@L", "A:", "A@", "D", "E", "I", "I#", "I2", "IR", "N", "O2",
    "O:", "O@", "OI", "S", "T", "U", "U@", "V", "VR", "Z", "a", "a#", "aI", "aI2", "aI3", "aI@", "aU", "aa",
    "b", "d", "dZ", "e@", "eI", "f", "g", "h", "i", "i:", "i@", "i@3", "j", "k", "l", "m", "n", "n-", "o@",
    "oU", "p", "r", "r-", "s", "t", "t#", "t2", "t[", "tS", "u:", "v", "w", "w#", "z",
)
WORD_BOUNDARY = 1 + len(PHONEMES)
PHONEME_CLASSES = WORD_BOUNDARY + 1  # blank (0), the phonemes, the word boundary
_CLASS_OF = {symbol: 1 + index for index, symbol in enumerate(PHONEMES)}
_STRESS_MARKS = str.maketrans("", "", "',")
_log = logging.getLogger(__name__)


def espeak_phonemes(words: list[str], accent: str) -> list[list[str]]:
    """Each word's phoneme symbols as espeak-ng speaks it alone in `accent` (one espeak-ng call)."""
    # One word per clause: espeak-ng prints one line of phonemes per clause, so the lines pair with the words.
    text = "\n".join(f"{word}." for word in words)
    try:
        result = subprocess.run(["espeak-ng", "-q", "-v", accent, "-x", "--sep=_"], input=text, capture_output=True,
                                text=True, check=True)
    except FileNotFoundError as error:
        raise UserError("phoneme CTC targets need espeak-ng (apt-get install espeak-ng)") from error
    except subprocess.CalledProcessError as error:
        raise UserError(f"espeak-ng failed for accent {accent!r}: {error.stderr.strip()}") from error
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    if len(lines) != len(words):
        raise RuntimeError(f"espeak-ng gave {len(lines)} phoneme lines for {len(words)} words in accent {accent!r}")
    return [[symbol for symbol in line.translate(_STRESS_MARKS).split("_") if symbol] for line in lines]


def record_accent(record: dict) -> str:
    """The espeak-ng accent of a `jaxstream synth` record: the part of its voice before the variant."""
    voice = record.get("voice")
    if not voice:
        raise UserError(f"{record.get('path', record)}: phoneme CTC targets need the synthetic corpus's 'voice' field")
    return voice.split("+")[0]


class PhonemeLexicon:
    """CTC classes of utterances from the phonemes espeak-ng gives their words in their accents."""

    def __init__(self, records: Iterable[dict]):
        words_by_accent: dict[str, set[str]] = {}
        for record in records:
            words_by_accent.setdefault(record_accent(record), set()).update(w["word"] for w in record["words"])
        self._classes: dict[tuple[str, str], list[int]] = {}
        unknown: set[str] = set()
        for accent, words in sorted(words_by_accent.items()):
            ordered = sorted(words)
            for word, symbols in zip(ordered, espeak_phonemes(ordered, accent)):
                unknown.update(symbol for symbol in symbols if symbol not in _CLASS_OF)
                self._classes[accent, word] = [_CLASS_OF[symbol] for symbol in symbols if symbol in _CLASS_OF]
        if unknown:
            _log.warning("phoneme CTC targets drop espeak-ng symbols outside PHONEMES: %s", " ".join(sorted(unknown)))

    def ctc_labels(self, record: dict) -> np.ndarray:
        """The record's words as phoneme classes joined by WORD_BOUNDARY (a CTC target)."""
        accent = record_accent(record)
        labels: list[int] = []
        for index, word in enumerate(record["words"]):
            labels += ([WORD_BOUNDARY] if index else []) + self._classes[accent, word["word"]]
        return np.asarray(labels, np.int32)
