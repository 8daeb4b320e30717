"""OpenAI's realtime transcription dialect on `GET /v1/realtime` (specs/realtime_protocols.md §4), GA shape
(`session.update` with `session.type: "transcription"`) and beta shape (`transcription_session.update`).

Which connections speak it: realtime_dialects.py, and every connection a client secret opens
(client_secrets.py), which starts with the secret's session configuration. What a `session.update` may set, and
its checks: openai_session_config.py.

Turns: the audio between two commits is one item, and each item is its own engine session (fresh
context, like one vLLM utterance). An item opens with the first audio after the previous commit, so its
deltas stream while the client still speaks; a commit sends `input_audio_buffer.committed`, ends the
item's audio and the next append already opens the next item (turns pipeline), while the committed one
finishes with `...transcription.completed` and `conversation.item.done`. With `turn_detection` the
server commits itself (serving/vad.py): an item opens at `speech_started` with `prefix_padding_ms` of the
audio before it and is committed at `speech_stopped`; audio outside speech is not transcribed.

jaxstream choices where OpenAI's behaviour does not carry over:

- `transcription.delay` (gpt-realtime-whisper's names) -> the engine's transcription delay:
  minimal 160 ms, low 320 ms, medium 480 ms, high 960 ms, xhigh 2400 ms; absent or null: the engine's
  default. Longer delays see more right context and make fewer errors, at that much more latency.
- `language` (checked as the HTTP route checks it: serving/languages.py), `prompt` and `noise_reduction`
  are validated and echoed but do not condition the model
  (Voxtral Realtime transcribes with a fixed prompt).
- `include: ["item.input_audio_transcription.logprobs"]` adds `logprobs` to every `...transcription.delta`
  (the delta's tokens) and `.completed` (the whole transcript's): `[{token, logprob, bytes}]` per text token,
  its natural-log probability under the model at the step that chose it (decoding is greedy: the
  step's highest); `engine_sessions.token_logprobs` says which tokens and how bytes come.
- `turn_detection` is null (manual commits) until the client asks for VAD.
- `conversation.item.added` (beta: `conversation.item.created`) is sent when the item opens, before its
  first delta; `input_audio_buffer.clear` drops the open item, which then ends with
  `conversation.item.done` status "incomplete".
- An item shorter than MIN_COMMIT_MS cannot be committed (`input_audio_buffer_commit_empty`; the audio
  stays in the open item).
- `audio/pcm` takes only `rate: 24000`, as OpenAI; G.711 is 8 kHz. The engine resamples either.
- `rate_limits.updated` follows `session.created` and every `session.updated`, with this connection's
  budgets (serving/limits.py) instead of OpenAI's request and token rates, which a transcription session
  here does not have: `audio_seconds` (audio it may still send) and `session_seconds` (how long it may
  still stay open); neither resets while the connection is open (`reset_seconds: null`).
- No `...transcription.segment` events: they carry diarisation (a speaker per segment), which the model
  does not produce; the spec makes them optional.
- A draining server (app.drain) commits the item still open at its deadline, and that item's transcript covers
  only the audio received: an `error` `server_draining` (a `server_error`, naming the seconds transcribed) comes
  after its last delta and before its `...transcription.completed`, which says it again for a client that reads
  it alone: `"truncated": true, "truncation": {"code": "server_draining", "message", "audio_seconds"}` (absent
  from a transcript the client committed). Audio appended while no item is open is dropped, as vLLM's protocol
  drops it (an error per append was noise, and spent the error budget, of a client still streaming); no new item
  opens, and the socket closes with 1001 once the item is done.
"""
import asyncio
import json
import logging
import math
import secrets
import time

import numpy as np

from jaxstream.engine.transcription_session import TranscriptionDelta, TranscriptionDone
from jaxstream.errors import DrainingError, EngineError
from jaxstream.models.audio import SLOT_SECONDS
from jaxstream.serving import wire_json
from jaxstream.serving.audio_codecs import AudioDecodeError, decode_g711_base64, decode_pcm16_base64
from jaxstream.serving.engine_sessions import start_session, token_logprobs
from jaxstream.serving.http_errors import error_type
from jaxstream.serving.limits import drain_notice, drain_truncation
from jaxstream.serving.openai_session_config import (BETA_FORMATS, DELAY_MS, FORMAT_RATES, LOGPROBS, ClientError,
                                                     parse_session_update)
