"""`EngineMetrics`: an immutable snapshot of what an engine holds, taken on the engine thread.

The engine thread publishes a fresh snapshot every ~50 ms while busy and whenever it goes idle, so any
thread (a Prometheus scrape, a health check) reads a consistent view without touching scheduler state.
"""
import dataclasses

from jaxstream.engine.residency import Residency, Status

RECENT_TICKS = 256  # tick durations a snapshot carries; a collector scraping every second misses none


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    sessions: int  # every session the engine holds: waiting, running, parked or evicted
    waiting: int
    running: int
    parked: int
    evicted: int  # parked sessions moved to host memory
    pages_used: dict[str, int]  # per page pool (text; or encoder and decoder)
    pages_total: dict[str, int]
    host_offload_bytes: int
    evictions: int  # sessions moved off the device so far
    ticks: int  # ticks run so far; the last entry of `recent_tick_seconds` is tick number `ticks`
    recent_tick_seconds: tuple[float, ...]
    max_sessions: int
    # Text engines' automatic prefix caching, in tokens so far (vLLM's counts): of the sessions that looked their
    # context up, and of those found cached. 0 for transcription engines.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def snapshot(scheduler: Residency) -> EngineMetrics:
    counts = {status: 0 for status in Status}
    evicted = 0
    for session in scheduler.sessions.values():
        counts[session.status] += 1
        evicted += session.offloaded is not None
    pools = scheduler.cache.pools
    recorded = scheduler.ticks_recorded
    queries, hits = scheduler.prefix_cache_counts
    return EngineMetrics(
        sessions=len(scheduler.sessions), waiting=counts[Status.WAITING], running=counts[Status.RUNNING],
        parked=counts[Status.PARKED], evicted=evicted,
        pages_used={name: pool.capacity - pool.num_free for name, pool in pools.items()},
        pages_total={name: pool.capacity for name, pool in pools.items()},
        host_offload_bytes=scheduler.host_bytes, evictions=scheduler.evictions, ticks=recorded,
        recent_tick_seconds=scheduler.tick_stats.durations(recorded - RECENT_TICKS, recorded),
        max_sessions=scheduler.cache.max_sessions, prefix_cache_queries=queries, prefix_cache_hits=hits)
