"""Natural English sentences for the synthetic corpus, from text that installs offline, split by source.

Sources (Debian packages; read from their installed files, nothing downloaded):
- WordNet 3.0 (`wordnet-base`, /usr/share/wordnet/data.*): each synset's example sentences (the quoted parts
  of its gloss) and its definition;
- fortune cookies (`fortunes`, `fortunes-min`, /usr/share/games/fortunes/*): quips, quotations, proverbs;
- `number_sentence`: templated written sentences with dates, times, money, percentages and counts, so the
  model hears numbers read aloud (the text sources have few).

Every sentence goes through `normalize.normalize_sentence` (written forms -> spoken words) and is kept when
it has `MIN_WORDS`..`MAX_WORDS` words. The held-out pool is whole sources the training pool never reads
(`HELD_OUT_SOURCES`: WordNet's adverb file and three fortune files), and any held-out sentence that a
training source also contains is removed from training, so no held-out sentence is ever trained on. (The
check is on exact normalised text: a proverb quoted with other words in a training source stays there.)
"""
import functools
import glob
import os
import re

import numpy as np

from jaxstream.synth.normalize import MONTHS, expand_abbreviations, normalize_sentence, split_sentences

WORDNET_DIR = "/usr/share/wordnet"
FORTUNE_DIR = "/usr/share/games/fortunes"
MIN_WORDS, MAX_WORDS = 3, 20
# Held out by source: WordNet's adverb synsets and these fortune files are never training text.
HELD_OUT_SOURCES = ("wordnet/adv/examples", "fortunes/wisdom", "fortunes/people", "fortunes/platitudes")
# Adverb definitions ("in a trusting manner") are phrases, not sentences: not held-out material, and not
# trained on either, so the adverb file stays a source training never reads.
UNUSED_SOURCES = ("wordnet/adv/definitions",)
# How a training utterance's sentence is drawn: a pool by these weights, then uniformly within it.
TRAINING_MIX = {"examples": 0.45, "fortunes": 0.2, "definitions": 0.25, "numbers": 0.1}
# Fortune files that are mostly code, art, shell sessions or non-English.
_SKIPPED_FORTUNES = {"art", "ascii-art", "perl", "linux", "linuxcookie", "debian", "computers", "translate-me",
                     "zippy", "songs-poems", "startrek", "knghtbrd", "paradoxum", "riddles", "goedel"}
NOT_INSTALLED = ("no sentence sources found: install Debian's wordnet-base and fortunes packages "
                 "(apt-get install wordnet-base fortunes fortunes-min)")
WEEKDAYS = "monday tuesday wednesday thursday friday saturday sunday".split()


def wordnet_texts(path: str) -> tuple[list[str], list[str]]:
    """(definitions, example sentences) of one WordNet data file (`data.noun` ...), in file order."""
    definitions, examples = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  ") or " | " not in line:  # the licence header
                continue
            gloss = line.split(" | ", 1)[1].strip()
            examples.extend(re.findall(r'"([^"]+)"', gloss))
            definition = gloss.split(";", 1)[0].strip()
            if '"' not in definition:
                definitions.append(definition)
    return definitions, examples


def fortune_texts(path: str) -> list[str]:
    """The sentences of one fortune file: cookies split at `%` lines, attributions (`-- Name`) dropped, then
    split into sentences."""
    with open(path, encoding="utf-8", errors="replace") as f:
        cookies = f.read().split("\n%\n")
    texts = []
    for cookie in cookies:
        lines = [line for line in cookie.splitlines() if not re.match(r"\s*(--|~~)", line)]
        # An attribution at the end of the last line: "... before you leap. -- Anon"
        body = re.sub(r"\s+--\s*[A-Z][^!?]{0,80}$", "", " ".join(lines).strip())
        body = expand_abbreviations(body)
        texts.extend(split_sentences(body))
    return texts


def wordnet_installed() -> bool:
    """Whether Debian's wordnet-base is installed: the held-out sentences come from its adverb examples."""
    return os.path.isfile(os.path.join(WORDNET_DIR, "data.noun"))


def _sources() -> dict[str, list[str]]:
    """Installed source texts by name: `wordnet/<part>/{definitions,examples}`, `fortunes/<file>`."""
    sources = {}
    for part in ("noun", "verb", "adj", "adv"):
        path = os.path.join(WORDNET_DIR, f"data.{part}")
        if os.path.isfile(path):
            definitions, examples = wordnet_texts(path)
            sources[f"wordnet/{part}/definitions"], sources[f"wordnet/{part}/examples"] = definitions, examples
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*.dat"))):
        name = os.path.basename(path)[:-4]
        if name not in _SKIPPED_FORTUNES and os.path.isfile(path[:-4]):
            sources[f"fortunes/{name}"] = fortune_texts(path[:-4])
    return sources


