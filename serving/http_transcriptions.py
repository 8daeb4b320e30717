"""OpenAI's `POST /v1/audio/transcriptions` over the realtime engine (specs/realtime_protocols.md §8).

A multipart upload as OpenAI's SDK sends it: `file`, `model`, `response_format` (json | text | verbose_json
| srt | vtt), `timestamp_granularities[]` (segment, word), `stream`, and fields we accept and ignore
(`language`, `prompt`, `temperature`, `include[]`: the model neither needs nor uses them). The file is decoded
with soundfile and resampled to 16 kHz (`load_audio`) off the event loop, then streamed into one engine
session. With `stream=true` the answer is SSE: `transcript.text.delta` events then `transcript.text.done`,
and the engine session is aborted as soon as the client goes away.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. `pump_transcription` and the
error helpers are shared with the Mode B sessions (http_sessions.py).
"""
import asyncio
import logging
import time

from aiohttp import web

from jaxstream.engine.transcription_session import TranscriptionDelta, TranscriptionDone
from jaxstream.errors import EngineError
from jaxstream.models.audio import SAMPLING_RATE, AudioError, load_audio
from jaxstream.serving import sse

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 25 << 20  # OpenAI's upload limit
_FIELD_BYTES = 4 << 10  # a form field that is not the file
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
_STREAM_FORMATS = ("json", "text")  # as OpenAI: a stream carries text events, not subtitles
_SEGMENT_GAP_S = 1.0  # a pause this long between words starts a new segment
_SEGMENT_MAX_S = 30.0
_PUMP_END_S = 5.0
_DISCONNECT_POLL_S = 0.25
# Engine error code -> HTTP status. Capacity and draining are worth retrying elsewhere or later.
_ENGINE_STATUS = {"capacity": 503, "draining": 503, "engine_dead": 503, "backlog": 503,
                  "invalid_audio": 400, "invalid_request": 400, "session_closed": 409}


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error code, message, offending parameter."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_response(status: int, code: str, message: str, param: str | None = None) -> web.Response:
    error_type = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return web.json_response({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                             status=status, headers=headers)


def engine_request_error(exc: EngineError) -> RequestError:
    return RequestError(_ENGINE_STATUS.get(exc.code, 500), exc.code, str(exc))


def check_ready(state) -> None:
    """RequestError 503 while the model loads, the server drains or the engine is dead (as /health)."""
    status, body = state.health()
    if status != 200:
        raise RequestError(503, body["status"], f"The server cannot transcribe now: {body['status']}")


def check_model(state, model) -> None:
    if not isinstance(model, str) or not model:
        raise RequestError(400, "invalid_request", "Missing required parameter: 'model'", "model")
    if not state.serves_model(model, allow_empty=False):
        raise RequestError(404, "model_not_found", f"The model `{model}` does not exist.", "model")


def text_usage(done) -> dict:
    prompt, output = done.usage.prompt_tokens, done.usage.output_tokens
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "seconds": done.usage.audio_seconds}


async def pump_transcription(session, log: sse.EventLog | None, metrics, first_audio_at: float):
    """Iterates an engine session to its end, appending OpenAI stream events to `log` (when given), and
    returns the TranscriptionDone; EngineError when it failed, None when it was aborted."""
    first = True
    try:
        async for event in session:
            if isinstance(event, TranscriptionDelta):
                if first:
                    first = False
                    metrics.first_delta.observe(time.monotonic() - first_audio_at)
                if log is not None and event.text:
                    log.append({"type": "transcript.text.delta", "delta": event.text, "logprobs": None})
            elif isinstance(event, TranscriptionDone):
                metrics.utterances.labels(outcome="done").inc()
                if log is not None:
                    log.append({"type": "transcript.text.done", "text": event.text, "logprobs": None,
                                "usage": text_usage(event)})
                return event
    except EngineError as exc:
        metrics.utterances.labels(outcome="error").inc()
        metrics.errors.labels(code=exc.code).inc()
        if log is not None:
            log.append(sse.error_payload(str(exc), exc.code))
        raise
    finally:
        if log is not None:
            log.close()
    metrics.utterances.labels(outcome="aborted").inc()
    return None


