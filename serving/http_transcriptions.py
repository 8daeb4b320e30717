"""OpenAI's `POST /v1/audio/transcriptions` over the realtime engine (specs/realtime_protocols.md §7.1, §8).

A multipart upload as OpenAI's SDK sends it: `file`, `model`, `response_format` (json | text | verbose_json
| srt | vtt), `timestamp_granularities[]` (segment, word; verbose_json only, as OpenAI), `stream`,
`include[]=logprobs` (json only, as OpenAI: each text token's `{token, logprob, bytes}` in the answer and the stream
events), `language` (an ISO-639-1 code, as vLLM takes one: of OpenAI's list, or another of Whisper's with a warning
logged; languages.py; verbose_json reports it by name, as OpenAI does), and fields the model neither needs nor
uses, checked as OpenAI types them and otherwise ignored (`temperature`, a number from 0 to 1: the model decodes
greedily; `chunking_strategy`, "auto" or a server_vad object: the audio streams through whole; `languages[]`, codes
as `language`'s; `prompt`, any text up to 1 MiB; the rest, short text). A field that does not parse is a 400, as
OpenAI answers it.
An empty file is an `invalid_audio` 400; one that does not decode names its filename and the formats the decoder
reads. The form is read before the request is admitted, so it must keep arriving at a minimum average rate after
a grace period (`body_grace_s`, `body_min_rate`; a slower body is a 408 that closes the connection). Once the
request is admitted, the file is decoded with soundfile and resampled to 16 kHz (`load_audio`) off the event
loop, no further than the server's audio limit, then streamed into one engine session. With `stream=true` the
answer is SSE: `transcript.text.delta` events then `transcript.text.done`, and the engine session is aborted as
soon as the client goes away.

With `X-Streaming-Input: true` the body is Mode A's NDJSON instead (streaming_input.py): an optional
parameters line (`model`, `delay_ms`, `include: ["logprobs"]`, `language`, `start_policy`, `response_format` json
or text, ...), then chunks of base64 PCM16 16 kHz audio; the answer is the same SSE stream, produced while the
audio still arrives (a parameter asking for another answer, `stream: false` or srt, is refused as the upload's is).

`AudioInput` is the engine side of an audio stream for Mode A and Mode B (http_sessions.py) alike;
`pump_transcription` turns an engine session's events into the OpenAI stream events; transcript_formats.py writes
an upload's answer in its response_format.
"""
import asyncio
import logging
import math
import time

import numpy as np
from aiohttp import BodyPartReader, web

from jaxstream.engine.transcription_session import TranscriptionDelta, TranscriptionDone
from jaxstream.errors import CapacityError, EngineError
from jaxstream.models.audio import SAMPLING_RATE, AudioError, AudioTooLongError, load_audio
from jaxstream.serving import sse, streaming_input, wire_json
from jaxstream.serving.audio_codecs import AudioDecodeError, decode_pcm16_base64
from jaxstream.serving.engine_sessions import start_session, token_logprobs
from jaxstream.serving.http_errors import (
    RequestError, body_read, check_model, check_ready, engine_request_error, error_response,
    read_before_admission, server_state,
)
from jaxstream.serving.languages import OTHER as OTHER_LANGUAGES
from jaxstream.serving.languages import find_language, language_name
from jaxstream.serving.limits import drain_notice, drain_truncation, holds_stream
from jaxstream.serving.transcript_formats import RESPONSE_FORMATS, STREAM_FORMATS, answer

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 25 << 20  # OpenAI's upload limit
_FIELD_BYTES = 4 << 10  # a form field that is not the file
# `prompt`: OpenAI takes a long one (its model reads the last 224 tokens of it) and vLLM any up to Starlette's
# 1 MiB a form part, which its Voxtral ignores, as this server's models do: it is counted, never kept.
_PROMPT_BYTES = 1 << 20
# The whole form: the file, a prompt and some fields. OpenAI's SDK sends a dozen parts at most; without these caps
# a body of endless small fields (or a gzip body inflating to them) was read whole, each field kept.
_FORM_BYTES = MAX_FILE_BYTES + _PROMPT_BYTES + (1 << 20)
_MAX_PARTS = 64
# The fields the route reads or checks; others are skipped. chunking_strategy's server_vad object comes as
# `chunking_strategy[type]`, ... (the SDK's bracketed form), read as fields too.
_FIELDS = ("model", "response_format", "stream", "language", "temperature", "chunking_strategy")
_OBJECT_FIELDS = ("chunking_strategy[",)
_LIST_FIELDS = ("timestamp_granularities", "include", "languages")
_VAD_INTS = ("prefix_padding_ms", "silence_duration_ms")
_CHUNKING_STRATEGY = ('chunking_strategy must be "auto" or a server_vad object: type=server_vad, '
                      f"{' and '.join(_VAD_INTS)} (whole milliseconds), threshold (from 0 to 1)")
