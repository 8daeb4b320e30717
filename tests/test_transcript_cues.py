"""Subtitle cues of `POST /v1/audio/transcriptions` (response_format srt / vtt) and the verbose_json segments they
are made of: short cues for a transcript without punctuation, as subtitle readers expect them."""
import json
import re
import textwrap

from jaxstream.engine.transcription_session import TranscriptionDone, TranscriptionUsage, WordTiming
from jaxstream.serving.transcript_formats import answer

MAX_CUE_S = 7.0  # Netflix's timed-text style guide: at most 7 s a cue, two lines of at most 42 characters
LINE_CHARS = 42
CUE_LINES = 2
PAUSE_S = 1.0  # a pause longer than this starts a new cue

# What the embedded tiny model writes: lower case, no punctuation. One 1.5 s pause, after "river".
SPOKEN = ("the old man walked along the river every morning before the sun came up and the birds began to sing "
          "in the tall trees near the water where he used to fish with his father when he was a small boy "
          "nobody in the village remembered when he had started")


def _done(words: list[WordTiming]) -> TranscriptionDone:
    return TranscriptionDone(text=" ".join(w.word for w in words), token_ids=[], words=words, delay_ms=480,
                             usage=TranscriptionUsage(words[-1].end + 0.5, 0, 0), logprobs=[])


def _words(text: str, pause_after: dict[int, float]) -> list[WordTiming]:
    """Each word 0.2 s plus 40 ms a letter, 0.15 s apart, with longer pauses after the given word indices."""
    words, time = [], 0.3
    for index, word in enumerate(text.split()):
        end = round(time + 0.2 + 0.04 * len(word), 3)
        words.append(WordTiming(word, round(time, 3), end))
        time = end + pause_after.get(index, 0.15)
    return words


def _seconds(stamp: str) -> float:
    hours, minutes, seconds, ms = map(int, re.split(r"[:,.]", stamp))
    return (3_600_000 * hours + 60_000 * minutes + 1000 * seconds + ms) / 1000  # as the word times: 3.72, not 3.7199...


def _cues(subtitles: str, srt: bool) -> list[tuple[float, float, list[str]]]:
    blocks = subtitles.strip().split("\n\n")
    if not srt:
        assert blocks.pop(0) == "WEBVTT"
    cues = []
    for number, block in enumerate(blocks, 1):
        lines = block.split("\n")
        if srt:
            assert lines.pop(0) == str(number)
        start, end = lines[0].split(" --> ")
        cues.append((_seconds(start), _seconds(end), lines[1:]))
    return cues


def test_a_transcript_without_punctuation_gets_short_cues_in_both_formats():
    """The splitter cut at sentence ends, at pauses over 1 s and at 30 s only: these words were two cues, of the
    5 s before the pause and the 21 s after it."""
    pause_after = SPOKEN.split().index("river")
    words = _words(SPOKEN, {pause_after: 1.5})
    assert words[-1].end - words[pause_after + 1].start > 20
    done = _done(words)
    srt = _cues(answer(done, "srt", [], "en", None).text, srt=True)
    vtt = _cues(answer(done, "vtt", [], "en", None).text, srt=False)
    assert srt == vtt
    segments = json.loads(answer(done, "verbose_json", ["segment"], "en", None).text)["segments"]
    assert [(s["start"], s["end"], textwrap.wrap(s["text"], LINE_CHARS)) for s in segments] == srt  # one cue each

    assert [word for _, _, lines in srt for line in lines for word in line.split()] == SPOKEN.split()
    position = 0
    for index, (start, end, lines) in enumerate(srt):
        cue_words = words[position:position + sum(len(line.split()) for line in lines)]
        assert (start, end) == (cue_words[0].start, cue_words[-1].end)
        assert end - start <= MAX_CUE_S and 1 <= len(lines) <= CUE_LINES
        assert lines == textwrap.wrap(" ".join(w.word for w in cue_words), LINE_CHARS)  # lines of <= 42 characters
        position += len(cue_words)
        if index + 1 < len(srt):  # each cut has its reason: a pause, or the next word would break a bound
            following = words[position]
            longer = textwrap.wrap(" ".join(w.word for w in [*cue_words, following]), LINE_CHARS)
            assert (following.start - cue_words[-1].end > PAUSE_S or following.end - start > MAX_CUE_S
                    or len(longer) > CUE_LINES), (lines, following)
    assert any(srt_cue[2][-1].endswith("river") for srt_cue in srt)  # the pause cut there
    assert len(srt) >= 5


def test_sentence_ends_still_cut():
    words = _words("Hello there. How are you today? Fine.", {})
    done = _done(words)
    cues = _cues(answer(done, "srt", [], "en", None).text, srt=True)
    assert [lines for _, _, lines in cues] == [["Hello there."], ["How are you today?"], ["Fine."]]
