"""`AsyncEngine`: the asyncio API (vLLM-style `generate` / `abort`, realtime transcription sessions) over an
engine core whose device loop runs on its own thread.

Threads: the asyncio side never touches scheduler state; it sends commands to the engine thread
(engine_thread.py), which applies them between ticks and posts outputs back to the event loop. A realtime
engine has a third thread, the front-end worker (audio_front_end.py): it computes the log-mel of every
session's appends in batches and answers each `append` on its event loop.

The contract a server needs: `start_transcription` answers `CapacityError` / `DrainingError` at once
instead of waiting; `append` awaits under backpressure; `drain` stops admitting and lets sessions end;
`healthy` turns False when the engine thread dies; `metrics()` is a thread-safe snapshot; `check_sampling_params`
refuses a text request's parameters (its grammar compiled) before anything runs; every failure a caller sees is an
`EngineError` with a stable `code` (jaxstream/errors.py).
"""
import asyncio
import logging
import math
import numbers
import time
import uuid

import jax
import numpy as np

from jaxstream.engine import metrics as engine_metrics
from jaxstream.engine import parallel_sampling, structured_outputs
from jaxstream.engine.audio_front_end import FrontEndWorker
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.engine_thread import AudioAppend, EngineThread
from jaxstream.engine.loop_delivery import post_to_loops
from jaxstream.engine.prompt_logprobs import FlatPromptLogprobs
from jaxstream.engine.requests import RequestOutputKind, SamplingParams
from jaxstream.engine.residency import END_OF_STREAM
from jaxstream.engine.text_generation import aborted_before_start, checked_chunk, merge_pending, prompt_token_ids
from jaxstream.engine.transcription_session import (
    TranscriptAssembler, TranscriptionDone, TranscriptionSession, transcription_prompt,
)
from jaxstream.errors import CapacityError, DrainingError, EngineError, InvalidRequestError
from jaxstream.models import audio_checks
from jaxstream.models.audio import SAMPLING_RATE, SLOT_SECONDS, stream_slot_bound

logger = logging.getLogger(__name__)
_ABANDONED_JOIN_S = 30.0  # how long closing a multi-host engine waits for its engine thread


