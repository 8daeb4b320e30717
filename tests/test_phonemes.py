"""Phoneme CTC targets (`jaxstream/training/phonemes.py`) against espeak-ng's own phoneme strings."""
import shutil

import numpy as np
import pytest

from jaxstream.errors import UserError
from jaxstream.synth import SentenceSampler
from jaxstream.synth.espeak import ACCENTS
from jaxstream.training import phonemes

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")


def test_phonemes_follow_the_accent_without_stress_marks():
    # espeak-ng's English mnemonics (`espeak-ng -x`): `number` ends in 3 (the NURSE vowel) in en-us and in
    # a# in Caribbean English (en-029); `presence` is stressed on its first syllable ('E), and the stress mark
    # is not a phoneme.
    assert phonemes.espeak_phonemes(["number", "presence"], "en-us") == [["n", "V", "m", "b", "3"],
                                                                         ["p", "r", "E", "z", "@", "n", "s"]]
    assert phonemes.espeak_phonemes(["number"], "en-029") == [["n", "V", "m", "b", "a#"]]


def test_every_phoneme_of_the_vocabulary_has_a_class():
    words = sorted(SentenceSampler().vocabulary)
    for accent in ACCENTS:
        used = {symbol for word in phonemes.espeak_phonemes(words, accent) for symbol in word}
        assert used <= set(phonemes.PHONEMES), (accent, used - set(phonemes.PHONEMES))


def test_lexicon_labels_join_each_accents_words_with_a_boundary():
    def record(text, voice):
        return {"path": f"{voice}.flac", "voice": voice, "words": [{"word": word} for word in text.split()]}

    us, caribbean = record("sole number sole", "en-us+m1"), record("number", "en-029+f2")
    lexicon = phonemes.PhonemeLexicon([us, caribbean])
    class_of = {symbol: 1 + index for index, symbol in enumerate(phonemes.PHONEMES)}
    sole, number = ([class_of[s] for s in word] for word in phonemes.espeak_phonemes(["sole", "number"], "en-us"))
    boundary = [phonemes.WORD_BOUNDARY]
    np.testing.assert_array_equal(lexicon.ctc_labels(us), sole + boundary + number + boundary + sole)
    np.testing.assert_array_equal(lexicon.ctc_labels(caribbean), [class_of[s] for s in ("n", "V", "m", "b", "a#")])
    assert 0 < min(lexicon.ctc_labels(us)) and max(lexicon.ctc_labels(us)) < phonemes.PHONEME_CLASSES
    with pytest.raises(UserError, match="need the synthetic corpus's 'voice' field"):
        phonemes.PhonemeLexicon([{"path": "x.flac", "words": [{"word": "sole"}]}])


def test_an_unknown_accent_is_a_clear_error():
    with pytest.raises(UserError, match="espeak-ng failed for accent 'xx-nowhere'"):
        phonemes.espeak_phonemes(["sole"], "xx-nowhere")