from jaxstream.serving.vad import TurnSegmenter, start_turn_segmenter, vad_config
from jaxstream.serving.websocket import ConnectionClosed

logger = logging.getLogger(__name__)

MIN_COMMIT_MS = 100  # OpenAI's minimum committed buffer
CLOCK_RATE = math.lcm(*FORMAT_RATES.values())  # ticks per second of the VAD's clock: a whole number per sample


class _Item:
    """One turn: its engine session and the task turning engine events into wire events."""

    def __init__(self, item_id: str, previous_item_id: str | None, session):
        self.id = item_id
        self.previous_item_id = previous_item_id
        self.session = session
        self.samples = 0  # at the input rate
        self.first_audio_at: float | None = None  # for the first-delta latency metric
        self.committed_at: float | None = None
        self.drained = False  # committed by the server's drain, not the client: completed comes with a notice
        self.pump: asyncio.Task | None = None


class OpenAiRealtime:
    """The dialect on one connection (see the module docstring); built per connection by the app."""

    def __init__(self, conn, server, *, beta: bool = False, preset: dict | None = None):
        """`preset`: the session configuration the connection starts with (parse_session_update's changes: the
        client secret's that opened it, serving/client_secrets.py)."""
        self.conn = conn
        self.server = server
        self.beta = beta
        self.preset = preset or {}
        self.limits = server.config.limits
        self.session_id = f"sess_{secrets.token_hex(12)}"
        self.format = "audio/pcm"
        # The model is named once `run` starts: a connection refused while the model loads has no engine.
        self.transcription = {"model": None, "language": None, "prompt": "", "delay": None}
        self.noise_reduction: str | None = None
        self.include: list[str] = []
        self.turn_detection: dict | None = None
        self.segmenter: TurnSegmenter | None = None  # with turn_detection
        self.open: _Item | None = None  # the item audio goes to now
        self.turn_dropped = False  # VAD: this turn's item could not open; the rest of the turn is dropped
        self.last_item_id: str | None = None
        # Audio appended on this connection in 1/CLOCK_RATE s ticks (the VAD's clock): samples of one rate
        # would misplace VAD times once the format changes.
        self.stream_ticks = 0
        self._lock = asyncio.Lock()  # one state transition at a time (reader vs. event pumps)
        self._items: dict[str, _Item] = {}  # every item whose engine session is not over
        self._pumps: set[asyncio.Task] = set()
        self._handlers = {
            "session.update": self._on_update,
            "transcription_session.update": self._on_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.commit": self._on_commit,
            "input_audio_buffer.clear": self._on_clear,
        }

    @property
    def rate(self) -> int:
        return FORMAT_RATES[self.format]

    # -- protocol interface (serving.websocket) --------------------------------------------------------
    async def run(self, first_frame: str | None = None) -> None:
        """`first_frame`: the event that switched the connection to this dialect, answered first."""
        self.transcription["model"] = self.server.model_id
        self.segmenter = await self._new_segmenter(self.preset.get("turn_detection"),
                                                   FORMAT_RATES[self.preset.get("format", self.format)])
        self.configure(self.preset)
        await self._send("transcription_session.created" if self.beta else "session.created",
                         session=self.session_object(self.beta))
        await self._send_rate_limits()
        if first_frame is not None:
            async with self._lock:
                await self._handle(first_frame)
        # A binary frame is read as UTF-8 JSON: the dialect has no binary events to confuse it with.
        async for _, data in self.conn.frames():
            async with self._lock:
                await self._handle(data)
            if self.server.draining and not self.busy():
                self.conn.stop(self.server.drain_breach())

    def busy(self) -> bool:
        return bool(self._pumps) or (self.open is not None and self.open.samples > 0)

    async def finish_for_drain(self) -> None:
        async with self._lock:
            item = self.open
            if item is not None:
                if item.samples * 1000 >= MIN_COMMIT_MS * self.rate:
                    item.drained = True
                    await self._commit(item)
                else:
                    await self._drop_open()
            if not self.busy():
                self.conn.stop(self.server.drain_breach())

    async def release(self) -> None:
        if self.segmenter is not None:
            self.segmenter.close()
        items, self._items = list(self._items.values()), {}  # before the pumps end and forget them
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for item in items:
            await item.session.abort(reason="client_disconnected")
            self.server.metrics.utterances.labels(outcome="aborted").inc()
        self.open = None

    def error_event(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None) -> dict:
        """An `error` event, typed by its code as the HTTP routes and streams type it (http_errors.error_type): a
        client's mistake, or the connection's end for its own conduct (idle, too old, too many errors, as OpenAI
        types its `session_expired`), is an `invalid_request_error`; the server's refusal or failure a
        `server_error`."""
        return {"type": "error", "event_id": _event_id(), "error": {
            "type": error_type(code), "code": code, "message": message, "param": param, "event_id": event_id}}

    # -- client events --------------------------------------------------------------------------------
    async def _handle(self, data) -> None:
        event_id = None
        try:
            try:
                event = json.loads(data)
            except (ValueError, RecursionError, UnicodeDecodeError):
                raise ClientError("invalid_json", "The event is not valid JSON") from None
            if not isinstance(event, dict):
                raise ClientError("invalid_event", "Each event must be a JSON object with a type field")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            kind = event.get("type")
            if not isinstance(kind, str):
                raise ClientError("invalid_event", "Missing required field: type", "type")
            handler = self._handlers.get(kind)
            if handler is None:
                raise ClientError("unsupported_event", f"{wire_json.shown(kind)} is not supported in a transcription "
                                  "session", "type")
            await handler(event)
        except (ClientError, EngineError) as exc:
            await self._report(exc, event_id)
        except ConnectionClosed:
            raise
        except Exception:  # noqa: BLE001 - a bug must not cost the client its socket
            logger.exception("%s: error handling an event", self.conn.id)
            await self._error("processing_error", "Internal error while handling the event", None, event_id)

    async def _on_update(self, event: dict) -> None:
        beta = event["type"] == "transcription_session.update"
        # Everything is checked before anything changes: a rejected update leaves the session as it was.
        changes = parse_session_update(event.get("session"), beta, self.server)
        # The format and the VAD decide where audio goes: they change only between items.
        moved = [name for name in ("format", "turn_detection") if changes.get(name, getattr(self, name))
                 != getattr(self, name)]
        if moved and self.open is not None:
            raise ClientError("invalid_request", f"{moved[0]} cannot change while the input buffer holds audio: "
                              "commit or clear it first", f"session.{moved[0]}")
        if moved:  # built before anything changes: a segmenter that fails to start fails the whole update
            segmenter = await self._new_segmenter(changes.get("turn_detection", self.turn_detection),
                                            FORMAT_RATES[changes.get("format", self.format)])
            if self.segmenter is not None:
                self.segmenter.close()
            self.segmenter = segmenter
        self.configure(changes)
        await self._send("transcription_session.updated" if beta else "session.updated",
                         session=self.session_object(beta))
        await self._send_rate_limits()

    def configure(self, changes: dict) -> None:
        """Sets what a checked update (parse_session_update) changes; the segmenter its turn detection needs is the
        caller's."""
        self.format = changes.get("format", self.format)
        self.transcription.update(changes.get("transcription", {}))
        self.noise_reduction = changes.get("noise_reduction", self.noise_reduction)
        self.include = changes.get("include", self.include)
        self.turn_detection = changes.get("turn_detection", self.turn_detection)

    async def _on_append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientError("invalid_event", "Missing required field: audio (a base64 string)", "audio")
        max_samples = int(self.limits.max_append_seconds * self.rate)
        try:
            if self.format == "audio/pcm":
                pcm = decode_pcm16_base64(audio, max_samples=max_samples)
            else:
                pcm = decode_g711_base64(audio, self.format.removeprefix("audio/"), max_samples=max_samples)
        except AudioDecodeError as exc:
            raise ClientError("invalid_audio", f"Invalid audio data: {exc}", "audio") from None
        if self.server.draining and self.open is None:
            return  # it would open an item: dropped (the module docstring)
        seconds = pcm.size / self.rate
        if self.conn.audio_seconds + seconds > self.limits.max_audio_seconds:
            raise ClientError("audio_limit_exceeded", f"This connection reached its limit of "
                              f"{self.limits.max_audio_seconds:g} s of audio; open a new one")
        self.conn.audio_seconds += seconds
        self.server.metrics.audio_seconds.inc(seconds)
        self.stream_ticks += pcm.size * (CLOCK_RATE // self.rate)  # even if feeding fails
        if self.segmenter is None:
            await self._feed(self.open or await self._open_item(), pcm)
        else:
            await self._detect(pcm)

    async def _on_commit(self, event: dict) -> None:
        item = self.open
        if item is None and self.server.draining:  # its audio was dropped (_on_append): not the client's mistake
            raise DrainingError("The server is shutting down and starts no new transcription")
        if item is None or item.samples * 1000 < MIN_COMMIT_MS * self.rate:
            held = 0 if item is None else item.samples * 1000 // self.rate
            raise ClientError("input_audio_buffer_commit_empty", f"Error committing input audio buffer: buffer "
                              f"too small. Expected at least {MIN_COMMIT_MS}ms of audio, but buffer only has "
                              f"{held}ms of audio.")
        await self._commit(item)

    async def _on_clear(self, event: dict) -> None:
        await self._drop_open()
        if self.segmenter is not None:
            self.segmenter.clear()
        await self._send("input_audio_buffer.cleared")

    # -- server VAD -----------------------------------------------------------------------------------
    async def _new_segmenter(self, turn_detection: dict | None, rate: int) -> TurnSegmenter | None:
        """A segmenter for these settings at `rate`, starting at the connection clock's present."""
        if turn_detection is None:
            return None
        return await start_turn_segmenter(vad_config(turn_detection), rate, self.stream_ticks * rate // CLOCK_RATE)

    async def _detect(self, pcm: np.ndarray) -> None:
        """Routes `pcm` by the segmenter's turns: speech goes to the open item (opened at speech_started,
        committed at speech_stopped), the rest is not transcribed. A turn whose item fails to open or take
        audio is reported and the rest of its audio dropped (one error per turn, not one per append: a long turn
        at capacity would spend the connection's error budget); the turn events after it still go out."""
        segmenter = self.segmenter
        for turn in await segmenter.push(pcm):
            if turn.kind == "started":
                self.turn_dropped = False
            elif turn.kind == "speech" and self.turn_dropped:
                continue
            try:
                await self._on_turn(turn, segmenter)
            except (ClientError, EngineError) as exc:
                self.turn_dropped = turn.kind in ("started", "speech")
                await self._report(exc, None)

    async def _on_turn(self, turn, segmenter) -> None:
        """One turn event of `_detect`."""
        if turn.kind == "started":
            item_id = _item_id()
            await self._send("input_audio_buffer.speech_started", item_id=item_id,
                             audio_start_ms=segmenter.ms(turn.sample))
            await self._feed(await self._open_item(item_id), turn.audio)
        elif turn.kind == "speech":  # a manual commit during speech leaves no item open: the rest is a new one
            await self._feed(self.open or await self._open_item(), turn.audio)
        elif turn.kind == "stopped":
            item = self.open
            if item is not None:
                await self._feed(item, turn.audio)
            await self._send("input_audio_buffer.speech_stopped", audio_end_ms=segmenter.ms(turn.sample),
                             item_id=item.id if item is not None else None)
            if item is not None:
                await self._commit(item)
        else:  # OpenAI commits the (silent) buffer when nobody spoke for idle_timeout_ms
            item = await self._open_item()
            await self._send("input_audio_buffer.timeout_triggered", item_id=item.id,
                             audio_start_ms=segmenter.ms(turn.idle_from), audio_end_ms=segmenter.ms(turn.sample))
            await self._feed(item, turn.audio)
            await self._commit(item)

    # -- items ----------------------------------------------------------------------------------------
    async def _open_item(self, item_id: str | None = None) -> _Item:
        if self.server.draining:
            # The engine's error for this refusal, so that it is typed by its code as the HTTP routes type it (a
            # 503, `server_error`): the client did nothing wrong, and a ClientError is the client's mistake.
            raise DrainingError("The server is shutting down and starts no new transcription")
        delay = self.transcription["delay"]
        session = await start_session(self.server.engine, DELAY_MS[delay] if delay else None, self.rate,
                                      max_audio_seconds=self.limits.max_audio_seconds)
        item = _Item(item_id or _item_id(), self.last_item_id, session)
        self.last_item_id = item.id
        self.open = item
        self._items[item.id] = item
        self.conn.utterances += 1
        # The pump exists before anything is sent (a failed send must leave nothing half-built); it cannot
        # send a delta before `added`, as the session has no audio yet.
        item.pump = asyncio.create_task(self._pump(item), name=f"{self.conn.id}-{item.id}")
        self._pumps.add(item.pump)
        item.pump.add_done_callback(self._pump_done)
        await self._send("conversation.item.created" if self.beta else "conversation.item.added",
                         previous_item_id=item.previous_item_id, item=self._item_object(item, "in_progress", None))
        return item

    def _pump_done(self, task: asyncio.Task) -> None:
        self._pumps.discard(task)
        if self.server.draining and not self.busy():  # the last transcription of a draining server is out
            self.conn.stop(self.server.drain_breach())

    async def _feed(self, item: _Item, pcm: np.ndarray) -> None:
        if pcm.size == 0:
            return
        if item.first_audio_at is None:
            item.first_audio_at = time.monotonic()
        try:
            await item.session.append(pcm)  # waits while the engine has too much audio queued
        except EngineError:
            await self._drop_open()
            raise
        item.samples += pcm.size

    async def _commit(self, item: _Item) -> None:
        item.committed_at = time.monotonic()
        if self.open is item:
            self.open = None
        await self._send("input_audio_buffer.committed", item_id=item.id, previous_item_id=item.previous_item_id)
        await item.session.finish()

    async def _drop_open(self) -> None:
        """Aborts the open item (clear, or an audio failure): it ends as "incomplete", without a transcript."""
        item, self.open = self.open, None
        if item is None:
            return
        self._items.pop(item.id, None)
        item.pump.cancel()
        await asyncio.gather(item.pump, return_exceptions=True)
        await item.session.abort(reason="cleared")
        self.server.metrics.utterances.labels(outcome="aborted").inc()
        if not self.beta:
            await self._send("conversation.item.done", previous_item_id=item.previous_item_id,
                             item=self._item_object(item, "incomplete", None))

    async def _pump(self, item: _Item) -> None:
        """Engine events -> wire events, for one item."""
        metrics = self.server.metrics
        done = None
        try:
            async for event in item.session:
                if isinstance(event, TranscriptionDelta) and event.text:
                    if item.first_audio_at is not None:
                        metrics.first_delta.observe(time.monotonic() - item.first_audio_at)
                        item.first_audio_at = None
                    await self._send("conversation.item.input_audio_transcription.delta", item_id=item.id,
                                     content_index=0, delta=event.text,
                                     **self._logprobs(event.token_ids, event.logprobs))
                elif isinstance(event, TranscriptionDone):
                    done = event
            if done is None:
                raise EngineError("The transcription ended without a result")
        except ConnectionClosed:
            return
        except Exception as exc:  # noqa: BLE001 - EngineError by contract; anything else is a bug, same answer
            if not isinstance(exc, EngineError):
                logger.exception("%s: the engine's event stream failed", self.conn.id)
            code = getattr(exc, "code", None) or "processing_error"
            metrics.utterances.labels(outcome="error").inc()
            self.conn.count_error(code)
            await self._send("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=0,
                             error={"type": error_type(code), "code": code,
                                    "message": str(exc) or type(exc).__name__, "param": None})
        else:
            if item.committed_at is not None:
                metrics.finalize.observe(time.monotonic() - item.committed_at)
            metrics.utterances.labels(outcome="done").inc()
            truncation = {}
            if item.drained:  # after the item's last delta, before its transcript: whoever stops at either saw it
                notice = drain_notice(done.usage.audio_seconds)
                await self._error("server_draining", notice, None, None, budget=False)
                truncation = drain_truncation(notice, done.usage.audio_seconds)
            audio_tokens = round(done.usage.audio_seconds / SLOT_SECONDS)
            text_tokens, output = done.usage.prompt_tokens, done.usage.output_tokens
            await self._send("conversation.item.input_audio_transcription.completed", item_id=item.id,
                             content_index=0, transcript=done.text, **self._logprobs(done.token_ids, done.logprobs),
                             usage={
                                 "type": "tokens", "input_tokens": text_tokens + audio_tokens,
                                 "output_tokens": output, "total_tokens": text_tokens + audio_tokens + output,
                                 "input_token_details": {"text_tokens": text_tokens, "audio_tokens": audio_tokens}},
                             **truncation)
            if not self.beta:
                await self._send("conversation.item.done", previous_item_id=item.previous_item_id,
                                 item=self._item_object(item, "completed", done.text))
        finally:
            self._items.pop(item.id, None)
            if self.open is item:  # the engine ended it before a commit (too long, or failed): audio moves on
                self.open = None

    # -- wire objects ---------------------------------------------------------------------------------
    def session_object(self, beta: bool) -> dict:
        transcription = dict(self.transcription)
        noise = {"type": self.noise_reduction} if self.noise_reduction else None
        if beta:
            transcription.pop("delay")
            return {"id": self.session_id, "object": "realtime.transcription_session",
                    "input_audio_format": {v: k for k, v in BETA_FORMATS.items()}[self.format],
                    "input_audio_transcription": transcription, "turn_detection": self.turn_detection,
                    "input_audio_noise_reduction": noise, "include": self.include}
        audio_format = {"type": self.format}
        if self.format == "audio/pcm":
            audio_format["rate"] = self.rate
        return {"id": self.session_id, "object": "realtime.transcription_session", "type": "transcription",
                "audio": {"input": {"format": audio_format, "noise_reduction": noise,
                                    "transcription": transcription, "turn_detection": self.turn_detection}},
                "include": self.include}

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict:
        """`{"logprobs": [...]}` for the text tokens among `token_ids` when the session includes them."""
        if LOGPROBS not in self.include:
            return {}
        return {"logprobs": token_logprobs(self.server.engine.tokenizer, token_ids, logprobs)}

    @staticmethod
    def _item_object(item: _Item, status: str, transcript: str | None) -> dict:
        return {"id": item.id, "object": "realtime.item", "type": "message", "status": status, "role": "user",
                "content": [{"type": "input_audio", "transcript": transcript}]}

    async def _send_rate_limits(self) -> None:
        budgets = {"audio_seconds": (self.limits.max_audio_seconds, self.conn.audio_seconds),
                   "session_seconds": (self.limits.max_session_seconds, self.conn.clock.age())}
        await self._send("rate_limits.updated", rate_limits=[
            {"name": name, "limit": int(limit), "remaining": max(0, int(limit - used)), "reset_seconds": None}
            for name, (limit, used) in budgets.items()])

    async def _send(self, kind: str, **fields) -> None:
        await self.conn.send({"type": kind, "event_id": _event_id(), **fields})

    async def _report(self, exc: ClientError | EngineError, event_id: str | None) -> None:
        """The error event of a refusal: the client's mistake (ClientError) or the engine's (EngineError), typed
        by its code: the engine refusing bad audio is the client's error, one at capacity the server's."""
        if isinstance(exc, ClientError):
            await self._error(exc.code, exc.message, exc.param, event_id)
        else:
            await self._error(exc.code, str(exc), None, event_id)

    async def _error(self, code: str, message: str, param: str | None, event_id: str | None, *,
                     budget: bool = True) -> None:
        """`budget`: whether it counts against the connection's error budget (the client's conduct)."""
        self.conn.count_error(code, budget=budget)
        await self.conn.send(self.error_event(code, message, param=param, event_id=event_id))


def _event_id() -> str:
    return f"event_{secrets.token_hex(12)}"


def _item_id() -> str:
    return f"item_{secrets.token_hex(12)}"
