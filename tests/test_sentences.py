"""Sentence sources for the v2 corpora: written -> spoken normalisation, source parsing, the held-out split by
source. The installed-package tests skip where Debian's wordnet-base / fortunes are absent (CI)."""
import os

import numpy as np
import pytest

from jaxstream.synth import normalize, sentences
from jaxstream.synth.normalize import cardinal, normalize_sentence, ordinal, split_sentences, year

needs_sources = pytest.mark.skipif(not sentences.wordnet_installed(), reason="wordnet-base not installed")


@pytest.fixture(scope="module")
def whisper():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


@pytest.mark.parametrize("n", [0, 7, 13, 20, 42, 99, 100, 305, 999, 1000, 1001, 2048, 12345, 100000, 999999,
                               1000000, 2500000, 123456789])
def test_cardinals_read_back_as_digits(whisper, n):
    # Oracle: Whisper's English normaliser turns spelled-out numbers back into digits.
    assert whisper(" ".join(cardinal(n))) == str(n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 11, 12, 20, 21, 22, 33, 40, 100, 101, 112])
def test_ordinals_read_back_as_ordinal_digits(whisper, n):
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    assert whisper(" ".join(ordinal(n))) == f"{n}{suffix}"


@pytest.mark.parametrize("n, spoken", [(1984, "nineteen eighty four"), (1905, "nineteen oh five"),
                                       (1900, "nineteen hundred"), (2005, "two thousand five"),
                                       (2024, "twenty twenty four"), (1066, "one thousand sixty six")])
def test_years_are_read_as_years(n, spoken):
    assert " ".join(year(n)) == spoken


@pytest.mark.parametrize("written, spoken", [
    ("Mr. Smith met Dr. Jones at 10:05 p.m. on March 3rd, 1999.",
     "mister smith met doctor jones at ten oh five p m on march third nineteen ninety nine"),
    ("It costs $3.50, or 50% off!", "it costs three dollars and fifty cents or fifty percent off"),
    ("She owes me £2,500 & a $1 coin.", "she owes me two thousand five hundred pounds and a one dollar coin"),
    ("The 1960s and the '70s were fun.", "the nineteen sixties and the seventies were fun"),
    ('He said, "Don\u2019t - ever - do that!"', "he said don't ever do that"),
    ("Pages 10-20 are missing (see St. Paul's letter).", "pages ten to twenty are missing see saint paul's letter"),
    ("Chilean poet (1904-1973)", "chilean poet"),
    ("Meet me at 9:00 on the 21st.", "meet me at nine o'clock on the twenty first"),
    ("a well-known fact, i.e. a truism", "a well known fact that is a truism"),
    ("pi is about 3.14", "pi is about three point one four"),
])
def test_written_forms_become_spoken_words(written, spoken):
    assert normalize_sentence(written) == spoken


@pytest.mark.parametrize("written", ["x = y + 2 * z", "Visit http://example.com today", "The TV was on",
                                     "See U.N. resolutions", "use <tag> here", "#include <stdio.h>", "\u00e9t\u00e9",
                                     "a 10000000000000 dollar debt"])
def test_unspeakable_sentences_are_rejected(written):
    assert normalize_sentence(written) is None


def test_split_sentences_after_abbreviations_are_expanded():
    text = normalize.expand_abbreviations("Mr. Brown came home.  He was tired! \"Why?\" she asked. ok")
    assert split_sentences(text) == ["mister Brown came home.", "He was tired!", '"Why?" she asked. ok']