_SHOWN = 40  # characters of a refused value or a filename echoed in an error
# What verbose_json reports when the request names no language. The models served here detect none and their
# metadata names none; both transcribe English by default (the embedded tiny model was trained on English only),
# as vLLM assumes `en` for its Whisper models when a request names none.
DEFAULT_LANGUAGE = "en"
_PUMP_END_S = 5.0


def text_usage(done) -> dict:
    prompt, output = done.usage.prompt_tokens, done.usage.output_tokens
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "seconds": done.usage.audio_seconds}


async def pump_transcription(session, log: sse.EventLog | None, metrics, first_audio_at: float,
                             tokenizer=None, truncation=lambda done: {}):
    """Iterates an engine session to its end, appending OpenAI stream events to `log` (when given), and
    returns the TranscriptionDone; EngineError when it failed, None when it was aborted. With `tokenizer`,
    the events carry `logprobs`. `truncation(done)` gives the fields of a done the drain cut short (AudioInput's):
    its notice goes right before the done, after the last delta, as on the WebSocket protocols."""

    def logprobs(event):
        return None if tokenizer is None else token_logprobs(tokenizer, event.token_ids, event.logprobs)

    first = True
    try:
        async for event in session:
            if isinstance(event, TranscriptionDelta):
                if first:
                    first = False
                    metrics.first_delta.observe(time.monotonic() - first_audio_at)
                if log is not None and event.text:
                    log.append({"type": "transcript.text.delta", "delta": event.text, "logprobs": logprobs(event)})
            elif isinstance(event, TranscriptionDone):
                metrics.utterances.labels(outcome="done").inc()
                if log is not None:
                    fields = truncation(event)
                    if fields:
                        sse.log_error(log, "server_draining", fields["truncation"]["message"], metrics)
                    log.append({"type": "transcript.text.done", "text": event.text, "logprobs": logprobs(event),
                                "usage": text_usage(event), **fields})
                return event
    except EngineError as exc:
        metrics.utterances.labels(outcome="error").inc()
        sse.close_with_error(log, exc.code, str(exc), metrics)
        raise
    finally:
        if log is not None:
            log.close()
    metrics.utterances.labels(outcome="aborted").inc()
    return None