def source_kind(name: str) -> str:
    """"held-out", "unused", or the training kind of a source: "examples", "definitions" or "fortunes"."""
    if name in HELD_OUT_SOURCES:
        return "held-out"
    if name in UNUSED_SOURCES:
        return "unused"
    return name.rsplit("/", 1)[-1] if name.startswith("wordnet/") else "fortunes"


@functools.cache
def sentence_pools() -> dict[str, tuple[str, ...]]:
    """Normalised, deduplicated, sorted sentences by kind: "held-out" and the training kinds (`source_kind`).
    Sorted, so the pools and every corpus drawn from them depend only on the installed files. A sentence in
    the held-out pool is in no training pool. RuntimeError when no source is installed."""
    sources = _sources()
    if not sources:
        raise RuntimeError(NOT_INSTALLED)
    pools: dict[str, set[str]] = {}
    for name, texts in sources.items():
        pool = pools.setdefault(source_kind(name), set())
        for text in texts:
            spoken = normalize_sentence(text)
            if spoken and MIN_WORDS <= len(spoken.split()) <= MAX_WORDS:
                pool.add(spoken)
    held_out = pools.pop("held-out", set())
    pools.pop("unused", None)
    result = {kind: tuple(sorted(pool - held_out)) for kind, pool in sorted(pools.items())}
    result["held-out"] = tuple(sorted(held_out))
    return result


def held_out_order(seed: int) -> np.ndarray:
    """A permutation of the held-out pool: held-out corpora take sentences in this order, so a corpus of N
    utterances has N different sentences (as long as the pool lasts)."""
    return np.random.default_rng([seed, 7]).permutation(len(sentence_pools()["held-out"]))


def training_sentence(rng: np.random.Generator) -> str:
    """A training sentence (normalised): a pool drawn by `TRAINING_MIX`, then a sentence of it."""
    pools = sentence_pools()
    kinds = [kind for kind in TRAINING_MIX if kind == "numbers" or pools.get(kind)]
    weights = np.array([TRAINING_MIX[kind] for kind in kinds])
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    if kind == "numbers":
        return normalize_sentence(number_sentence(rng))
    return _pick(rng, pools[kind])


def held_out_sentence(seed: int, index: int) -> str:
    """The held-out corpus's sentence `index` (a new sentence for every index until the pool is used up)."""
    order = held_out_order(seed)
    return sentence_pools()["held-out"][int(order[index % order.size])]


def _pick(rng: np.random.Generator, items) -> str:
    return str(items[int(rng.integers(len(items)))])


def number_sentence(rng: np.random.Generator) -> str:
    """A written sentence with a number, date, time, amount or percentage (normalise it to speak it)."""
    month, day = _pick(rng, MONTHS).capitalize(), int(rng.integers(1, 29))
    suffix = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd"}.get(day, "th")
    year = int(rng.integers(1900, 2040))
    hour, minute = int(rng.integers(1, 13)), int(rng.choice([0, 5, 10, 15, 20, 30, 45, int(rng.integers(60))]))
    count = int(rng.choice([rng.integers(2, 20), rng.integers(20, 100), rng.integers(100, 1000),
                            rng.integers(1000, 100000)]))
    cents = int(rng.integers(0, 100))
    templates = (
        f"The meeting is on {month} {day}{suffix} at {hour}:{minute:02d}.",
        f"She was born on {month} {day}, {year}.",
        f"It costs ${count} and we only have ${int(rng.integers(1, 50))}.{cents:02d}.",
        f"The train leaves at {hour}:{minute:02d} from platform {int(rng.integers(1, 13))}.",
        f"There were {count:,} people at the game on {_pick(rng, WEEKDAYS).capitalize()}.",
        f"About {int(rng.integers(1, 100))}% of the votes were counted by {hour} o'clock.",
        f"Please turn to page {count} of the second book.",
        f"He finished {int(rng.integers(1, 40))}th out of {count} runners.",
        f"We moved to the city in {year} and stayed for {int(rng.integers(2, 30))} years.",
        f"The temperature dropped to {int(rng.integers(0, 40))} degrees last night.",
        f"My phone number ends in {int(rng.integers(10, 100))} {int(rng.integers(10, 100))}.",
        f"The rent went up by £{int(rng.integers(20, 900))} in {year}.",
        f"Flight {count} to Boston was delayed by {int(rng.integers(2, 59))} minutes.",
        f"Call me back on the {day}{suffix} of {month}.",
        f"The recipe needs {int(rng.integers(2, 12))} eggs and {int(rng.integers(100, 900))} grams of flour.",
    )
    return _pick(rng, templates)


def is_held_out_text(text: str) -> bool:
    """Whether a normalised sentence is in the held-out pool."""
    return text in _held_out_set()


@functools.cache
def _held_out_set() -> frozenset[str]:
    return frozenset(sentence_pools()["held-out"])
