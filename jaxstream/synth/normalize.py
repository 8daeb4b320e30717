"""Written English -> the words a reader speaks: numbers, ordinals, years, dates, times, money, percentages,
abbreviations; punctuation and quotes dropped. Deterministic, and strict: a sentence the rules cannot turn
into plain lowercase words (code, acronyms, URLs, odd symbols) is rejected rather than guessed at, because a
transcript that does not say what the audio says teaches the model the wrong thing.

Transcripts use only `a-z`, the apostrophe inside a word, and single spaces: the training CTC alphabet
(`training/data.py`).
"""
import re

from jaxstream.synth.words import number_words

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_ORDINAL_ONES = ("zeroth first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
                 "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"))
MONTHS = ("january february march april may june july august september october november december").split()

# Expanded before sentences are split (their dots are not sentence ends). Case matters: "St." before a name.
_ABBREVIATIONS = tuple((re.compile(pattern), spoken) for pattern, spoken in (
    (r"\bMr\.", "mister"), (r"\bMrs\.", "missus"), (r"\bMs\.", "miz"), (r"\bDr\.", "doctor"),
    (r"\bProf\.", "professor"), (r"\bSt\.(?= [A-Z])", "saint"), (r"\bSt\.", "street"), (r"\bJr\.", "junior"),
    (r"\bSr\.", "senior"), (r"\bMt\.", "mount"), (r"\bvs\.", "versus"), (r"\betc\.", "et cetera"),
    (r"\be\.g\.", "for example"), (r"\bi\.e\.", "that is"), (r"\bNo\.(?= ?\d)", "number"),
    (r"\b[aA]\.[mM]\.", "a m"), (r"\b[pP]\.[mM]\.", "p m"), (r"\bU\.S\.A?\.?", "u s"),
    (r"\bCapt\.", "captain"), (r"\bGen\.", "general"), (r"\bLt\.", "lieutenant"), (r"\bCol\.", "colonel"),
    (r"\bSgt\.", "sergeant"), (r"\bGov\.", "governor"), (r"\bSen\.", "senator"), (r"\bRev\.", "reverend"),
))
_SYMBOLS = (("&", " and "), ("+", " plus "), ("=", " equals "), ("@", " at "))
# Anything still holding one of these after the rules ran is code, markup or a diagram, not speech.
_UNSPEAKABLE = re.compile(r"[^A-Za-z0-9\s.,;:!?'\"()\-$£%/]")
_SMART = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": " - ",
                        "\u00a0": " "})
