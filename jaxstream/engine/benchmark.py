"""Realtime engine benchmark: N concurrent transcription streams, paced at real time or as fast as possible.

Reports tick (step) time percentiles, whether the streams keep up with real time (p99 tick <= 80 ms and a
bounded backlog), output tokens per second, host overhead per tick (tick time not spent waiting on the
device), and the memory-bound floor of a step: (parameter bytes + KV bytes of the live sessions) / the
device's measured copy bandwidth.
"""
import asyncio
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.models.audio import SAMPLES_PER_SLOT, SLOT_SECONDS
from jaxstream.models.tokenizers import NUM_CONTROL_IDS, Tokenizer


class SyntheticTokenizer(Tokenizer):
    """Voxtral's id layout over a vocabulary of made-up pieces (for random-weight benchmarks)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.streaming_pad_id, self.streaming_word_id = 1, 2, 32, 33

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("the synthetic tokenizer only decodes")

    def token_bytes(self, token_id: int) -> bytes:
        token_id = self._checked(token_id)
        return b"" if token_id < NUM_CONTROL_IDS else f" w{token_id}".encode()


@dataclasses.dataclass
class BenchResult:
    streams: int
    paced: bool
    audio_seconds: float  # per stream
    wall_seconds: float
    ticks: int  # steady-state ticks measured
    rows_p50: float  # median sessions per tick
    tick_ms_p50: float
    tick_ms_p90: float
    tick_ms_p99: float
    step_ms_p50: float  # tick time per 80 ms step (a catch-up tick runs several)
    host_ms_mean: float
    host_ms_p50: float
    latency_ms_p50: float  # paced: from appending the audio a token needs to receiving the token
    latency_ms_p99: float
    output_tokens_per_s: float
    realtime_factor: float  # audio seconds transcribed per wall second, all streams together
    keeps_up: bool
    floor_ms: float  # memory-bound floor of one step at this batch
    step_over_floor: float

    def lines(self) -> list[str]:
        mode = "paced at real time" if self.paced else "as fast as possible"
        return [
            f"streams={self.streams} ({mode}, {self.audio_seconds:g} s audio each): wall {self.wall_seconds:.2f} s, "
            f"{self.ticks} steady ticks, median {self.rows_p50:g} sessions per tick",
            f"  tick ms p50/p90/p99: {self.tick_ms_p50:.2f} / {self.tick_ms_p90:.2f} / {self.tick_ms_p99:.2f}; "
            f"per 80 ms step p50 {self.step_ms_p50:.2f} ms",
            f"  host overhead per tick: mean {self.host_ms_mean:.2f} ms, p50 {self.host_ms_p50:.2f} ms",
            f"  output tokens/s {self.output_tokens_per_s:.0f}; audio x real time (all streams) "
            f"{self.realtime_factor:.1f}; token latency p50/p99 {self.latency_ms_p50:.0f} / "
            f"{self.latency_ms_p99:.0f} ms; {'keeps up with' if self.keeps_up else 'falls behind'} real time",
            f"  memory-bound floor at the median batch {self.floor_ms:.3f} ms/step; "
            f"p50 step / floor = {self.step_over_floor:.1f}",
        ]


def measure_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Device memory bandwidth (bytes/s) of a read+write elementwise pass over a large array."""
    x = jnp.zeros(num_bytes // 4, jnp.float32)
    double = jax.jit(lambda a: a * 2.0)
    double(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        x = double(x)
    x.block_until_ready()
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def memory_floor_seconds(engine: AsyncEngine, kv_bytes: float, bandwidth: float) -> float:
    params = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(engine.core.programs.params))
    return (params + kv_bytes) / bandwidth


def _live_kv_bytes(engine: AsyncEngine) -> int:
    cache = engine.core.cache
    return sum((spec.num_pages - 1 - cache.pools[name].num_free) * spec.bytes_per_page(cache.dtype)
               for name, spec in cache.specs.items())


async def run_streams(engine: AsyncEngine, *, streams: int, seconds: float, paced: bool, delay_ms=None,
                      seed: int = 0) -> BenchResult:
    """Runs `streams` concurrent transcriptions of `seconds` of synthetic audio each."""
    rng = np.random.default_rng(seed)
    slots = int(round(seconds / SLOT_SECONDS))
    audio = (rng.standard_normal((streams, slots * SAMPLES_PER_SLOT)) * 0.05).astype(np.float32)
    await engine.wait_until_idle()
    stats = engine.core.tick_stats
    # Steady state: from when every stream is past its prompt prefill and has caught up with the audio
    # that queued meanwhile, until the first stream ends its input (the end-of-stream flush is catch-up
    # work by design); the as-fast-as-possible mode counts everything after the prompts.
    window = {"start": None, "end": None, "first": len(stats)}
    live_kv = [0]
    latencies = []  # paced: seconds from appending the audio a token needs to receiving the token
    sessions = [await engine.start_transcription(delay_ms=delay_ms) for _ in range(streams)]
    start = time.perf_counter()

    async def feed(index, session):
        appended = []
        consumer = asyncio.create_task(consume(session, appended))
        if paced:
            offset = SLOT_SECONDS * index / streams  # spread the streams over one tick
            for slot in range(slots):
                await asyncio.sleep(max(0.0, start + offset + slot * SLOT_SECONDS - time.perf_counter()))
                await session.append(audio[index, slot * SAMPLES_PER_SLOT : (slot + 1) * SAMPLES_PER_SLOT])
                appended.append(time.perf_counter())
            if window["end"] is None:
                window["end"] = len(stats)
        else:
            await session.append(audio[index])
        await session.finish()
        return await consumer

    async def consume(session, appended):
        # Token i (0-based) is the first that needs real audio slot n_delay + 1 + i (its 2.5 ms look-ahead).
        n_delay, count, done = session.delay_ms // 80, 0, None
        async for event in session:
            if hasattr(event, "usage"):
                done = event
                continue
            count += len(event.token_ids)
            needed = n_delay + count  # the slot the newest token needed (n_delay + 1 + (count - 1))
            if paced and window["start"] is not None and window["end"] is None and needed < len(appended):
                latencies.append(time.perf_counter() - appended[needed])
        return done

    async def watch():
        while True:
            live = list(engine.core.sessions.values())
            caught_up = all(s.fed >= s.prompt_len and (not paced or len(s.mel) <= 2) for s in live)
            if window["start"] is None and len(live) == streams and caught_up:
                window["start"] = len(stats)
            live_kv[0] = max(live_kv[0], _live_kv_bytes(engine))
            await asyncio.sleep(SLOT_SECONDS / 4)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(feed(i, s) for i, s in enumerate(sessions)))
    finally:
        watcher.cancel()
    wall = time.perf_counter() - start
    ticks = list(stats)[window["start"] or window["first"] : window["end"]]
    if not ticks:
        raise RuntimeError("no steady-state ticks: run longer streams (--seconds)")
    tick_ms = np.array([t.total_s for t in ticks]) * 1e3
    step_ms = np.array([t.total_s / max(1, t.steps / max(1, t.rows)) for t in ticks]) * 1e3
    host_ms = np.array([t.host_s for t in ticks]) * 1e3
    tokens = sum(len(done.token_ids) for done in results)
    rows = float(np.median([t.rows for t in ticks]))
    # The floor of a tick with the median batch: every weight once, plus each row's live KV once.
    floor = memory_floor_seconds(engine, live_kv[0] / streams * rows, measure_bandwidth()) * 1e3
    p99 = float(np.percentile(tick_ms, 99))
    latency_p50, latency_p99 = (float(np.percentile(latencies, q)) * 1e3 for q in (50, 99)) if latencies else (0, 0)
    return BenchResult(
        streams=streams, paced=paced, audio_seconds=seconds, wall_seconds=wall, ticks=len(ticks), rows_p50=rows,
        tick_ms_p50=float(np.percentile(tick_ms, 50)), tick_ms_p90=float(np.percentile(tick_ms, 90)),
        tick_ms_p99=p99, step_ms_p50=float(np.percentile(step_ms, 50)), host_ms_mean=float(host_ms.mean()),
        host_ms_p50=float(np.percentile(host_ms, 50)), latency_ms_p50=latency_p50, latency_ms_p99=latency_p99,
        output_tokens_per_s=tokens / wall, realtime_factor=streams * seconds / wall,
        # Paced: every tick fits the 80 ms budget and tokens arrive within a few ticks of their audio (no
        # stream piles up a backlog); as fast as possible: every stream finished within its duration.
        keeps_up=(p99 <= SLOT_SECONDS * 1e3 and latency_p99 <= 5 * SLOT_SECONDS * 1e3) if paced else wall <= seconds,
        floor_ms=floor, step_over_floor=float(np.percentile(step_ms, 50)) / floor)
