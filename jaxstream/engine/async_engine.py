"""`AsyncEngine`: the asyncio API (vLLM-style `generate` / `abort`, realtime transcription sessions) over an
engine core whose device loop runs on its own thread.

Threads: the asyncio side never touches scheduler state. It sends commands (closures) to the engine
thread through a queue; the engine thread applies them between ticks, runs ticks while there is work,
and posts outputs back to the event loop, one `call_soon_threadsafe` per tick. What the asyncio side may
read is published by the engine thread: the `EngineMetrics` snapshot and each session's `AudioBacklog`
counter. A realtime engine has a third thread, the front-end worker (audio_front_end.py): it computes the
log-mel of every session's appends in batches and answers each `append` on its event loop.

The contract a server needs: `start_transcription` answers `CapacityError` / `DrainingError` at once
instead of waiting; `append` awaits under backpressure; `drain` stops admitting and lets sessions end;
`healthy` turns False when the engine thread dies; `metrics()` is a thread-safe snapshot; every failure
a caller sees is an `EngineError` with a stable `code` (jaxstream/errors.py).
"""
import asyncio
import logging
import math
import numbers
import queue
import threading
import time
import typing
import uuid

import jax
import numpy as np

from jaxstream.engine import metrics as engine_metrics
from jaxstream.engine import parallel_sampling
from jaxstream.engine.audio_front_end import FrontEndWorker
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.loop_delivery import ResolveOnPut, post_to_loops
from jaxstream.engine.requests import RequestOutputKind, SamplingParams
from jaxstream.engine.residency import END_OF_STREAM
from jaxstream.engine.text_generation import aborted_before_start, checked_chunk, merge_pending, prompt_token_ids
from jaxstream.engine.transcription_session import (
    TranscriptAssembler, TranscriptionDone, TranscriptionSession, transcription_prompt,
)
from jaxstream.errors import (
    CapacityError, DrainingError, EngineDeadError, EngineError, InvalidRequestError, ProcessGroupError,
)
from jaxstream.models import audio_checks
from jaxstream.models.audio import SAMPLING_RATE, SLOT_SECONDS, stream_slot_bound