class AudioInput(streaming_input.EngineInput):
    """The engine side of one streamed audio input: a transcription session, started on demand, whose
    events go to `log` (see streaming_input.py for the interface)."""

    modality = "audio"

    def __init__(self, state, delay_ms: int | None = None, log: sse.EventLog | None = None, *,
                 logprobs: bool = False, seconds: float | None = None):
        super().__init__(state, log)
        self.delay_ms = delay_ms
        # The most audio this input can carry: a decoded file's length, else the server's limit.
        self.seconds = state.config.limits.max_audio_seconds if seconds is None else seconds
        self.logprobs = logprobs
        self.session = None
        self.outcome: TranscriptionDone | EngineError | None = None

    @property
    def started(self) -> bool:
        return self.session is not None

    @property
    def failure(self) -> EngineError | None:
        return self.outcome if isinstance(self.outcome, EngineError) else None

    @property
    def succeeded(self) -> bool:
        return isinstance(self.outcome, TranscriptionDone)

    def decode(self, payload: str) -> np.ndarray:
        limit = int(self.state.config.limits.max_append_seconds * SAMPLING_RATE)
        try:
            return decode_pcm16_base64(payload, max_samples=limit)
        except AudioDecodeError as exc:
            raise RequestError(422, "invalid_audio", f"payload: {exc}", "payload") from None

    @staticmethod
    def measure(pcm: np.ndarray) -> tuple[int, float]:
        return 2 * pcm.size, pcm.size / SAMPLING_RATE  # bytes as received: PCM16

    @staticmethod
    def join(pieces: list) -> np.ndarray:
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def progress(self) -> int:
        """Audio slots the engine has computed: silence yields no text, and is work all the same."""
        return 0 if self.session is None else self.session.backlog.consumed

    async def start(self) -> None:
        self.session = await start_session(self.state.engine, self.delay_ms, max_audio_seconds=self.seconds)
        self._pump = asyncio.create_task(self._run_pump(time.monotonic()))

    async def _run_pump(self, started_at: float) -> None:
        try:
            self.outcome = await pump_transcription(self.session, self.log, self.state.metrics, started_at,
                                                    self.state.engine.tokenizer if self.logprobs else None,
                                                    self.truncation)
        except EngineError as exc:
            self.outcome = exc
        finally:
            self._done.set()

    async def append(self, pcm: np.ndarray) -> None:
        self.state.metrics.audio_seconds.inc(pcm.size / SAMPLING_RATE)
        await self.session.append(pcm)

    async def finish(self) -> None:
        await self.session.finish()

    async def abort(self, reason: str) -> None:
        if self.session is not None:
            await self.session.abort(reason)  # the pump then ends and closes the log
        elif not self.done:
            if self.log is not None:
                self.log.close()
            self._done.set()

    async def wait(self, timeout: float | None = None) -> TranscriptionDone | EngineError | None:
        """The outcome once the session ended: its result, its error, or None when it was aborted."""
        await self._wait_done(timeout)
        return self.outcome

    async def close(self) -> None:
        """Aborts what still runs and waits for the pump, which counts the outcome (bounded: an aborted
        session's iterator ends by itself; the timeout guards against an engine that died meanwhile)."""
        await self.abort("request_ended")
        if self._pump is not None:
            await asyncio.wait([self._pump], timeout=_PUMP_END_S)
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)

    def truncation(self, done: TranscriptionDone) -> dict:
        """`truncated` and `truncation` when the drain ended the input (`drained`), else nothing. The notice they
        carry names the done's own seconds: what the drain counted as received is what the engine took, and the
        done's figure is the one a client compares it with."""
        if self.drained is None:
            return {}
        seconds = done.usage.audio_seconds
        return drain_truncation(drain_notice(seconds), seconds)

    def result(self) -> dict:
        done = self.outcome
        result = {"text": done.text, "usage": text_usage(done),
                  "words": [{"word": w.word, "start": w.start, "end": w.end} for w in done.words]}
        if self.logprobs:
            result["logprobs"] = token_logprobs(self.state.engine.tokenizer, done.token_ids, done.logprobs)
        return {**result, **self.truncation(done)}


# -- the request ------------------------------------------------------------------------------------------
async def _read_part(part, limit: int, name: str, limits, room: int, keep: bool = True) -> tuple[bytes, int]:
    """(the part's bytes, empty unless `keep`; its size). RequestError 413 past `limit`, the part's own cap,
    or past `room`, what the form's cap leaves."""
    data, size = bytearray(), 0
    while chunk := await body_read(part.read_chunk(64 << 10), limits):
        size += len(chunk)
        if size > limit:
            raise RequestError(413, "file_too_large" if name == "file" else "field_too_large",
                               f"`{name}` is larger than {limit} bytes", name)
        if size > room:
            raise RequestError(413, "request_too_large", f"The form is larger than {_FORM_BYTES} bytes")
        if keep:
            data += chunk
    return bytes(data), size


async def _next_part(reader, limits):
    try:
        return await body_read(reader.next(), limits)
    except RuntimeError as exc:  # aiohttp's reader: a first part `_charset_` longer than any charset name
        raise RequestError(400, "invalid_request", f"The request body is malformed: {exc}") from None


async def _parse_form(request: web.Request) -> tuple[bytes, dict, dict[str, list[str]]]:
    """(file bytes, the fields the route reads, the list fields `timestamp_granularities[]`, `include[]` and
    `languages[]`); `fields["file"]` is the file's name, when its part gave one. The multipart reader is used
    directly: the app's body limit is sized for small JSON, not uploads. The form is read before the request is
    admitted, so at the body's minimum rate."""
    if not request.content_type.startswith("multipart/form-data"):
        raise RequestError(400, "invalid_request", "Send the audio as multipart/form-data with a `file` field, or "
                           "as NDJSON chunks with the header `X-Streaming-Input: true`")
    return await read_before_admission(request, _read_form(request))