class AsyncEngine:
    """Serves one model: a text LM through `generate`, or Voxtral Realtime through transcription sessions."""

    def __init__(self, model, *, config: EngineConfig | None = None, tokenizer=None, eos_token_id=None,
                 model_name: str = "jaxstream", default_sampling_params: SamplingParams | None = None):
        from jaxstream.engine import builders, multihost
        from jaxstream.models.config import VoxtralConfig

        self.config = config or EngineConfig()
        self.model_name = model_name
        self.model_config = builders.model_config(model)
        self.tokenizer = tokenizer
        self._default_sampling_params = default_sampling_params or SamplingParams()
        # Over a mesh spanning processes this engine leads: other processes run `multihost.follow`.
        spans = multihost.spans_processes(self.config.mesh)
        if spans and jax.process_index() != 0:
            raise ValueError("only process 0 runs the engine over a multi-host mesh; the others follow it "
                             "(jaxstream.engine.multihost.follow)")
        self.core = builders.build_core(model, self.config, tokenizer=tokenizer, eos_token_id=eos_token_id)
        self._engine_thread = EngineThread(self.core)
        self._leader = multihost.Leader(self.core.programs, on_lost=self._engine_thread.abandon) if spans else None
        self.core.programs.leader = self._leader
        if isinstance(self.model_config, VoxtralConfig):
            self.kind = "realtime"
            # Narrowband audio and untrained delays transcribe badly without an error: said once, in the log
            # (narrowband on audio_checks' logger, which the CLI mutes: it names each file's band itself).
            self._input_warnings = audio_checks.WarnOnce(logger)
            narrowband_warnings = audio_checks.WarnOnce(audio_checks.narrowband_logger)
            self._front_end = FrontEndWorker(warn=narrowband_warnings)  # every session's log-mel, batched
            # Text events go out before `collected` counts their slots.
            self.core.hand_off_barrier = self._engine_thread.flush_outbox
        else:
            self.kind = "text"
            self._grammars = structured_outputs.Grammars(tokenizer, self.model_config.vocab_size,
                                                         self.core.eos_token_ids)
        self._draining = False
        # Request / session ids whose stream has not ended -> (loop, target): the engine thread's registry (it
        # ends these streams if it stops), which only the event loops change, under its lock.
        self._live, self._live_lock = self._engine_thread.live, self._engine_thread.lock
        self._families: dict[str, list[str]] = {}  # a request with n > 1 -> its children's ids
        # Streaming requests whose first chunk is unsent -> their outputs: `abort` ends them here (the core would find
        # no session, and the first chunk would then start one). Only the request that made an entry removes it.
        self._unsent: dict[str, asyncio.Queue] = {}
        self._engine_thread.start()

    @classmethod
    def from_pretrained(cls, model_source, config: EngineConfig | None = None, *, dtype=None,
                        generation_config: str = "auto") -> "AsyncEngine":
        """Loads a model (built-in name, local directory or hub id; models/loading.py) and starts an engine
        that stops text generation at the EOS ids the checkpoint declares (else its tokenizer's), with the
        `default_sampling_params()` it declares (`generation_config` "auto", as vLLM's; "vllm": none).

        Returns once every program is compiled. The default `EngineConfig` serves 64 sessions and compiles
        17 programs (about 20 s for the tiny model on a 2-core CPU); `EngineConfig(max_sessions=1)`
        compiles 5 (about 6 s) and is the one for a script transcribing one stream at a time (see
        `EngineConfig`, "Start-up cost")."""
        from jaxstream.engine import builders

        config = config or EngineConfig()
        loaded = builders.load_for_engine(model_source, config, dtype=dtype, generation_config=generation_config)
        return cls(config=config, model_name=str(model_source), **loaded._asdict())

    # -- state other threads read ---------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False once the engine is shut down or its thread died (`dead_reason` says why)."""
        return self._engine_thread.healthy

    @property
    def dead_reason(self) -> BaseException | None:
        """Why the engine thread stopped, once it has (None after a plain shutdown)."""
        return self._engine_thread.dead_reason

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def default_delay_ms(self) -> int | None:
        """The transcription delay of sessions started without one (None for text models)."""
        if self.kind != "realtime":
            return None
        return int(self.config.default_delay_ms or self.model_config.default_delay_ms)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's `get_default_sampling_params()`: what omitted completion fields take, and what `generate`
        samples with when it is given no `SamplingParams`."""
        return self._default_sampling_params

    def metrics(self) -> engine_metrics.EngineMetrics:
        """What the engine holds, as of its latest snapshot (at most ~50 ms old while busy; current when
        idle). Safe to call from any thread."""
        return self._engine_thread.metrics

    @property
    def max_model_len(self) -> int | None:
        """The longest context of a text session (its prompt and outputs); None for transcription models."""
        return self.core.max_model_len if self.kind == "text" else None

    @property
    def max_live_sessions(self) -> int:
        return self.config.max_live_sessions or self.config.max_sessions

    @property
    def live_sessions(self) -> int:
        """Sessions and requests the engine holds now: `start_transcription` refuses at `max_live_sessions` (a
        caller that waits for room looks here first, where asking would log a refusal)."""
        return len(self._live)

    # -- engine thread (engine_thread.py) -------------------------------------------------------------
    def _send(self, command, request_id: str | None = None, sink=None) -> None:
        self._engine_thread.send(command, request_id, sink)

    def _register(self, request_id: str, target) -> None:
        """Marks a stream live (ended by the engine thread if it stops). Raises if the id is taken."""
        loop = asyncio.get_running_loop()
        with self._live_lock:
            if request_id in self._live:
                raise _rejected(InvalidRequestError(f"request id {request_id!r} is already running"))
            self._live[request_id] = (loop, target)

    def _unregister(self, request_id: str, target) -> None:
        """Forgets `request_id` if `target` still holds it: the late events of an aborted session must not forget
        a newer one that took its id."""
        with self._live_lock:
            if self._live.get(request_id, (None, None))[1] is target:
                del self._live[request_id]

    def _check_admitting(self) -> None:
        self._engine_thread.check_alive()
        if self._draining:
            raise _rejected(DrainingError("the engine is draining: it takes no new sessions"))

    # -- text generation ------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """vLLM's `generate`: `prompt` is a prompt (token ids, text, {"prompt_token_ids": ...}) or an async
        iterator of `StreamingInput` chunks (one session). Yields `RequestOutput`s. Without `sampling_params`
        it samples with `default_sampling_params()`, the checkpoint's, as vLLM's `LLM.generate` does."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or self._default_sampling_params
        streaming = hasattr(prompt, "__aiter__")
        self._check_params(params, streaming)
        self._check_admitting()
        ids = None if streaming else prompt_token_ids(self.tokenizer, prompt, first=True)
        guide = None
        if params.structured_outputs is not None:
            guide = await self._off_loop(self._grammars.guide, params.structured_outputs)
        if params.n > 1:  # vLLM's parallel sampling: n child requests (parallel_sampling.py)
            self._families[request_id] = parallel_sampling.child_ids(request_id, params.n)
            try:
                async for out in parallel_sampling.generate_n(self.generate, ids, params, request_id):
                    yield out
            finally:
                self._families.pop(request_id, None)
            return
        outputs: asyncio.Queue = asyncio.Queue()
        sink = self._engine_thread.sink(outputs)
        feeder = None
        self._register(request_id, outputs)
        ended, sent = False, [not streaming]  # `sent`: whether any of the request reached the engine (the feeder's)
        try:  # from here the id is registered: whatever happens, the `finally` below lets go of it
            if streaming:
                self._unsent[request_id] = outputs
                feeder = asyncio.create_task(self._feed(prompt, request_id, params, sink, outputs, sent))
            else:
                self._send(lambda: self.core.add_chunk(request_id, ids, params, first=True, resumable=False,
                                                       sink=sink, guide=guide), request_id, sink)
            while True:
                item = await outputs.get()
                if item is END_OF_STREAM:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                item = merge_pending(item, outputs, delta=params.output_kind is RequestOutputKind.DELTA)
                if isinstance(item.prompt_logprobs, FlatPromptLogprobs):  # tokens named as read, by this tokenizer
                    item.prompt_logprobs.tokenizer = self.tokenizer
                if item.finished:
                    ended = True
                if params.output_kind is RequestOutputKind.FINAL_ONLY and not item.finished:
                    continue
                yield item
                if ended:
                    return
        finally:
            self._unregister(request_id, outputs)
            if self._unsent.get(request_id) is outputs:
                del self._unsent[request_id]
            if not ended and sent[0]:  # the consumer stopped early (cancel / aclose / break)
                self._send_quietly(lambda: self.core.abort(request_id), request_id)
            if feeder is not None and not feeder.done():
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)

    async def check_sampling_params(self, sampling_params: SamplingParams, *, streaming: bool = False) -> None:
        """Raises the `InvalidRequestError` that `generate` would raise for `sampling_params` (a one-shot request's, or
        a streaming-input session's), without running anything: what the engine does not serve, and a structured-outputs
        grammar that does not compile. vLLM's front end checks a request so before it queues it: a server calls this to
        refuse a request before it answers, then streams the answer at once. The grammar compiles off the event loop,
        into the cache `generate` takes it from: a request checked first is compiled once."""
        self._check_params(sampling_params, streaming)
        if sampling_params.structured_outputs is not None:
            await self._off_loop(self._grammars.compile, sampling_params.structured_outputs)

    def _check_params(self, params: SamplingParams, streaming: bool) -> None:
        if self.kind != "text":
            raise ValueError("text generation needs a text model; use start_transcription() for Voxtral Realtime")
        try:
            params.check_supported(streaming=streaming)
        except EngineError as exc:
            raise _rejected(exc) from None

    async def _off_loop(self, compile_grammar, structured_outputs):
        """`compile_grammar(structured_outputs)` on a worker thread (a large grammar takes long: neither the event loop
        nor the engine thread waits for it)."""
        try:
            return await asyncio.to_thread(compile_grammar, structured_outputs)
        except EngineError as exc:
            raise _rejected(exc) from None

    async def _feed(self, stream, request_id, default_params, sink, outputs, sent: list) -> None:
        """Forwards a session's input chunks; closes the input at exhaustion; fails the session on error."""
        first = True
        try:
            async for chunk in stream:
                prompt, params = checked_chunk(chunk, default_params)
                ids = prompt_token_ids(self.tokenizer, prompt, first=first)
                if not self._holds(request_id, outputs):  # read on the event loop, which alone changes it
                    return  # the session ended: nothing more is sent
                if first:
                    sent[0] = True
                    del self._unsent[request_id]
                is_first = first
                self._send(lambda ids=ids, params=params, is_first=is_first: self.core.add_chunk(
                    request_id, ids, params, first=is_first, resumable=True, sink=sink), request_id, sink)
                first = False
            if first:
                outputs.put_nowait(END_OF_STREAM)  # zero chunks: no engine request at all
            elif self._holds(request_id, outputs):
                self._send(lambda: self.core.end_input(request_id), request_id)
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():
                raise  # generate() ends its feeder
            # The input's own (a future it awaited was cancelled elsewhere): raised as it is, the caller would take
            # it for its own cancellation (a TaskGroup drops a child that ends so).
            error = EngineError("the streaming input was cancelled")
            error.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - the caller gets the original exception from generate()
            error = exc
        else:
            return
        if first:
            outputs.put_nowait(error)
        else:
            self._send_quietly(lambda: self._fail_request(request_id, error, sink), request_id, sink)

    def _holds(self, request_id: str, outputs: asyncio.Queue) -> bool:
        """Whether the request with these outputs still holds its id (not ended, not aborted)."""
        return self._live.get(request_id, (None, None))[1] is outputs

    def _fail_request(self, request_id, exc, sink) -> None:
        session = self.core.sessions.get(request_id)
        if session is not None:
            self.core.fail(session, exc)
        else:
            sink(exc)

    def _send_quietly(self, command, request_id: str | None = None, sink=None) -> None:
        """`_send` for clean-up paths: a stopped engine has already ended every session."""
        if self.healthy:
            self._send(command, request_id, sink)

    async def abort(self, request_id: str) -> None:
        """Ends a request or session now: a final output with finish_reason 'abort'; queued chunks dropped (a request
        with n > 1: each of its children). After shutdown it does nothing: the shutdown ended every request (a
        caller's clean-up must not raise)."""
        for child in self._families.get(request_id, ()):
            await self.abort(child)
        outputs, entry = self._unsent.get(request_id), self._live.get(request_id)
        if outputs is not None and entry is not None and entry[1] is outputs:
            del self._unsent[request_id]  # its feeder checks that it holds the id before it sends: it sends nothing
            self._unregister(request_id, outputs)
            post_to_loops([(entry[0], outputs, aborted_before_start(request_id))])
            return
        self._send_quietly(lambda: self.core.abort(request_id), request_id)

    # -- transcription --------------------------------------------------------------------------------
    async def start_transcription(self, delay_ms: int | None = None, *, session_id: str | None = None,
                                  sample_rate: int = SAMPLING_RATE,
                                  max_audio_seconds: float | None = None) -> TranscriptionSession:
        """A new realtime transcription session (see `jaxstream.transcription`) taking float PCM at
        `sample_rate` Hz (resampled to 16 kHz as it streams).

        `max_audio_seconds` limits the audio the session takes (appends past it are refused). Under window
        admission (`EngineConfig(realtime_admission="window")`) the engine reserves device memory for each
        session's largest size, so a limit shorter than the attention windows (e.g. a file of known length, or
        a server's per-connection audio limit) lets more sessions run at once.

        Answers at once: `CapacityError` when `max_live_sessions` sessions are live, `DrainingError` while
        draining, `EngineDeadError` after shutdown, `InvalidRequestError` for a bad delay or rate.
        """
        from jaxstream.models.audio import StreamingLogMel, n_delay_from_ms

        if self.kind != "realtime":
            raise _rejected(InvalidRequestError("transcription needs a Voxtral Realtime model"))
        self._check_admitting()
        cfg = self.model_config
        delay_ms = self.default_delay_ms if delay_ms is None else delay_ms
        try:
            n_delay = n_delay_from_ms(delay_ms)
        except ValueError as exc:
            raise _rejected(InvalidRequestError(str(exc))) from None
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not 8000 <= sample_rate <= 192000:
            raise _rejected(InvalidRequestError(f"sample_rate must be an integer number of Hz in [8000, 192000], "
                                                f"got {sample_rate!r}"))
        self._input_warnings(audio_checks.delay_warning(cfg, delay_ms))
        if max_audio_seconds is not None and (isinstance(max_audio_seconds, bool)
                                              or not isinstance(max_audio_seconds, numbers.Real)
                                              or not 0 < max_audio_seconds < math.inf):
            raise _rejected(InvalidRequestError(f"max_audio_seconds must be a positive number of seconds or None, "
                                                f"got {max_audio_seconds!r}"))
        if len(self._live) >= self.max_live_sessions:
            raise _rejected(CapacityError(f"the engine holds {len(self._live)} sessions, its limit; try again later"))
        session_id = session_id or uuid.uuid4().hex
        # Rounded first: 2.32 s / 80 ms is 28.999999999999996 in floating point, and the bound is 29 slots.
        max_slots = max(1, int(round(self.config.max_queued_audio_seconds / SLOT_SECONDS, 6)))
        front_end = self._front_end.stream(StreamingLogMel(n_delay, n_left_pad_tokens=cfg.n_left_pad_tokens),
                                           sample_rate)
        prompt = transcription_prompt(cfg, n_delay)
        transcript = TranscriptAssembler(self.tokenizer, delay_ms=int(delay_ms), prompt_len=len(prompt))
        link = _SessionLink(self, session_id)
        session = TranscriptionSession(link, session_id, int(delay_ms), front_end,
                                       transcript, sample_rate=sample_rate, max_queued_slots=max_slots,
                                       max_audio_seconds=max_audio_seconds)
        stream_slots = None if max_audio_seconds is None else stream_slot_bound(
            max_audio_seconds, n_delay, cfg.n_left_pad_tokens)
        link.events = events = _SessionEvents(session, self)
        self._register(session_id, events)
        sink = self._engine_thread.sink(events)
        try:
            self._send(lambda: self.core.add_session(session_id, n_delay=n_delay, prompt_ids=prompt, sink=sink,
                                                     backlog=session.backlog, max_slots=stream_slots),
                       session_id, sink)
        except EngineError:
            self._unregister(session_id, events)
            raise
        return session

    async def transcribe(self, pcm, delay_ms: int | None = None, *,
                         sample_rate: int = SAMPLING_RATE) -> TranscriptionDone:
        """Transcribes a whole recording: float mono PCM at `sample_rate` Hz (16 kHz unless said)."""
        session = await self.start_transcription(delay_ms, sample_rate=sample_rate)
        done = None
        try:
            # Pieces of the backlog bound: one append of it all grew the engine's mel buffers to it, for good.
            pcm, step = np.asarray(pcm), max(1, int(self.config.max_queued_audio_seconds * sample_rate))
            for piece in np.split(pcm, range(step, len(pcm), step)) if pcm.ndim == 1 else [pcm]:
                await session.append(piece)
            await session.finish()
            async for event in session:
                if isinstance(event, TranscriptionDone):
                    done = event
        except BaseException:  # bad audio, or the caller gave up: the session must not outlive the call
            await session.abort("transcribe_failed")
            raise
        if done is None:
            raise EngineError("the transcription ended without a result")
        return done

    async def wait_until_idle(self) -> None:
        """Returns once every command sent so far is applied and no session has work the engine could do
        now (for tests, benchmarks and draining). Returns at once when the engine is stopped."""
        await self._engine_thread.wait_until_idle()

    # -- lifecycle ------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Stops admitting new sessions (`DrainingError`) and waits up to `timeout` seconds for the live
        ones to end. Returns True when none is left; the caller decides what to do with the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._live and self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._live

    async def shutdown(self) -> None:
        """Stops the engine thread; sessions still running end with `EngineDeadError`."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`shutdown` for synchronous code."""
        # An abandoned multi-host engine's thread may never return from a collective with a lost process.
        self._engine_thread.stop(timeout=None if self._leader is None else _ABANDONED_JOIN_S)
        if self._leader is not None:
            self._leader.stop()
        if self.kind == "realtime":
            self._front_end.close()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()


