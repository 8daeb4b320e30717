"""The engine thread of an `AsyncEngine`: commands in, ticks, outputs out to the event loops.

The asyncio side never touches scheduler state. It sends commands (closures, or `AudioAppend`s) here through a
queue; the thread applies them between ticks, runs ticks while there is work, and posts what the ticks handed to
sinks back to the event loops, one `call_soon_threadsafe` per loop per tick. What other threads may read is
published here: the `EngineMetrics` snapshot, `healthy`, and the registry of live streams, which the event loops
fill and the thread reads once, when it stops, to end every stream it would otherwise leave waiting.
"""
import asyncio
import logging
import queue
import threading
import time
import typing

import numpy as np

from jaxstream.engine import metrics as engine_metrics
from jaxstream.engine.loop_delivery import ResolveOnPut, post_to_loops
from jaxstream.errors import EngineDeadError, ProcessGroupError

logger = logging.getLogger(__name__)
_METRICS_PERIOD_S = 0.05  # how often a busy engine thread republishes its metrics snapshot
_IDLE_WAIT_S = 0.05  # the engine thread's longest sleep with nothing to run (new commands wake it at once)


class AudioAppend(typing.NamedTuple):
    """An audio append command; the engine thread applies consecutive ones with one `add_audio_many`."""

    request_id: str
    mel_slots: np.ndarray
    samples: float
    total_slots: int | None


class EngineThread:
    """Runs `core` (a scheduler) on a thread of its own, started by `start()`."""

    def __init__(self, core):
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self.outbox: list = []  # (loop, target, item) posted to the event loops after each tick
        self._stopping = False
        self.dead_reason: BaseException | None = None  # why the thread stopped, once it has
        # (loop, future) resolved when the engine has nothing to do; None once the thread has stopped. The
        # event loops add to it directly (under `lock`), not by a command: a command still queued when the
        # thread dies would never run, and its caller would wait for good.
        self._idle_waiters: list | None = []
        # Request / session ids whose stream has not ended -> (loop, target): the event loops add and remove
        # entries (under `lock`); the thread reads them once, when it stops, to end every stream.
        self.live: dict[str, tuple] = {}
        self.lock = threading.Lock()
        self.metrics = engine_metrics.snapshot(core)
        self._metrics_time = 0.0
        self._thread = threading.Thread(target=self._run, name="jaxstream-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """False once stopped or dead (`dead_reason` says why)."""
        return self._thread.is_alive() and not self._stopping and self.dead_reason is None

    def check_alive(self) -> None:
        if not self.healthy:
            reason = self.dead_reason
            raise EngineDeadError("the engine is shut down" if reason is None else
                                  f"the engine thread died: {type(reason).__name__}: {reason}")

    def send(self, command, request_id: str | None = None, sink=None) -> None:
        """Runs `command` (a callable, or an `AudioAppend`) on the thread before its next tick (commands run in
        order). If it raises, its session ends with the error; with no session, the error goes to `sink`."""
        self.check_alive()
        self._commands.put((request_id, command, sink))
        self._wake.set()

    def sink(self, target):
        """A callable for the thread that hands items to `target` (an asyncio queue or alike) on the running
        event loop."""
        loop = asyncio.get_running_loop()

        def sink(item):
            self.outbox.append((loop, target, item))

        return sink

    def flush_outbox(self) -> None:
        if self.outbox:
            items, self.outbox = self.outbox, []
            post_to_loops(items)

    async def wait_until_idle(self) -> None:
        """Returns once every command sent so far is applied and the core has no work it could do now; at once
        when the thread is stopped."""
        if not self.healthy:
            return
        future = asyncio.get_running_loop().create_future()
        with self.lock:
            if self._idle_waiters is None:  # the thread has stopped since `healthy` was read
                return
            # Commands sent before this are queued ahead of the thread's next idle check, which waits for the
            # queue to be empty.
            self._idle_waiters.append((future.get_loop(), future))
        self._wake.set()
        await future

    def abandon(self, error: ProcessGroupError) -> None:
        """A multi-host engine lost a process (called from the leader's watchdog thread). The thread may be
        blocked for good in a collective with the lost process, so this ends every live stream from here,
        through the registry the event loops keep, without touching scheduler state."""
        self.dead_reason = error
        with self.lock:
            live = list(self.live.values())
        post_to_loops([(loop, target, error) for loop, target in live] + self._take_idle_waiters(last=True))

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread after the commands already sent; sessions still running end with
        `EngineDeadError`."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout)

    # -- the thread -----------------------------------------------------------------------------------
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
                    self.metrics, self._metrics_time = engine_metrics.snapshot(self.core), now
                if self._idle_waiters and not self.core.has_work() and self._commands.empty():
                    # `metrics` is current when idle: a tick that did work and ended the work kept the snapshot
                    # of up to _METRICS_PERIOD_S before it (a clean-clone CI run read evictions=0 after an
                    # eviction).
                    self.metrics, self._metrics_time = engine_metrics.snapshot(self.core), now
                    self.outbox.extend(self._take_idle_waiters(last=False))
                self.flush_outbox()
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
        """The thread's last act: every session and every live stream (a `generate` whose input has not
        produced its first chunk included) ends with `error`; idle waiters return."""
        try:
            self._fail_everything(error)
            self.metrics = engine_metrics.snapshot(self.core)
        finally:
            with self.lock:
                live = list(self.live.values())
            self.outbox.extend((loop, target, error) for loop, target in live)
            self.outbox.extend(self._take_idle_waiters(last=True))
            self.flush_outbox()

    def _take_idle_waiters(self, *, last: bool) -> list:
        """Outbox items that resolve every idle waiter; with `last`, later ones return at once."""
        with self.lock:
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
            if type(command) is AudioAppend:
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

    def _apply_appends(self, appends: list[AudioAppend]) -> None:
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
