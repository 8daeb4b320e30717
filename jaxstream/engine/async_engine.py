"""`AsyncEngine`: the asyncio API (vLLM-style `generate` / `abort`, realtime transcription sessions) over an
engine core whose device loop runs on its own thread.

Threads: the asyncio side never touches scheduler state. It sends commands (closures) to the engine
thread through a queue; the engine thread applies them between ticks, runs ticks while there is work,
and posts outputs back to the event loop, one `call_soon_threadsafe` per tick.
"""
import asyncio
import dataclasses
import queue
import threading
import uuid

from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import RequestOutput, RequestOutputKind, SamplingParams, StreamingInput
from jaxstream.engine.residency import END_OF_STREAM
from jaxstream.engine.transcription_session import TranscriptionDone, TranscriptionSession


class AsyncEngine:
    """Serves one model: a text LM through `generate`, or Voxtral Realtime through transcription sessions."""

    def __init__(self, model, *, config: EngineConfig | None = None, tokenizer=None, eos_token_id=None):
        from jaxstream.engine import builders
        from jaxstream.models.config import VoxtralConfig

        self.config = config or EngineConfig()
        self.model_config = builders.model_config(model)
        self.tokenizer = tokenizer
        if isinstance(self.model_config, VoxtralConfig):
            if tokenizer is None:
                raise ValueError("Voxtral Realtime needs its tokenizer (tekken.json) for transcription")
            self.kind = "realtime"
            self.core = builders.build_realtime_core(model, self.config, tokenizer)
        else:
            self.kind = "text"
            if eos_token_id is None and tokenizer is not None:
                eos_token_id = tokenizer.eos_id
            factory = tokenizer.stream_decoder if tokenizer is not None else None
            self.core = builders.build_text_core(model, self.config, eos_token_id=eos_token_id,
                                             detokenizer_factory=factory)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._outbox: list = []  # (loop, target, item) posted to the event loops after each tick
        self._stopping = False
        self._idle_waiters: list = []  # (loop, future) resolved when the engine has nothing to do
        self._live: set[str] = set()  # request / session ids whose stream has not ended (event-loop side)
        self._thread = threading.Thread(target=self._run, name="jaxstream-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_source, config: EngineConfig | None = None, *, dtype=None) -> "AsyncEngine":
        """Loads a model (built-in name, local directory or hub id; models/loading.py) and starts an engine."""
        from jaxstream.engine import builders, sharding
        from jaxstream.models.loading import load_model
        from jaxstream.models.tokenizers import load_tokenizer

        config = config or EngineConfig()
        placement = sharding.Placement(config.mesh, config.tp_axis)
        rule = placement.param_sharding if config.mesh is not None else None
        loaded = load_model(model_source, dtype=dtype or builders.engine_dtype(config), sharding=rule)
        tokenizer = load_tokenizer(loaded.tokenizer_path) if loaded.tokenizer_path else None
        return cls(loaded.model, config=config, tokenizer=tokenizer)

    # -- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            worked = False
            if self.core.has_work():
                try:
                    worked = self.core.step()
                except Exception as exc:  # noqa: BLE001 - an engine bug: end every session, keep serving
                    self._fail_everything(exc)
            if self._idle_waiters and not self.core.has_work() and self._commands.empty():
                waiters, self._idle_waiters = self._idle_waiters, []
                self._outbox.extend((loop, _Resolve(future), None) for loop, future in waiters)
            self._flush_outbox()
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        self._drain_commands()
        self._fail_everything(RuntimeError("the engine was shut down"))
        self._flush_outbox()

    def _drain_commands(self) -> None:
        while True:
            try:
                request_id, command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception as exc:  # noqa: BLE001 - a command that raises ends its own session only
                session = self.core.sessions.get(request_id)
                if session is not None:
                    self.core.fail(session, exc)

    def _fail_everything(self, exc: BaseException) -> None:
        for session in list(self.core.sessions.values()):
            self.core.fail(session, exc)

    def _send(self, command, request_id: str | None = None) -> None:
        """Runs `command` on the engine thread before its next tick (commands run in order)."""
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        self._commands.put((request_id, command))
        self._wake.set()

    def _sink(self, target: asyncio.Queue):
        """A callable for the engine thread that hands items to `target` on the event loop."""
        loop = asyncio.get_running_loop()

        def sink(item):
            self._outbox.append((loop, target, item))

        return sink

    def _flush_outbox(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict = {}
        for loop, target, item in items:
            by_loop.setdefault(loop, []).append((target, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more

    # -- text generation ------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        """vLLM's `generate`: `prompt` is a prompt (token ids, text, {"prompt_token_ids": ...}) or an async
        iterator of `StreamingInput` chunks (one session). Yields `RequestOutput`s."""
        if self.kind != "text":
            raise ValueError("generate() serves text models; use start_transcription() for Voxtral Realtime")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        streaming = hasattr(prompt, "__aiter__")
        params.check_supported(streaming=streaming)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = None if streaming else self._tokenize(prompt, first=True)
        outputs: asyncio.Queue = asyncio.Queue()
        sink = self._sink(outputs)
        feeder = None
        self._live.add(request_id)
        if streaming:
            feeder = asyncio.create_task(self._feed(prompt, request_id, params, sink, outputs))
        else:
            self._send(lambda: self.core.add_chunk(request_id, ids, params, first=True, resumable=False, sink=sink),
                       request_id)
        ended = False
        try:
            while True:
                item = await outputs.get()
                if item is END_OF_STREAM:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                item = _merge_pending(item, outputs, delta=params.output_kind is RequestOutputKind.DELTA)
                if item.finished:
                    ended = True
                if params.output_kind is RequestOutputKind.FINAL_ONLY and not item.finished:
                    continue
                yield item
                if ended:
                    return
        finally:
            self._live.discard(request_id)
            if not ended:  # the consumer stopped early (cancel / aclose / break)
                self._send_quietly(lambda: self.core.abort(request_id), request_id)
            if feeder is not None and not feeder.done():
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)

    async def _feed(self, stream, request_id, default_params, sink, outputs) -> None:
        """Forwards a session's input chunks; closes the input at exhaustion; fails the session on error."""
        first = True
        try:
            async for chunk in stream:
                if not isinstance(chunk, StreamingInput):
                    chunk = StreamingInput(chunk)
                params = chunk.sampling_params or default_params
                params.check_supported(streaming=True)
                if isinstance(chunk.prompt, dict) and "prompt_embeds" in chunk.prompt:
                    raise ValueError("prompt_embeds are not supported with streaming input")
                ids = self._tokenize(chunk.prompt, first=first)
                if request_id not in self._live:
                    return  # the session ended: nothing more is sent
                is_first = first
                self._send(lambda ids=ids, params=params, is_first=is_first: self.core.add_chunk(
                    request_id, ids, params, first=is_first, resumable=True, sink=sink), request_id)
                first = False
            if first:
                outputs.put_nowait(END_OF_STREAM)  # zero chunks: no engine request at all
            elif request_id in self._live:
                self._send(lambda: self.core.end_input(request_id), request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller gets the original exception from generate()
            if first:
                outputs.put_nowait(exc)
            else:
                self._send_quietly(lambda error=exc: self._fail_request(request_id, error, sink), request_id)

    def _fail_request(self, request_id, exc, sink) -> None:
        session = self.core.sessions.get(request_id)
        if session is not None:
            self.core.fail(session, exc)
        else:
            sink(exc)

    def _send_quietly(self, command, request_id: str | None = None) -> None:
        if not self._stopping:
            self._send(command, request_id)

    def _tokenize(self, prompt, *, first: bool) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return ([self.tokenizer.bos_id] if first else []) + self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
            return [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    async def abort(self, request_id: str) -> None:
        """Ends a request or session now: a final output with finish_reason 'abort'; queued chunks dropped."""
        self._send(lambda: self.core.abort(request_id), request_id)

    # -- transcription --------------------------------------------------------------------------------
    async def start_transcription(self, delay_ms: int | None = None, session_id: str | None = None):
        """A new realtime transcription session (see `jaxstream.transcription`)."""
        from jaxstream.models.audio import StreamingLogMel, n_delay_from_ms

        if self.kind != "realtime":
            raise ValueError("transcription needs a Voxtral Realtime model")
        cfg = self.model_config
        delay_ms = delay_ms if delay_ms is not None else (self.config.default_delay_ms or cfg.default_delay_ms)
        n_delay = n_delay_from_ms(delay_ms)
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._live:
            raise ValueError(f"session id {session_id!r} is already running")
        session = TranscriptionSession(self, session_id, int(delay_ms),
                                       StreamingLogMel(n_delay, n_left_pad_tokens=cfg.n_left_pad_tokens))
        prompt = [cfg.bos_id] + [cfg.streaming_pad_id] * (cfg.n_left_pad_tokens + n_delay)
        sink = self._sink(_SessionEvents(session, self._live))
        self._live.add(session_id)
        self._send(lambda: self.core.add_session(session_id, n_delay=n_delay, delay_ms=int(delay_ms),
                                                 prompt_ids=prompt, sink=sink), session_id)
        return session

    async def transcribe(self, pcm, delay_ms: int | None = None) -> TranscriptionDone:
        """Transcribes a whole recording (float32 mono 16 kHz)."""
        session = await self.start_transcription(delay_ms)
        await session.append(pcm)
        await session.finish()
        done = None
        async for event in session:
            if isinstance(event, TranscriptionDone):
                done = event
        if done is None:
            raise RuntimeError("the transcription ended without a result")
        return done

    def _check_backlog(self, session_id: str, num_samples: int) -> None:
        queued_seconds = self.core.queued_slots(session_id) * 0.08 + num_samples / 16000
        if queued_seconds > self.config.max_queued_audio_seconds:
            raise BufferError(f"session {session_id}: more than {self.config.max_queued_audio_seconds:g} s of "
                              "audio queued; the engine is behind (append more slowly)")

    def _send_audio(self, session_id: str, mel_slots, num_samples: int, total_slots=None) -> None:
        self._send(lambda: self.core.add_audio(session_id, mel_slots, num_samples, total_slots), session_id)

    def _abort_transcription(self, session_id: str) -> None:
        self._live.discard(session_id)
        self._send_quietly(lambda: self.core.abort(session_id), session_id)

    async def wait_until_idle(self) -> None:
        """Returns once every command sent so far is applied and no session has work the engine could do
        now (for tests, benchmarks and draining)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(lambda: self._idle_waiters.append((loop, future)))
        await future

    # -- lifecycle ------------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stops the engine thread; sessions still running end with an error."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`shutdown` for synchronous code."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()


def _put_all(batch) -> None:
    for target, item in batch:
        target.put_nowait(item)


class _Resolve:
    def __init__(self, future):
        self._future = future

    def put_nowait(self, _) -> None:
        if not self._future.done():
            self._future.set_result(None)


class _SessionEvents:
    """Adapts a transcription session to the sink target interface and tracks its end."""

    def __init__(self, session: TranscriptionSession, live: set):
        self._session = session
        self._live = live

    def put_nowait(self, event) -> None:
        if event is None or isinstance(event, (BaseException, TranscriptionDone)):
            self._live.discard(self._session.session_id)
        self._session._put(event)


def _merge_pending(item: RequestOutput, outputs: asyncio.Queue, *, delta: bool) -> RequestOutput:
    """A slow consumer gets the outputs queued behind `item` merged into one, never across a chunk end."""
    while item.outputs[0].finish_reason is None and not outputs.empty():
        following = outputs._queue[0]  # noqa: SLF001 - peek; asyncio.Queue has no public peek
        if not isinstance(following, RequestOutput):
            break
        outputs.get_nowait()
        item = _merged(item, following) if delta else following  # a cumulative output contains the earlier
    return item


def _merged(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    a, b = first.outputs[0], second.outputs[0]
    logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
    completion = dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                                     logprobs=logprobs)
    return dataclasses.replace(second, outputs=[completion])