async def _read_form(request: web.Request) -> tuple[bytes, dict, dict[str, list[str]]]:
    limits = server_state(request).config.limits
    reader = await body_read(request.multipart(), limits)
    audio, fields, lists = None, {}, {name: [] for name in _LIST_FIELDS}
    filename = None
    room, parts = _FORM_BYTES, 0
    while (part := await _next_part(reader, limits)) is not None:
        parts += 1
        if parts > _MAX_PARTS:
            raise RequestError(413, "request_too_large", f"The form has more than {_MAX_PARTS} parts")
        if not isinstance(part, BodyPartReader):  # a part of type multipart/*: aiohttp's nested reader
            raise RequestError(400, "invalid_request", "A form field cannot itself be multipart data")
        name = part.name or ""
        if name == "file":
            audio, size = await _read_part(part, MAX_FILE_BYTES, name, limits, room)
            filename = part.filename
        else:
            base = name.removesuffix("[]")
            read = name in _FIELDS or name.startswith(_OBJECT_FIELDS)
            cap = _PROMPT_BYTES if name == "prompt" else _FIELD_BYTES
            value, size = await _read_part(part, cap, name, limits, room, keep=read or base in lists)
            if base in lists:
                lists[base].append(value.decode("utf-8", "replace"))
            elif read:
                fields[name] = value.decode("utf-8", "replace")
        room -= size
    if audio is None:
        raise RequestError(400, "invalid_request", "Missing required parameter: 'file'", "file")
    if filename:
        fields["file"] = filename[:_SHOWN]
    if not audio:
        # An empty part is a file, not a missing one: a recording that captured nothing, a path that was wrong.
        raise RequestError(400, "invalid_audio", f"The uploaded file {_upload_name(fields)} is empty (0 bytes)",
                           "file")
    return audio, fields, lists


def _upload_name(fields: dict) -> str:
    return repr(fields["file"]) if "file" in fields else "in the `file` field"


def _flag(fields: dict, name: str) -> bool:
    """A boolean field; empty is false, as absent: OpenAI documents the flags as boolean or null, and a form
    field has no null."""
    value = fields.get(name, "")
    flag = streaming_input.text_flag(value)
    if flag is None:
        raise RequestError(400, "invalid_request", f"`{name}` must be true or false, got "
                           f"{wire_json.shown(repr(value.strip().lower()), _SHOWN)}", name)
    return flag


def _check_typed_fields(fields: dict, lists: dict[str, list[str]]) -> str | None:
    """RequestError 400 for a field OpenAI types that does not parse as its type (it was ignored, whatever it
    held); an empty field is absent, as `stream`'s is. Returns the code of the request's `language`, None when it
    names none."""
    temperature = fields.get("temperature", "").strip()
    if temperature and not _number_in(_form_number(temperature), 0, 1):
        raise RequestError(400, "invalid_request", f"temperature must be a number from 0 to 1, got "
                           f"{temperature[:_SHOWN]!r}", "temperature")
    language = check_language(fields.get("language"), "language")
    for value in lists["languages"]:
        check_language(value, "languages[]")
    _check_chunking_strategy(fields)
    return language


def check_json_params(params: dict, prefix: str = "") -> None:
    """The upload's typed fields in a streaming-input request's JSON parameters (Mode A's line, Mode B's
    `params`; `prefix` names where): RequestError 422 for a `language`, `temperature` or `chunking_strategy`
    the form would refuse. None is absent, as a form's empty field is. None of them changes the transcript."""
    check_language(params.get("language"), f"{prefix}language", 422)
    temperature = params.get("temperature")
    if temperature is not None and not _number_in(temperature, 0, 1):
        raise RequestError(422, "invalid_request", f"temperature must be a number from 0 to 1, got "
                           f"{wire_json.shown(repr(temperature), _SHOWN)}", f"{prefix}temperature")
    strategy = params.get("chunking_strategy")
    if strategy is None or strategy == "auto":
        return
    if not (isinstance(strategy, dict) and _is_server_vad(strategy)):
        raise RequestError(422, "invalid_request", _CHUNKING_STRATEGY, f"{prefix}chunking_strategy")