logger = logging.getLogger(__name__)
_METRICS_PERIOD_S = 0.05  # how often a busy engine thread republishes its metrics snapshot
_IDLE_WAIT_S = 0.05  # the engine thread's longest sleep with nothing to run (new commands wake it at once)
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
        self._leader = multihost.Leader(self.core.programs, on_lost=self._abandon) if spans else None
        self.core.programs.leader = self._leader
        if isinstance(self.model_config, VoxtralConfig):
            self.kind = "realtime"
            # Narrowband audio and untrained delays transcribe badly without an error: said once, in the log
            # (narrowband on audio_checks' logger, which the CLI mutes: it names each file's band itself).
            self._input_warnings = audio_checks.WarnOnce(logger)
            narrowband_warnings = audio_checks.WarnOnce(audio_checks.narrowband_logger)
            self._front_end = FrontEndWorker(warn=narrowband_warnings)  # every session's log-mel, batched
            self.core.hand_off_barrier = self._flush_outbox  # text events go out before `collected` counts them
        else:
            self.kind = "text"
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._outbox: list = []  # (loop, target, item) posted to the event loops after each tick
        self._stopping = False
        self._draining = False
        self.dead_reason: BaseException | None = None  # why the engine thread stopped, once it has
        # (loop, future) resolved when the engine has nothing to do; None once the engine has stopped. The
        # event loops add to it directly (under `_live_lock`), not by a command: a command still queued when
        # the thread dies would never run, and its caller would wait for good.
        self._idle_waiters: list | None = []
        # Request / session ids whose stream has not ended -> (loop, target): the event loops add and
        # remove entries; the engine thread reads them once, when it stops, to end every stream.
        self._live: dict[str, tuple] = {}
        self._families: dict[str, list[str]] = {}  # a request with n > 1 -> its children's ids
        self._live_lock = threading.Lock()
        # Streaming requests whose first chunk is unsent -> their outputs: `abort` ends them here (the core would find
        # no session, and the first chunk would then start one). Only the request that made an entry removes it.
        self._unsent: dict[str, asyncio.Queue] = {}
        self._metrics = engine_metrics.snapshot(self.core)
        self._metrics_time = 0.0
        self._thread = threading.Thread(target=self._run, name="jaxstream-engine", daemon=True)
        self._thread.start()

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
        return self._thread.is_alive() and not self._stopping and self.dead_reason is None

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
        return self._metrics

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

    # -- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                # The thread's CPU outside ticks (commands, the audio they store, handing outputs over) is
                # host work too: the next tick's host CPU counts it.
                cpu = time.thread_time()
                self._drain_commands()
                worked, held_until = False, None
                if self.core.has_work():
                    self.core.off_tick_cpu_s += time.thread_time() - cpu
                    try:
                        worked = self.core.step()
                        held_until = self.core.held_until
                    except ProcessGroupError:
                        raise  # the scheduler ended every session; a multi-host engine cannot go on
                    except Exception as exc:  # noqa: BLE001 - an engine bug: end every session, keep serving
                        logger.exception("engine tick failed; ending every session")
                        self._fail_everything(exc)
                        if self.core.cache.state_lost():  # a failed call consumed the donated device state
                            self.core.reset_device_state()
                    cpu = time.thread_time()
                now = time.monotonic()
                if not worked or now - self._metrics_time > _METRICS_PERIOD_S:
                    self._metrics, self._metrics_time = engine_metrics.snapshot(self.core), now
                if self._idle_waiters and not self.core.has_work() and self._commands.empty():
                    # `metrics()` is current when idle: a tick that did work and ended the work kept the
                    # snapshot of up to _METRICS_PERIOD_S before it (a clean-clone CI run read evictions=0
                    # after an eviction).
                    self._metrics, self._metrics_time = engine_metrics.snapshot(self.core), now
                    self._outbox.extend(self._take_idle_waiters(last=False))
                self._flush_outbox()
                self.core.off_tick_cpu_s += time.thread_time() - cpu
                if not worked:
                    # Until the batch the tick held back is due, at most _IDLE_WAIT_S; a command wakes it.
                    wait = _IDLE_WAIT_S if held_until is None else max(0.0, held_until - time.perf_counter())
                    self._wake.wait(timeout=min(wait, _IDLE_WAIT_S))
                    self._wake.clear()
            self._drain_commands()
            ended = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 - the thread is dying: say why to everyone waiting
            logger.exception("the engine thread died")
            ended = EngineDeadError(f"the engine thread died: {type(exc).__name__}: {exc}")
            ended.__cause__ = exc
            self.dead_reason = exc
        self._end_everything(ended)

    def _end_everything(self, error: EngineDeadError) -> None:
        """The engine thread's last act: every session and every live stream (a `generate` whose input has
        not produced its first chunk included) ends with `error`; idle waiters return."""
        try:
            self._fail_everything(error)
            self._metrics = engine_metrics.snapshot(self.core)
        finally:
            with self._live_lock:
                live = list(self._live.values())
            self._outbox.extend((loop, target, error) for loop, target in live)
            self._outbox.extend(self._take_idle_waiters(last=True))
            self._flush_outbox()

    def _take_idle_waiters(self, *, last: bool) -> list:
        """Outbox items that resolve every idle waiter; with `last`, later ones return at once."""
        with self._live_lock:
            waiters = self._idle_waiters or []
            self._idle_waiters = None if last else []
        return [(loop, ResolveOnPut(future), None) for loop, future in waiters]

    def _drain_commands(self) -> None:
        appends = []  # consecutive audio appends, applied together (one per stream per 80 ms in steady state)
        while True:
            try:
                request_id, command, sink = self._commands.get_nowait()
            except queue.Empty:
                break
            if type(command) is _Append:
                appends.append(command)
                continue
            if appends:
                self._apply_appends(appends)
                appends = []
            try:
                command()
            except Exception as exc:  # noqa: BLE001 - a command that raises ends its own session only
                session = self.core.sessions.get(request_id)
                if session is not None:
                    logger.error("a command of session %s failed; ending the session", request_id, exc_info=exc)
                    self.core.fail(session, exc)
                    continue
                # It failed before creating its session: nothing in the core will ever answer the caller,
                # who would wait forever unless the error goes straight to its sink.
                logger.error("a command for %s failed before its session existed", request_id, exc_info=exc)
                if sink is not None:
                    sink(exc)
        if appends:
            self._apply_appends(appends)

    def _apply_appends(self, appends: list["_Append"]) -> None:
        try:
            self.core.add_audio_many(appends)
        except Exception as exc:  # noqa: BLE001 - an engine bug: end the sessions that appended, not the others
            logger.error("applying %d audio appends failed; ending their sessions", len(appends), exc_info=exc)
            for request_id in dict.fromkeys(append.request_id for append in appends):
                session = self.core.sessions.get(request_id)
                if session is not None:
                    self.core.fail(session, exc)

    def _fail_everything(self, exc: BaseException) -> None:
        for session in list(self.core.sessions.values()):
            self.core.fail(session, exc)

    def _send(self, command, request_id: str | None = None, sink=None) -> None:
        """Runs `command` (a callable, or an `_Append`) on the engine thread before its next tick (commands
        run in order). If it raises, its session ends with the error; with no session, the error goes to
        `sink` (the caller's)."""
        self._check_alive()
        self._commands.put((request_id, command, sink))
        self._wake.set()

    def _check_alive(self) -> None:
        if not self.healthy:
            reason = self.dead_reason
            raise EngineDeadError("the engine is shut down" if reason is None else
                                  f"the engine thread died: {type(reason).__name__}: {reason}")

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
        self._check_alive()
        if self._draining:
            raise _rejected(DrainingError("the engine is draining: it takes no new sessions"))

    def _sink(self, target: asyncio.Queue):
        """A callable for the engine thread that hands items to `target` on the event loop."""
        loop = asyncio.get_running_loop()

        def sink(item):
            self._outbox.append((loop, target, item))

        return sink

    def _flush_outbox(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            post_to_loops(items)

    def _abandon(self, error: ProcessGroupError) -> None:
        """A multi-host engine lost a process (called from the leader's watchdog thread). The engine thread
        may be blocked for good in a collective with the lost process, so this ends every live stream from
        here, through the registry the event loops keep, without touching scheduler state."""
        self.dead_reason = error
        with self._live_lock:
            live = list(self._live.values())
        post_to_loops([(loop, target, error) for loop, target in live] + self._take_idle_waiters(last=True))

    # -- text generation ------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """vLLM's `generate`: `prompt` is a prompt (token ids, text, {"prompt_token_ids": ...}) or an async
        iterator of `StreamingInput` chunks (one session). Yields `RequestOutput`s. Without `sampling_params`
        it samples with `default_sampling_params()`, the checkpoint's, as vLLM's `LLM.generate` does."""
        if self.kind != "text":
            raise ValueError("generate() serves text models; use start_transcription() for Voxtral Realtime")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or self._default_sampling_params
        streaming = hasattr(prompt, "__aiter__")
        try:
            params.check_supported(streaming=streaming)
        except EngineError as exc:
            raise _rejected(exc) from None
        self._check_admitting()
        ids = None if streaming else prompt_token_ids(self.tokenizer, prompt, first=True)
        if params.n > 1:  # vLLM's parallel sampling: n child requests (parallel_sampling.py)
            self._families[request_id] = parallel_sampling.child_ids(request_id, params.n)
            try:
                async for out in parallel_sampling.generate_n(self.generate, ids, params, request_id):
                    yield out
            finally:
                self._families.pop(request_id, None)
            return
        outputs: asyncio.Queue = asyncio.Queue()
        sink = self._sink(outputs)
        feeder = None
        self._register(request_id, outputs)
        ended, sent = False, [not streaming]  # `sent`: whether any of the request reached the engine (the feeder's)
        try:  # from here the id is registered: whatever happens, the `finally` below lets go of it
            if streaming:
                self._unsent[request_id] = outputs
                feeder = asyncio.create_task(self._feed(prompt, request_id, params, sink, outputs, sent))
            else:
                self._send(lambda: self.core.add_chunk(request_id, ids, params, first=True, resumable=False,
                                                       sink=sink), request_id, sink)
            while True:
                item = await outputs.get()
                if item is END_OF_STREAM:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                item = merge_pending(item, outputs, delta=params.output_kind is RequestOutputKind.DELTA)
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
        sink = self._sink(events)
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
        if not self.healthy:
            return
        future = asyncio.get_running_loop().create_future()
        with self._live_lock:
            if self._idle_waiters is None:  # the thread has stopped since `healthy` was read
                return
            # Commands sent before this are queued ahead of the engine's next idle check, which waits for
            # the queue to be empty.
            self._idle_waiters.append((future.get_loop(), future))
        self._wake.set()
        await future

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
        self._stopping = True
        self._wake.set()
        # An abandoned multi-host engine's thread may never return from a collective with a lost process.
        self._thread.join(timeout=None if self._leader is None else _ABANDONED_JOIN_S)
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


class _Append(typing.NamedTuple):
    """An audio append command; the engine thread applies consecutive ones with one `add_audio_many`."""

    request_id: str
    mel_slots: np.ndarray
    samples: float
    total_slots: int | None


class _SessionLink:
    """What a `TranscriptionSession` may ask of its engine: commands for its own session id."""

    def __init__(self, engine: AsyncEngine, session_id: str):
        self._engine = engine
        self._session_id = session_id
        self.events: _SessionEvents | None = None  # the session's registry entry, set once it exists

    def send_audio(self, mel_slots, samples: float, total_slots: int | None = None) -> None:
        self._engine._send(_Append(self._session_id, mel_slots, samples, total_slots), self._session_id)

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