_ACRONYM = re.compile(r"\b[A-Z]{2,4}s?\b|\b(?:[A-Za-z]\.){2,}")  # TV, NASA, U.N.: spelled or not, unsure
_HAS_NUMBER = re.compile(r"[\d$£%]")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def cardinal(n: int) -> list[str]:
    """0 .. 999,999,999,999 as words ("two thousand forty eight"; no "and")."""
    if not 0 <= n < 10**12:
        raise ValueError(f"number out of range: {n}")
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        return [_ONES[n // 100], "hundred"] + (cardinal(n % 100) if n % 100 else [])
    for scale, name in _SCALES:
        if n >= scale:
            return cardinal(n // scale) + [name] + (cardinal(n % scale) if n % scale else [])
    raise AssertionError(n)


def ordinal(n: int) -> list[str]:
    """1 -> first, 22 -> twenty second, 100 -> one hundredth."""
    words = cardinal(n)
    last = words[-1]
    if last in _ONES:
        words[-1] = _ORDINAL_ONES[_ONES.index(last)]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return words


def year(n: int) -> list[str]:
    """A year as read aloud: 1984 -> nineteen eighty four, 1900 -> nineteen hundred, 1905 -> nineteen oh five,
    2005 -> two thousand five, 2024 -> twenty twenty four."""
    if 1100 <= n <= 1999:
        return number_words(n) if n % 100 else cardinal(n // 100) + ["hundred"]
    if 2010 <= n <= 2099:
        return cardinal(n // 100) + cardinal(n % 100)
    return cardinal(n)


def _digits(text: str) -> list[str]:
    return [_ONES[int(d)] for d in text]


def _number(match: re.Match) -> str:
    text = match.group(0).replace(",", "")
    whole, _, fraction = text.partition(".")
    if len(whole) == 4 and "," not in match.group(0) and not fraction and 1100 <= int(whole) <= 2099:
        return " ".join(year(int(whole)))
    words = cardinal(int(whole))
    if fraction:
        words += ["point"] + _digits(fraction)
    return " ".join(words)


def _money(match: re.Match) -> str:
    symbol, whole, cents = match.group(1), int(match.group(2).replace(",", "")), match.group(3)
    unit = ("dollar", "cent") if symbol == "$" else ("pound", "penny")
    words = cardinal(whole) + [unit[0] + ("" if whole == 1 else "s")]
    if cents and int(cents):
        plural = "pence" if unit[1] == "penny" else "cents"
        words += ["and"] + cardinal(int(cents)) + [unit[1] if int(cents) == 1 else plural]
    return " ".join(words)


def _time(match: re.Match) -> str:
    hour, minute = int(match.group(1)), int(match.group(2))
    if hour > 23 or minute > 59:
        return match.group(0)
    minutes = ["o'clock"] if minute == 0 else (["oh"] + cardinal(minute) if minute < 10 else cardinal(minute))
    return " ".join(cardinal(hour) + minutes)


def _decade(match: re.Match) -> str:
    digits = match.group(1)
    tens = int(digits[-2:])
    plural = _TENS[tens // 10][:-1] + "ies"  # twenties .. nineties
    if len(digits) == 2:
        return plural
    return " ".join(cardinal(int(digits[:2])) + [plural])


_MONTH_DAY = re.compile(r"\b(" + "|".join(m.capitalize() for m in MONTHS) + r") (\d{1,2})(?:st|nd|rd|th)?\b(?!:)")
_RULES = (
    # WordNet's lifespans, "(1877-1957)", are not read aloud in a definition; other ranges are "A to B".
    (re.compile(r"\s*\(\d{3,4}-\d{2,4}\)"), lambda m: ""),
    (re.compile(r"\b(\d+)-(\d+)\b"), lambda m: f"{m.group(1)} to {m.group(2)}"),
    (re.compile(r"([$£])(\d[\d,]*)(?:\.(\d\d))?\b"), _money),
    (re.compile(r"\b(\d{1,2}):(\d\d)\b"), _time),
    (re.compile(r"(?:\b|')(1\d[2-9]0|[2-9]0)'?s\b"), _decade),
    (_MONTH_DAY, lambda m: f"{m.group(1)} {' '.join(ordinal(int(m.group(2))))}"),
    (re.compile(r"\b(\d+)(?:st|nd|rd|th)\b"), lambda m: " ".join(ordinal(int(m.group(1))))),
    (re.compile(r"\b(\d+(?:\.\d+)?)\s?%"), lambda m: f"{m.group(1)} percent"),
    (re.compile(r"\b1/2\b"), lambda m: "one half"), (re.compile(r"\b1/4\b"), lambda m: "one quarter"),
    (re.compile(r"\b\d{1,3}(?:,\d{3})+(?:\.\d+)?\b|\b\d+(?:\.\d+)?\b"), _number),
)


def expand_abbreviations(text: str) -> str:
    """Smart quotes and dashes made plain, abbreviations spelled out: run before splitting into sentences."""
    text = text.translate(_SMART)
    if "." in text:
        for pattern, spoken in _ABBREVIATIONS:
            text = pattern.sub(spoken, text)
    return text


def normalize_sentence(text: str) -> str | None:
    """The spoken form of one written sentence (lowercase words, single spaces), or None if it holds
    something that is not plain speech (symbols, acronyms, numbers out of range)."""
    text = expand_abbreviations(text)
    for symbol, spoken in _SYMBOLS:
        text = text.replace(symbol, spoken)
    if _UNSPEAKABLE.search(text) or _ACRONYM.search(text) or "://" in text:
        return None
    try:
        for pattern, spoken in _RULES if _HAS_NUMBER.search(text) else ():
            text = pattern.sub(spoken, text)
    except ValueError:  # a number too large to say
        return None
    if re.search(r"\d|/", text):
        return None
    text = re.sub(r"[-\"().,;:!?]", " ", text.lower())
    words = [word.strip("'") for word in text.split()]
    words = [word for word in words if word]
    if not words or not all(_WORD.fullmatch(word) for word in words):
        return None
    return " ".join(words)


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? followed by space and a capital or quote (abbreviations
    must already be expanded)."""
    text = " ".join(text.split())
    return [part for part in re.split(r"(?<=[.!?])[\"']?\s+(?=[\"']?[A-Z])", text) if part.strip()]
