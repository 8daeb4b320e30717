"""The answers of `POST /v1/audio/transcriptions` (http_transcriptions.py) in OpenAI's response formats: json, text,
verbose_json (with words, segments or both), and srt and vtt subtitles, one cue per segment."""
from aiohttp import web

from jaxstream.serving.languages import language_name

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAM_FORMATS = ("json", "text")  # as OpenAI: a stream carries text events, not subtitles
_SEGMENT_GAP_S = 1.0  # a pause this long between words starts a new segment
# Subtitle practice (Netflix's timed-text style guide): a cue at most 7 s on screen, in at most two lines of at most
# 42 characters. A model that writes no punctuation (the embedded tiny one) gave 30 s cues when only sentence ends
# and long pauses cut.
_SEGMENT_MAX_S = 7.0
_LINE_CHARS = 42
_CUE_LINES = 2


def answer(done, response_format: str, granularities: list[str], language: str,
           logprobs: list[dict] | None) -> web.Response:
    """The answer to an upload: `done` (the engine's TranscriptionDone) in `response_format`."""
    if response_format == "text":
        return web.Response(text=done.text + "\n", content_type="text/plain")
    if response_format == "json":
        body = {"text": done.text, "usage": {"type": "duration", "seconds": done.usage.audio_seconds}}
        return web.json_response(body if logprobs is None else {**body, "logprobs": logprobs})
    segments = segments_of(done.words)
    if response_format == "srt":
        return web.Response(text=_subtitles(segments, ","), content_type="application/x-subrip")
    if response_format == "vtt":
        return web.Response(text="WEBVTT\n\n" + _subtitles(segments, "."), content_type="text/vtt")
    body = {"task": "transcribe", "language": language_name(language),
            "duration": done.usage.audio_seconds, "text": done.text,
            "segments": segments if "segment" in granularities or "word" not in granularities else None,
            "usage": {"type": "duration", "seconds": done.usage.audio_seconds}}
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]
    if body["segments"] is None:
        del body["segments"]
    return web.json_response(body)


def segments_of(words) -> list[dict]:
    """Words grouped into segments (one subtitle cue each) at sentence ends, at pauses, and before a word that would
    make the segment last over _SEGMENT_MAX_S or need more than _CUE_LINES lines (the model emits no segments of its
    own); fields as Whisper's, with the statistics we do not compute left at neutral values."""
    groups, current = [], []
    for word in words:
        if current and (word.start - current[-1].end > _SEGMENT_GAP_S
                        or word.end - current[0].start > _SEGMENT_MAX_S
                        or len(_lines([w.word for w in current] + [word.word])) > _CUE_LINES):
            groups.append(current)
            current = []
        current.append(word)
        if word.word.endswith((".", "?", "!")):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return [{"id": i, "seek": 0, "start": group[0].start, "end": group[-1].end,
             "text": " ".join(w.word for w in group), "tokens": [], "temperature": 0.0, "avg_logprob": 0.0,
             "compression_ratio": 0.0, "no_speech_prob": 0.0} for i, group in enumerate(groups)]


def _lines(words: list[str]) -> list[str]:
    """`words` wrapped into lines of at most _LINE_CHARS characters (a longer word alone on its line)."""
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 1 + len(word) <= _LINE_CHARS:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"


def _subtitles(segments: list[dict], separator: str) -> str:
    """SRT cues (numbered, `,` before milliseconds) or WebVTT cues (`.`), one per segment, its text in lines."""
    cues = []
    for segment in segments:
        number = f"{segment['id'] + 1}\n" if separator == "," else ""
        text = "\n".join(_lines(segment["text"].split()))
        cues.append(f"{number}{_timestamp(segment['start'], separator)} --> "
                    f"{_timestamp(segment['end'], separator)}\n{text}\n")
    return "\n".join(cues)