def _rejected(error: EngineError) -> EngineError:
    """Logs a request the engine turns away (at INFO: the caller gets the error itself)."""
    logger.info("request rejected (%s): %s", error.code, error)
    return error


class _SessionLink:
    """What a `TranscriptionSession` may ask of its engine: commands for its own session id."""

    def __init__(self, engine: AsyncEngine, session_id: str):
        self._engine = engine
        self._session_id = session_id
        self.events: _SessionEvents | None = None  # the session's registry entry, set once it exists

    def send_audio(self, mel_slots, samples: float, total_slots: int | None = None) -> None:
        self._engine._send(AudioAppend(self._session_id, mel_slots, samples, total_slots), self._session_id)

    def abort(self, reason: str) -> None:
        engine, session_id = self._engine, self._session_id
        engine._unregister(session_id, self.events)
        logger.debug("transcription session %s aborted: %s", session_id, reason)
        engine._send_quietly(lambda: engine.core.abort(session_id), session_id)


class _SessionEvents:
    """Adapts a transcription session to the sink target interface and tracks its end."""

    def __init__(self, session: TranscriptionSession, engine: AsyncEngine):
        self._session = session
        self._engine = engine

    def put_nowait(self, event) -> None:
        self._session._put(event)
        if self._session.outcome is not None:  # done, failed or aborted: the engine holds it no more
            self._engine._unregister(self._session.session_id, self)
