"""Which sessions live on the device: slots, pages, LRU eviction of parked sessions to host memory.

Shared by the text scheduler and the realtime transcription scheduler. A *resident* session holds a slot
(`max_sessions` in all) and its pages; a *parked* session (its input is idle) keeps them, like vLLM's
WAITING_FOR_STREAMING_REQ. When a slot or a page is needed and none is free, the least recently active
parked session is evicted: its pages and slot rows are copied to host memory (bounded by
`host_offload_bytes`) and restored bit for bit on its next input. A session that cannot be offloaded
(host budget spent) is dropped to recompute when its scheduler allows that (text), otherwise it stays.
"""
import dataclasses
import enum
import logging
import time

import jax
import numpy as np

from jaxstream.engine.kv_cache import DeviceCache
from jaxstream.errors import ProcessGroupError

logger = logging.getLogger(__name__)
END_OF_STREAM = object()  # delivered to a sink when a stream ends without a final output


class Status(enum.Enum):
    WAITING = "waiting"  # has work; not admitted yet, or admitted and waiting for budget
    RUNNING = "running"
    PARKED = "parked"  # a chunk ended and no input is queued; KV kept (vLLM WAITING_FOR_STREAMING_REQ)
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class TickStats:
    """Timing of one engine tick: `wait_s` is the time blocked on the device results; the rest of
    `total_s` is host work (scheduling, batch building, dispatch, output processing)."""

    rows: int  # sessions advanced
    steps: int  # 80 ms steps / tokens advanced in total
    total_s: float
    wait_s: float
    # CPU time the engine thread spent on the tick (device work runs on other threads), and outside ticks
    # since the previous one (commands, the audio they store, handing outputs over): its host work, not
    # inflated by waiting for a core on a loaded machine as `host_s` is. None where not measured.
    host_cpu_s: float | None = None
    # Of `host_cpu_s`, the CPU spent inside the device's calls (dispatching programs, reading results). On a
    # CPU backend XLA runs a program's first operations on the calling thread, so this is partly the
    # model's own compute there; on an accelerator it is the runtime's dispatch cost. None where not measured.
    device_call_cpu_s: float | None = None

    @property
    def host_s(self) -> float:
        return self.total_s - self.wait_s


class TickLog:
    """The `TickStats` of the last `capacity` ticks in preallocated numpy columns, ticks numbered from 0 in
    the order recorded. Its memory is taken once, up front, so a server's memory does not creep while the log
    fills (as a deque of objects did: 0.25 KB per tick, 70 ticks a second under load, for 24 minutes)."""

    def __init__(self, capacity: int = 100_000):
        # rows, steps, total_s, wait_s, host_cpu_s, device_call_cpu_s (NaN: None)
        self._columns = np.zeros((capacity, 6), np.float64)
        self.recorded = 0  # ticks recorded, including those overwritten since

    def append(self, stats: TickStats) -> None:
        cpu, calls = (np.nan if value is None else value for value in (stats.host_cpu_s, stats.device_call_cpu_s))
        self._columns[self.recorded % len(self._columns)] = (stats.rows, stats.steps, stats.total_s, stats.wait_s, cpu,
                                                             calls)
        self.recorded += 1

    def __len__(self) -> int:
        return min(self.recorded, len(self._columns))

    def window(self, begin: int, end: int) -> list[TickStats]:
        """Ticks number `begin` to `end - 1`, those still held."""
        return [TickStats(int(rows), int(steps), total, wait, None if np.isnan(cpu) else cpu,
                          None if np.isnan(calls) else calls)
                for rows, steps, total, wait, cpu, calls in self._held(begin, end).tolist()]

    def durations(self, begin: int, end: int) -> tuple[float, ...]:
        """`total_s` of the ticks `window` returns, without building them (the engine thread's metrics
        snapshot reads 256 of them whenever it goes idle: 0.14 ms a snapshot with TickStats, 0.05 without)."""
        return tuple(self._held(begin, end)[:, 2].tolist())

    def _held(self, begin: int, end: int) -> np.ndarray:
        numbers = np.arange(max(begin, self.recorded - len(self)), min(end, self.recorded))
        return self._columns[numbers % len(self._columns)]


class LatencyHistogram:
    """Counts of latency samples in log-spaced bins (1 % wide, 10 us to 1000 s): bounded memory for a
    server's whole life, and a few array operations to record a tick's samples. A benchmark takes a copy
    of `counts` before a run and subtracts it after."""

    EDGES = np.geomspace(1e-5, 1e3, 1852)  # ln(1e8) / ln(1.01) = 1851 intervals of 1 %

    def __init__(self):
        self.counts = np.zeros(len(self.EDGES) + 1, np.int64)  # bin 0: below 10 us; the last: above 1000 s

    def record(self, seconds: np.ndarray) -> None:
        if seconds.size:
            self.counts += np.bincount(np.searchsorted(self.EDGES, seconds), minlength=len(self.counts))

    @classmethod
    def percentile(cls, counts: np.ndarray, q: float) -> float | None:
        """The q-th percentile (seconds, upper edge of its bin) of the samples `counts` holds; None
        without samples."""
        total = int(counts.sum())
        if total == 0:
            return None
        index = int(np.searchsorted(np.cumsum(counts), max(1, int(np.ceil(q / 100 * total)))))
        return float(cls.EDGES[min(index, len(cls.EDGES) - 1)])