# -- the request ------------------------------------------------------------------------------------------
async def _read_part(part, limit: int, name: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(64 << 10):
        data += chunk
        if len(data) > limit:
            raise RequestError(413, "file_too_large" if name == "file" else "field_too_large",
                               f"`{name}` is larger than {limit} bytes", name)
    return bytes(data)


async def _parse_form(request: web.Request) -> tuple[bytes, dict, list[str]]:
    """(file bytes, the other fields, timestamp granularities). The multipart reader is used directly:
    the app's body limit is sized for small JSON, not uploads."""
    if not request.content_type.startswith("multipart/form-data"):
        raise RequestError(400, "invalid_request", "Send the audio as multipart/form-data with a `file` field")
    reader = await request.multipart()
    audio, fields, granularities = None, {}, []
    async for part in reader:
        if part.name == "file":
            audio = await _read_part(part, MAX_FILE_BYTES, "file")
        elif part.name:
            value = (await _read_part(part, _FIELD_BYTES, part.name)).decode("utf-8", "replace")
            if part.name in ("timestamp_granularities[]", "timestamp_granularities"):
                granularities.append(value)
            else:
                fields[part.name] = value
    if not audio:
        raise RequestError(400, "invalid_request", "Missing required parameter: 'file'", "file")
    return audio, fields, granularities


def _flag(fields: dict, name: str) -> bool:
    value = fields.get(name, "false").strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise RequestError(400, "invalid_request", f"`{name}` must be true or false, got {value!r}", name)
    return value in ("true", "1")


async def _decode(audio: bytes, state):
    try:
        pcm = await asyncio.to_thread(load_audio, audio)
    except AudioError as exc:
        raise RequestError(400, "invalid_audio", f"Could not decode the audio file: {exc}", "file") from None
    seconds = pcm.size / SAMPLING_RATE
    if seconds > state.config.limits.max_audio_seconds:
        raise RequestError(400, "audio_too_long", f"The audio lasts {seconds:.0f} s, more than the limit of "
                           f"{state.config.limits.max_audio_seconds:g} s", "file")
    if pcm.size == 0:
        raise RequestError(400, "invalid_audio", "The audio file holds no samples", "file")
    return pcm


async def _feed(session, pcm) -> None:
    """Appends the whole recording, then ends it; the engine's backpressure paces the appends."""
    step = 10 * SAMPLING_RATE  # chunks of 10 s, so an abort stops the feeding early
    for begin in range(0, pcm.size, step):
        if session.outcome is not None:
            return
        await session.append(pcm[begin:begin + step])
    await session.finish()


def server_state(request: web.Request):
    from jaxstream.serving.app import SERVER  # app.py imports this module to register its routes

    return request.app[SERVER]


async def transcriptions(request: web.Request) -> web.StreamResponse:
    state = server_state(request)
    try:
        check_ready(state)
        audio, fields, granularities = await _parse_form(request)
        check_model(state, fields.get("model"))
        response_format = fields.get("response_format", "json")
        if response_format not in RESPONSE_FORMATS:
            raise RequestError(400, "invalid_request", f"response_format must be one of "
                               f"{', '.join(RESPONSE_FORMATS)}, got {response_format!r}", "response_format")
        unknown = set(granularities) - {"word", "segment"}
        if unknown:
            raise RequestError(400, "invalid_request", f"Unknown timestamp granularity {sorted(unknown)[0]!r}; "
                               "use word or segment", "timestamp_granularities[]")
        stream = _flag(fields, "stream")
        if stream and response_format not in _STREAM_FORMATS:
            raise RequestError(400, "invalid_request", f"response_format {response_format!r} cannot be "
                               "streamed; use json or text", "response_format")
        pcm = await _decode(audio, state)
        try:
            session = await state.engine.start_transcription()
        except EngineError as exc:
            raise engine_request_error(exc) from None
    except RequestError as exc:
        state.metrics.errors.labels(code=exc.code).inc()
        return error_response(exc.status, exc.code, str(exc), exc.param)
    state.metrics.audio_seconds.inc(pcm.size / SAMPLING_RATE)
    feeder = asyncio.create_task(_feed(session, pcm))
    log = sse.EventLog() if stream else None
    pump = asyncio.create_task(pump_transcription(session, log, state.metrics, time.monotonic()))
    try:
        if stream:
            response, complete = await sse.stream_log(request, log)
            if not complete:
                await session.abort("client_disconnected")
            return response
        while not pump.done():  # a plain response writes nothing until the end: watch the socket instead
            await asyncio.wait([pump], timeout=_DISCONNECT_POLL_S)
            if sse.client_gone(request):
                await session.abort("client_disconnected")
                return web.Response(status=499)  # nobody reads it; aiohttp logs the status
        try:
            done = pump.result()
        except EngineError as exc:
            return error_response(_ENGINE_STATUS.get(exc.code, 500), exc.code, str(exc))
        if done is None:
            return error_response(500, "aborted", "The transcription was aborted")
        return _answer(done, response_format, granularities, fields)
    finally:
        await session.abort("request_ended")  # no-op once done; frees the engine when the handler fails
        feeder.cancel()
        # An aborted session's iterator ends by itself (the engine delivers its end), so the pump gets to
        # count the outcome; the timeout only guards against an engine that died meanwhile.
        await asyncio.wait([pump], timeout=_PUMP_END_S)
        pump.cancel()
        for result in await asyncio.gather(feeder, pump, return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, (EngineError, asyncio.CancelledError)):
                logger.warning("transcription task failed: %r", result)


# -- answers ----------------------------------------------------------------------------------------------
def _answer(done, response_format: str, granularities: list[str], fields: dict) -> web.Response:
    if response_format == "text":
        return web.Response(text=done.text + "\n", content_type="text/plain")
    if response_format == "json":
        return web.json_response({"text": done.text, "usage": {"type": "duration",
                                                              "seconds": done.usage.audio_seconds}})
    segments = _segments(done.words)
    if response_format == "srt":
        return web.Response(text=_subtitles(segments, ","), content_type="application/x-subrip")
    if response_format == "vtt":
        return web.Response(text="WEBVTT\n\n" + _subtitles(segments, "."), content_type="text/vtt")
    body = {"task": "transcribe", "language": fields.get("language", ""),
            "duration": done.usage.audio_seconds, "text": done.text,
            "segments": segments if "segment" in granularities or "word" not in granularities else None,
            "usage": {"type": "duration", "seconds": done.usage.audio_seconds}}
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]
    if body["segments"] is None:
        del body["segments"]
    return web.json_response(body)


def _segments(words) -> list[dict]:
    """Words grouped into segments at sentence ends, pauses and every 30 s (the model emits no segments of
    its own); fields as Whisper's, with the statistics we do not compute left at neutral values."""
    groups, current = [], []
    for word in words:
        if current and (word.start - current[-1].end > _SEGMENT_GAP_S
                        or word.end - current[0].start > _SEGMENT_MAX_S):
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


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"


def _subtitles(segments: list[dict], separator: str) -> str:
    """SRT cues (numbered, `,` before milliseconds) or WebVTT cues (`.`), one per segment."""
    cues = []
    for segment in segments:
        number = f"{segment['id'] + 1}\n" if separator == "," else ""
        cues.append(f"{number}{_timestamp(segment['start'], separator)} --> "
                    f"{_timestamp(segment['end'], separator)}\n{segment['text']}\n")
    return "\n".join(cues)


def add_transcription_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