def _is_server_vad(members: dict) -> bool:
    """Whether `members` (numbers: a JSON object's, or a form's parsed by `_form_number`) are a server_vad
    chunking_strategy's."""
    return (members.get("type") == "server_vad" and set(members) <= {"type", "threshold", *_VAD_INTS}
            and all(_number_in(members.get(key, 0), 0, math.inf, whole=True) for key in _VAD_INTS)
            and _number_in(members.get("threshold", 0), 0, 1))


def _number_in(value, low: float, high: float, *, whole: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return False
    return low <= value <= high  # false for nan


def _form_number(text: str, *, whole: bool = False):
    """A form field's number (an int with `whole`), or the text itself where it is none (`_number_in` refuses it)."""
    try:
        return int(text) if whole else float(text)
    except ValueError:
        return text


def check_language(value, param: str, status: int = 400) -> str | None:
    """The code of the language a request names (languages.find_language: by its code or its name), None when it
    names none (absent, null or blank, as a form's empty field is absent); RequestError `status` for a value that
    names no language, as OpenAI and vLLM refuse one. One outside OpenAI's list, which vLLM takes with a warning,
    is taken with one logged."""
    if value is None or isinstance(value, str) and not value.strip():
        return None
    if not isinstance(value, str):  # a JSON parameter (Mode A, Mode B)
        raise RequestError(status, "invalid_request", "language must be a string: the audio's language in ISO-639-1 "
                           "format, such as `en`", param)
    code = find_language(value)
    if code is None:
        raise RequestError(status, "invalid_request", f"Invalid language {value[:_SHOWN]!r}: give the audio's "
                           "language in ISO-639-1 format, such as `en`", param)
    if code in OTHER_LANGUAGES:
        logger.warning("%s %r (%s) is not one of OpenAI's transcription languages: the transcript may be less "
                       "accurate", param, code, language_name(code))
    return code


def _check_chunking_strategy(fields: dict) -> None:
    """`chunking_strategy`: "auto", or a server_vad object, which OpenAI's SDK writes in a form as
    `chunking_strategy[type]=server_vad` and its optional members, each a field."""
    prefix = _OBJECT_FIELDS[0]
    plain = fields.get("chunking_strategy", "").strip()
    members = {name[len(prefix):].removesuffix("]"): value.strip() for name, value in fields.items()
               if name.startswith(prefix)}
    if not members and plain in ("", "auto"):
        return
    parsed = {name: value if name == "type" else _form_number(value, whole=name in _VAD_INTS)
              for name, value in members.items()}
    if plain or not _is_server_vad(parsed):
        raise RequestError(400, "invalid_request", _CHUNKING_STRATEGY, "chunking_strategy")


async def _decode(audio: bytes, name: str, state, handle: streaming_input.DrainHandle) -> np.ndarray:
    """The upload as 16 kHz PCM, decoded off the event loop and no further than the server's audio limit; `name`
    says which upload in an error.
    A handler cancelled meanwhile cannot stop the thread: `handle` (the request's connection slot) is then
    forgotten once the thread ends, so that the connection limit bounds the decodes running at once."""
    limit = state.config.limits.max_audio_seconds
    decode = asyncio.ensure_future(asyncio.to_thread(load_audio, audio, max_seconds=limit, name=name))
    try:
        pcm = await asyncio.shield(decode)
    except asyncio.CancelledError:
        def forget(task: asyncio.Future) -> None:
            if not task.cancelled():
                task.exception()  # retrieved: nobody is left to answer with it
            state.forget(handle)

        decode.add_done_callback(forget)
        raise
    except AudioTooLongError as exc:
        lasts = "" if exc.seconds is None else f" {exc.seconds:.0f} s,"
        raise RequestError(400, "audio_too_long", f"The audio lasts{lasts} more than the limit of {limit:g} s",
                           "file") from None
    except AudioError as exc:  # it names the upload, and the formats the decoder reads when it cannot open it
        message = str(exc)
        raise RequestError(400, "invalid_audio", message[:1].upper() + message[1:], "file") from None
    if pcm.size == 0:
        raise RequestError(400, "invalid_audio", f"The audio file {name} holds no samples", "file")
    return pcm


async def _feed(stream: AudioInput, pcm) -> None:
    """Appends the whole recording, then ends it; the engine's backpressure paces the appends."""
    step = 10 * SAMPLING_RATE  # chunks of 10 s, so an abort stops the feeding early
    try:
        for begin in range(0, pcm.size, step):
            if stream.done:
                return
            await stream.append(pcm[begin:begin + step])
        await stream.finish()
    except EngineError as exc:  # the session ended meanwhile (aborted or failed): its outcome says why
        logger.debug("feeding the upload stopped: %s", exc)


def check_answer(response_format, granularities: bool, logprobs: bool, stream: bool, *, status: int = 400,
                 lists: str = "[]") -> None:
    """RequestError `status` for an answer the route cannot give: a response_format it does not know, one that
    does not carry what the request asks for (timestamp granularities, logprobs), or a stream of subtitles. The
    upload's parameters and Mode A's (always a stream; JSON, so its list parameters are named without the form's
    `[]`: `lists`)."""
    if response_format not in RESPONSE_FORMATS:
        raise RequestError(status, "invalid_request", f"response_format must be one of {', '.join(RESPONSE_FORMATS)}"
                           f", got {wire_json.shown(repr(response_format), _SHOWN)}", "response_format")
    if granularities and response_format != "verbose_json":
        # OpenAI's refusal, in its words. vLLM documents the same rule and does not check it: the granularities were
        # ignored, and a client asking for word timings got a 200 without them.
        raise RequestError(status, "invalid_request", "`response_format` must be `verbose_json` if "
                           "`timestamp_granularities[]` is provided", f"timestamp_granularities{lists}")
    if logprobs and response_format != "json":
        raise RequestError(status, "invalid_request", "include[]=logprobs needs response_format json",
                           f"include{lists}")
    if stream and response_format not in STREAM_FORMATS:
        shown = wire_json.shown(repr(response_format), _SHOWN)
        raise RequestError(status, "invalid_request", f"response_format {shown} cannot be "
                           "streamed; use json or text", "response_format")


def parse_include(params: dict, param: str) -> bool:
    """Whether a streaming-input request's `include` (a list, as OpenAI's `include[]`) asks for logprobs."""
    include = params.get("include") or []
    if not isinstance(include, list) or any(value != "logprobs" for value in include):
        raise RequestError(422, "invalid_request", "include must be a list holding only \"logprobs\"", param)
    return bool(include)


def parse_delay_ms(fields: dict, state, param: str) -> int | None:
    delay_ms = fields.get("delay_ms", fields.get("transcription_delay_ms"))
    if delay_ms is not None and delay_ms not in state.allowed_delays_ms:
        raise RequestError(422, "invalid_request", f"delay_ms must be one of {list(state.allowed_delays_ms)}",
                           param)
    return delay_ms


async def _start_when_free(audio_input: AudioInput, state, request: web.Request, wait_s: float) -> None:
    """Starts the upload's engine session; while the engine holds its max_live_sessions, waits its turn (turns go
    round the client keys: request_queue.py), up to `wait_s` (what is left of `request_queue_s` after its wait for a
    connection), then the engine's CapacityError (503), as vLLM queues requests. A drain ends the wait (503), and so
    does a client that leaves (400 client_disconnected)."""
    engine = state.engine

    async def attempt():
        if audio_input.done:  # a drain stopped the request while it waited
            raise RequestError(503, "draining", "The server is shutting down; retry on another replica")
        if engine.live_sessions >= engine.max_live_sessions:  # looking, not asking: the engine logs a refusal
            return None
        try:
            await audio_input.start()
        except CapacityError:  # a realtime stream took the session first
            return None
        return True

    if not await state.session_queue.take(attempt, wait_s, lambda: sse.client_gone(request),
                                          key=state.key_limits.key_of(request)):
        if sse.client_gone(request):
            raise RequestError(400, "client_disconnected", "The client went away while its upload waited")
        raise CapacityError(f"the engine holds its {engine.max_live_sessions} sessions (the upload waited "
                            f"{state.config.limits.request_queue_s:g} s in all); try again later")


async def transcriptions(request: web.Request) -> web.StreamResponse:
    state = server_state(request)
    try:
        check_ready(state)
        if streaming_input.is_streaming_input(request):
            return await _streaming_input(request, state)
        audio, fields, lists = await _parse_form(request)
        granularities = lists["timestamp_granularities"]
        check_model(state, fields.get("model"), "realtime")
        language = _check_typed_fields(fields, lists) or DEFAULT_LANGUAGE
        response_format = fields.get("response_format", "json")
        unknown = set(granularities) - {"word", "segment"}
        if unknown:
            raise RequestError(400, "invalid_request", f"Unknown timestamp granularity {sorted(unknown)[0]!r}; "
                               "use word or segment", "timestamp_granularities[]")
        unknown = set(lists["include"]) - {"logprobs"}
        if unknown:
            raise RequestError(400, "invalid_request", f"Unknown include value {sorted(unknown)[0]!r}; use logprobs",
                               "include[]")
        logprobs = "logprobs" in lists["include"]
        stream = _flag(fields, "stream")
        check_answer(response_format, bool(granularities), logprobs, stream)
        audio_input = AudioInput(state, log=sse.EventLog() if stream else None, logprobs=logprobs)
        handle = streaming_input.DrainHandle(audio_input)
        # Before the decoding: the connection limit bounds the decodes. One wait in all: request_queue_s.
        queued_at = time.monotonic()
        await streaming_input.admit_in_turn(state, handle, request)
        try:
            pcm = await _decode(audio, _upload_name(fields), state, handle)
        except RequestError:
            state.forget(handle)
            raise
        try:
            if audio_input.done:  # a drain stopped the request while it decoded
                raise RequestError(503, "draining", "The server is shutting down; retry on another replica")
            audio_input.seconds = pcm.size / SAMPLING_RATE
            await _start_when_free(audio_input, state, request,
                                   state.config.limits.request_queue_s - (time.monotonic() - queued_at))
        except EngineError as exc:
            state.forget(handle)
            raise engine_request_error(exc) from None
        except (RequestError, asyncio.CancelledError):  # a start_session cancelled frees its session itself
            state.forget(handle)
            raise
    except RequestError as exc:
        state.metrics.errors.labels(code=exc.code).inc()
        return exc.response()  # a 408 closes the connection (error_response)
    feeder = asyncio.create_task(_feed(audio_input, pcm))
    try:
        response = await audio_input.serve_output(request)
        if response is not None:
            return response
        done = audio_input.outcome
        if isinstance(done, EngineError):
            return engine_request_error(done).response()
        if done is None:
            return error_response(500, "aborted", "The transcription was aborted")
        return answer(done, response_format, granularities, language,
                      token_logprobs(state.engine.tokenizer, done.token_ids, done.logprobs) if logprobs else None)
    finally:
        await asyncio.shield(streaming_input.end_request(state, handle, feeder))


async def _streaming_input(request: web.Request, state) -> web.StreamResponse:
    """Mode A: the NDJSON body's audio chunks feed one transcription, answered as SSE meanwhile. Its first line
    comes at the body's minimum rate (streaming_input.first_object)."""
    objects = streaming_input.ndjson_objects(request, state.config.limits)
    params, first_chunk = await streaming_input.first_object(request, objects)
    check_model(state, params.get("model"), "realtime")
    if streaming_input.parse_modality(params, "audio") != "audio":
        raise RequestError(422, "unsupported_modality", "/v1/audio/transcriptions takes audio", "modality")
    logprobs = parse_include(params, "include")
    check_json_params(params)
    # The answer is a stream whatever the line says: a value asking for another answer is refused, as the upload
    # refuses it (the line's response_format, stream and timestamp_granularities were ignored).
    streaming_input.check_streamed(params)
    response_format = params.get("response_format")
    check_answer("json" if response_format is None else response_format,
                 bool(params.get("timestamp_granularities")), logprobs, True, status=422, lists="")
    policy = streaming_input.parse_start_policy(params, "audio")
    audio_input = AudioInput(state, parse_delay_ms(params, state, "delay_ms"), sse.EventLog(), logprobs=logprobs)
    return await streaming_input.serve_mode_a(request, state, audio_input, policy, objects, first_chunk)


def add_transcription_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/transcriptions", holds_stream(transcriptions))