class SessionBase:
    def __init__(self, request_id: str, sink, pages):
        self.request_id = request_id
        self.sink = sink  # called on the engine thread with outputs, an Exception, or END_OF_STREAM
        self.status = Status.WAITING
        self.slot: int | None = None
        self.pages = pages  # {stack name: SessionPages}
        self.offloaded = None  # host copy of pages + slot rows while evicted
        self.offloaded_bytes = 0
        self.last_active = 0
        self.admitted_order = 0

    @property
    def resident(self) -> bool:
        return self.slot is not None


class Residency:
    """Slot/page accounting and eviction over the `DeviceCache` of a model's `Programs`; subclasses schedule
    the work."""

    can_drop_kv = False  # True when an evicted session can recompute its KV instead of restoring it

    def __init__(self, programs, host_offload_bytes: int):
        self.programs = programs
        self.cache: DeviceCache = programs.cache
        self.host_offload_bytes = host_offload_bytes
        self.host_bytes = 0
        self.sessions: dict[str, SessionBase] = {}
        self._clock = 0  # orders activity (LRU eviction) and admissions
        self.tick = 0
        self.evictions = 0  # sessions moved off the device (to host memory or to recompute)
        self.tick_stats = TickLog()
        self.held_until: float | None = None  # perf_counter time work held back by the last tick is due
        self.off_tick_cpu_s = 0.0  # the engine thread's CPU outside ticks since the last one (AsyncEngine adds it)
        # Seconds from the time an input reached the engine to the time the id generated from it was read
        # back on the host, for every generated id, control ids included (recorded by the transcription
        # scheduler: an 80 ms audio slot -> the id sampled at its position).
        self.token_latency = LatencyHistogram()

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """Tokens of the sessions that looked their context up in a text engine's prefix cache, and of those the
        tokens found there (vLLM's prefix_cache_queries and prefix_cache_hits); (0, 0) without one."""
        return 0, 0

    @property
    def ticks_recorded(self) -> int:
        """Every tick that did work, including those the tick log no longer holds."""
        return self.tick_stats.recorded

    def record_tick(self, stats: TickStats) -> None:
        if stats.host_cpu_s is not None:
            stats = dataclasses.replace(stats, host_cpu_s=stats.host_cpu_s + self.off_tick_cpu_s)
        self.off_tick_cpu_s = 0.0
        self.tick_stats.append(stats)

    def fetch(self, outputs):
        """Blocks on the device results of a tick; returns (host copies, seconds waited)."""
        start = time.perf_counter()
        # np.asarray per output: a fraction of jax.device_get's host cost on small outputs (its async
        # copy bookkeeping), and on CPU the array is the device buffer itself.
        fetched = jax.tree_util.tree_map(np.asarray, outputs)
        return fetched, time.perf_counter() - start

    def next_clock(self, count: int = 1) -> int:
        """The first of `count` consecutive clock values."""
        first = self._clock + 1
        self._clock += count
        return first

    def touch(self, session: SessionBase) -> None:
        session.last_active = self.next_clock()

    # -- counts -----------------------------------------------------------------------------------
    @property
    def num_parked(self) -> int:
        return sum(s.status is Status.PARKED for s in self.sessions.values())

    @property
    def num_unfinished(self) -> int:
        """Sessions with work (vLLM's count: parked sessions are excluded)."""
        return sum(s.status in (Status.WAITING, Status.RUNNING) for s in self.sessions.values())

    @property
    def num_resident(self) -> int:
        return self.cache.max_sessions - self.cache.num_free_slots

    # -- eviction -------------------------------------------------------------------------------------
    def _parked_lru(self, protect=()):
        candidates = [s for s in self.sessions.values()
                      if s.status is Status.PARKED and s.resident and s not in protect]
        return sorted(candidates, key=lambda s: s.last_active)

    def evict(self, session: SessionBase) -> bool:
        """Moves a resident session off the device; False if it must stay (cannot offload nor drop)."""
        nbytes = self._offload_size(session)
        if self.host_bytes + nbytes <= self.host_offload_bytes:
            session.offloaded, session.offloaded_bytes = self.cache.offload(session.slot, session.pages)
            self.host_bytes += session.offloaded_bytes
            logger.info("evicted %s session %s to host memory (%d bytes; %d held there in all)",
                        session.status.value, session.request_id, session.offloaded_bytes, self.host_bytes)
        elif self.can_drop_kv:
            self.cache.release_pages(session.pages)
            self.cache.release_slot(session.slot)
            self._dropped_kv(session)
            logger.info("evicted parked session %s by dropping its KV (host memory full): recomputed on its next "
                        "input", session.request_id)
        else:
            logger.debug("parked session %s stays on the device: host memory is full and it cannot recompute",
                         session.request_id)
            return False
        session.slot = None
        self.evictions += 1
        return True

    def _offload_size(self, session: SessionBase) -> int:
        """Host bytes an offload of `session` takes: its allocated pages and its slot rows (a text engine's penalty
        counts are a vocabulary's int32s, 0.5 MB for 131k ids)."""
        return self.cache.slot_row_bytes + sum(session.pages[name].num_allocated * spec.bytes_per_page(self.cache.dtype)
                                               for name, spec in self.cache.specs.items())

    def _dropped_kv(self, session: SessionBase) -> None:
        raise NotImplementedError

    def evict_one_parked(self, protect=()) -> bool:
        for victim in self._parked_lru(protect):
            if self.evict(victim):
                return True
        return False

    def evict_for(self, requester: SessionBase, protect=()) -> bool:
        """Moves one session off the device to make room for `requester`: a parked one, least recently
        active first (a scheduler may widen or narrow who gives way)."""
        return self.evict_one_parked(protect=(requester, *protect))

    def admit(self, session: SessionBase) -> bool:
        """Gives a waiting session a slot (restoring it if evicted); evicts parked sessions as needed."""
        if session.resident:
            return True
        if self.cache.num_free_slots == 0 and not self.evict_for(session):
            return False
        if session.offloaded is not None:
            needed = self.cache.pages_to_restore(session.offloaded)
            if not self._make_room(session, needed):
                return False
            session.slot = self.cache.restore(session.offloaded, session.pages)
            self.host_bytes -= session.offloaded_bytes
            session.offloaded, session.offloaded_bytes = None, 0
        else:
            session.slot = self.cache.take_slot()
        session.admitted_order = self.next_clock()
        return True

    def _make_room(self, session: SessionBase, needed: dict[str, int], protect=()) -> bool:
        while any(self.cache.pools[name].num_free < n for name, n in needed.items()):
            if not self.evict_for(session, protect):
                return False
        return True

    def reserve(self, session: SessionBase, spans: dict[str, tuple[int, int]], protect=()) -> bool:
        """Allocates the pages positions [start, stop) of each stack will be written to."""
        missing = {name: session.pages[name].missing(*span) for name, span in spans.items()}
        if not any(missing.values()):
            return True  # the common case: the positions land on pages the session holds
        if not self._make_room(session, {name: len(pages) for name, pages in missing.items()}, protect):
            return False
        for name, pages in missing.items():
            session.pages[name].assign(self.cache.pools[name], pages)
        return True

    # -- ending ---------------------------------------------------------------------------------------
    def release(self, session: SessionBase) -> None:
        """Frees everything a session holds (device pages and slot, or its host copy)."""
        if session.resident:
            self.cache.release_pages(session.pages)
            self.cache.release_slot(session.slot)
            session.slot = None
        if session.offloaded is not None:
            self.host_bytes -= session.offloaded_bytes
            session.offloaded, session.offloaded_bytes = None, 0
        session.status = Status.FINISHED
        self.sessions.pop(session.request_id, None)

    def fail(self, session: SessionBase, error: BaseException) -> None:
        """Ends one session with an error; the others are unaffected."""
        self.release(session)
        deliver(session, error)

    def dispatch_failed(self, sessions, error: BaseException) -> None:
        """A dispatch raised: its sessions end with the error; if the donated device state was consumed,
        every resident session lost its KV and ends too, and the state is rebuilt for new sessions.
        On a multi-host engine every session ends and `ProcessGroupError` is raised: the processes may no
        longer agree on the device state, so nothing more may run."""
        if self.programs.leader is not None:
            if not isinstance(error, ProcessGroupError):
                fatal = ProcessGroupError(f"a dispatch failed on the multi-host engine: {error}")
                fatal.__cause__, error = error, fatal
            logger.error("the multi-host engine failed; ending every session", exc_info=error)
            for session in list(self.sessions.values()):
                self.fail(session, error)
            raise error
        logger.error("a dispatch failed; ending its %d session(s)", len(sessions), exc_info=error)
        for session in sessions:
            if session.request_id in self.sessions:
                self.fail(session, error)
        if self.cache.state_lost():
            logger.error("the failed dispatch consumed the device state: ending every resident session")
            for session in [s for s in self.sessions.values() if s.resident]:
                self.fail(session, error)
            self.reset_device_state()

    def reset_device_state(self) -> None:
        """Rebuilds the device state from zeros (no session may be resident), then the scheduler's own
        device data in it (`state_reset`)."""
        self.cache.reset_state()
        self.state_reset()

    def state_reset(self) -> None:
        """Restores what a scheduler keeps in the device state besides sessions (nothing by default)."""

    def at_baseline(self) -> bool:
        return not self.sessions and self.host_bytes == 0 and self.cache.at_baseline()


def deliver(session: SessionBase, item) -> None:
    """Hands an item to a session's sink; a failing sink must not take the engine down."""
    try:
        session.sink(item)
    except Exception:  # noqa: BLE001 - the consumer's problem, isolated to its session
        logger.exception("session %s: handing it an output failed", session.request_id)