def _fake_sources(tmp_path, monkeypatch):
    """A WordNet folder and a fortunes folder with a sentence shared by a held-out and a training source."""
    wordnet, fortunes = tmp_path / "wordnet", tmp_path / "fortunes"
    wordnet.mkdir()
    fortunes.mkdir()
    (wordnet / "data.noun").write_text(
        "  1 This software and database is being provided\n"
        '00001 03 n 01 cat 0 000 | feline mammal usually having thick soft fur; "the cat sat on the mat"; '
        '"she fed 3 cats every day"\n'
        '00002 03 n 01 dog 0 000 | a member of the genus Canis; "the dog barked at the mailman all night"\n')
    (wordnet / "data.adv").write_text(
        '00003 02 r 01 quietly 0 000 | with little or no sound; "the dog barked at the mailman all night"; '
        '"she walked quietly into the room"\n')
    (fortunes / "wisdom").write_text("A penny saved is a penny earned.\n%\nLook before you leap. -- Anon\n%\n")
    (fortunes / "wisdom.dat").write_bytes(b"")
    (fortunes / "food").write_text("Never eat more than you can lift.\n\t-- Miss Piggy\n%\n")
    (fortunes / "food.dat").write_bytes(b"")
    monkeypatch.setattr(sentences, "WORDNET_DIR", os.fspath(wordnet))
    monkeypatch.setattr(sentences, "FORTUNE_DIR", os.fspath(fortunes))
    sentences.sentence_pools.cache_clear()
    sentences._held_out_set.cache_clear()


def test_pools_hold_out_whole_sources_and_drop_shared_sentences_from_training(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch)
    try:
        pools = sentences.sentence_pools()
        assert pools["held-out"] == ("a penny saved is a penny earned", "look before you leap",
                                     "she walked quietly into the room", "the dog barked at the mailman all night")
        assert pools["examples"] == ("she fed three cats every day", "the cat sat on the mat")
        assert pools["definitions"] == ("a member of the genus canis", "feline mammal usually having thick soft fur")
        assert pools["fortunes"] == ("never eat more than you can lift",)
        # The adverb file's definitions ("with little or no sound") are neither trained on nor held out.
        assert all("with little or no sound" not in pool for pool in pools.values())
        assert sentences.is_held_out_text("look before you leap")
        rng = np.random.default_rng(0)
        drawn = {sentences.training_sentence(rng) for _ in range(200)}
        assert not any(sentences.is_held_out_text(text) for text in drawn)
        assert any(text.split()[0] in ("the", "she", "please", "it", "he", "there", "my", "about", "we", "flight",
                                       "call") and any(w in text for w in ("thousand", "hundred", "o'clock"))
                   or "day" in text for text in drawn)  # the number generator is in the mix
        held_out = [sentences.held_out_sentence(5, i) for i in range(4)]
        assert sorted(held_out) == list(pools["held-out"])  # a new sentence for every index
    finally:
        sentences.sentence_pools.cache_clear()
        sentences._held_out_set.cache_clear()


def test_number_sentences_normalise_to_plain_words():
    rng = np.random.default_rng(1)
    for _ in range(300):
        spoken = normalize_sentence(sentences.number_sentence(rng))
        assert spoken is not None and all(c.isalpha() or c in " '" for c in spoken)


@needs_sources
def test_installed_held_out_sources_never_reach_training():
    # Oracle: the held-out source files re-read and normalised here, independently of the pools' own split.
    pools = sentences.sentence_pools()
    training = set().union(*(set(pool) for kind, pool in pools.items() if kind != "held-out"))
    assert len(training) > 100_000 and len(pools["held-out"]) > 3000
    held_out = set()
    _, adverb_examples = sentences.wordnet_texts(os.path.join(sentences.WORDNET_DIR, "data.adv"))
    texts = list(adverb_examples)
    for name in ("wisdom", "people", "platitudes"):
        path = os.path.join(sentences.FORTUNE_DIR, name)
        if os.path.isfile(path):
            texts += sentences.fortune_texts(path)
    for text in texts:
        spoken = normalize_sentence(text)
        if spoken and sentences.MIN_WORDS <= len(spoken.split()) <= sentences.MAX_WORDS:
            held_out.add(spoken)
    assert held_out == set(pools["held-out"])
    assert not held_out & training
    for text in list(training)[:5000] + list(held_out):
        assert all(word.replace("'", "").isalpha() and word.isascii() and word == word.lower() for word in text.split())
