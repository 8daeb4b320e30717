"""Realtime engine benchmark: N concurrent transcription streams, paced at real time or as fast as possible.

Reports tick (step) time percentiles over the steady state (over the whole run, said so, when the streams
never all catch up), host work per tick (tick time not spent waiting on the device), token latency over
the whole run, output tokens per second, whether the streams keep up, and the memory-bound floor of a
step: (parameter bytes + KV bytes of the live sessions) / the device's measured copy bandwidth.

Token latency is measured by the engine for every generated id, control ids included: from the time the
audio slot the id was sampled at reached the engine to the time the id was read back on the host
(`Residency.token_latency`), over the whole run and over the steady state, which is what "keeps up" judges
(the whole run's also has every prompt at the start and the end-of-stream flush, padding slots queued at
once). A run without samples says so instead of reporting 0, and such a run never counts as keeping up.
"""
import asyncio
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream import allocator
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.residency import LatencyHistogram
from jaxstream.models.audio import SAMPLES_PER_SLOT, SLOT_SECONDS, n_delay_from_ms, prompt_length
from jaxstream.models.tokenizers import NUM_CONTROL_IDS, Tokenizer

TICK_BUDGET_MS = SLOT_SECONDS * 1e3  # a paced tick must fit one 80 ms slot
# A paced token is read back within a few ticks of its audio (waiting for the next tick, the tick itself,
# jitter); a stream that falls behind piles up a backlog and its latency grows without bound.
LATENCY_BUDGET_MS = 5 * SLOT_SECONDS * 1e3


class SyntheticTokenizer(Tokenizer):
    """Voxtral's id layout over a vocabulary of made-up pieces (for random-weight benchmarks)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.streaming_pad_id, self.streaming_word_id = 1, 2, 32, 33

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError("the synthetic tokenizer only decodes")

    def token_bytes(self, token_id: int) -> bytes:
        token_id = self._checked(token_id)
        return b"" if token_id < NUM_CONTROL_IDS else f" w{token_id}".encode()


def percentiles(values, qs) -> list[float | None]:
    """Percentiles of `values`, or None for each when there are no samples."""
    values = np.asarray(values, np.float64)
    return [float(np.percentile(values, q)) if values.size else None for q in qs]


def keeps_up(*, paced: bool, tick_ms_p99: float | None, latency_ms_p99: float | None, wall_seconds: float,
             audio_seconds: float) -> bool:
    """Paced: the p99 tick fits the 80 ms budget and the p99 token latency stays within `LATENCY_BUDGET_MS`.
    As fast as possible: every stream finished within its own duration (so no token waited longer). Both
    need real samples of ticks and of latency: a run that measured nothing does not keep up."""
    if tick_ms_p99 is None or latency_ms_p99 is None:
        return False
    if paced:
        return tick_ms_p99 <= TICK_BUDGET_MS and latency_ms_p99 <= LATENCY_BUDGET_MS
    return wall_seconds <= audio_seconds and latency_ms_p99 <= audio_seconds * 1e3


@dataclasses.dataclass
class SteadyStart:
    """Where a run's steady state starts, from what the event loop sees of its sessions: the ticks recorded
    once every stream is past its prompt and caught up with its audio. A paced stream that keeps up has at
    most the slot that arrived since its last dispatch queued. A slot counts as consumed once dispatched
    and a tick is recorded when collected, so the tick in flight when paced streams are first seen caught
    up carries the last of their catch-up (a 24-stream mid-size run: 8 queued slots a row, 210 ms): their
    steady state starts after that tick is recorded. Unpaced streams have no pace to catch up with: theirs
    starts once every prompt is computed."""

    paced: bool
    prompt_slots: int
    caught_up_at: int | None = None  # ticks recorded when every stream was first seen caught up
    tick: int | None = None  # ticks recorded when the steady state started

    def observe(self, consumed, queued, ticks_recorded: int) -> bool:
        """Records one look at the streams' audio counters (slots consumed and queued per stream); True
        exactly once, at the look where the steady state starts (`tick`)."""
        if self.tick is not None:
            return False
        caught_up = all(done >= self.prompt_slots and (not self.paced or waiting <= 1)
                        for done, waiting in zip(consumed, queued))
        if self.caught_up_at is None and caught_up:
            self.caught_up_at = ticks_recorded
        if self.caught_up_at is not None and (not self.paced or ticks_recorded > self.caught_up_at):
            self.tick = ticks_recorded
            return True
        return False


def _ms(value: float | None, digits: int = 2) -> str:
    return "no samples" if value is None else f"{value:.{digits}f}"


@dataclasses.dataclass
class BenchResult:
    streams: int
    paced: bool
    audio_seconds: float  # per stream
    wall_seconds: float
    ticks: int  # ticks measured: the steady state's, or the whole run's when it never got there
    rows_p50: float | None  # median sessions per tick
    tick_ms_p50: float | None  # None: no ticks
    tick_ms_p90: float | None
    tick_ms_p99: float | None
    step_ms_p50: float | None  # tick time per 80 ms step (a catch-up tick runs several)
    host_ms_mean: float | None
    host_ms_p50: float | None
    host_ms_p99: float | None
    host_cpu_ms_p50: float | None  # the engine thread's CPU per tick, its work between ticks included (robust to load)
    host_cpu_ms_p99: float | None
    # Of the engine thread's CPU per tick: inside the device's calls (dispatch, reading results; on CPU
    # partly the programs' own first operations), and the rest, the engine's own host work.
    device_call_cpu_ms_p50: float | None
    own_cpu_ms_p50: float | None
    latency_samples: int  # generated ids over the whole run
    latency_ms_p50: float | None  # None: no samples
    latency_ms_p99: float | None
    output_tokens_per_s: float
    realtime_factor: float  # audio seconds transcribed per wall second, all streams together
    keeps_up: bool
    floor_ms: float  # memory-bound floor of one step at this batch
    step_over_floor: float | None
    # Parked streams moved to host memory: the device held fewer streams at once than the run has.
    evictions: int = 0
    steady: bool = True  # False: the streams never all caught up; the tick figures are the whole run's
    # Token latency over the steady state alone (what "keeps up" judges): the whole run's also has the
    # start (every stream's prompt at once) and the end-of-stream flush (padding slots queued at once).
    steady_latency_ms_p50: float | None = None
    steady_latency_ms_p99: float | None = None
    # Host work per 80 ms of audio: the ticks' host time over the steps they ran. Per tick it grows with the
    # tick when the device falls behind (a longer tick carries more appends), so runs compare by this one.
    host_ms_per_step: float | None = None
    # The process's malloc (jaxstream/allocator.py): on CPU, glibc's makes steps 8-25 % slower than TCMalloc.
    allocator: str = dataclasses.field(default_factory=allocator.loaded_allocator)

    def lines(self) -> list[str]:
        mode = "paced at real time" if self.paced else "as fast as possible"
        rows = "no" if self.rows_p50 is None else f"median {self.rows_p50:g}"
        over = "" if self.step_over_floor is None else f"; p50 step / floor = {self.step_over_floor:.1f}"
        return [
            f"streams={self.streams} ({mode}, {self.audio_seconds:g} s audio each): wall {self.wall_seconds:.2f} s, "
            f"{self.ticks} {'steady ticks' if self.steady else 'ticks (never steady: the whole run)'}, {rows} "
            f"sessions per tick; memory allocator {self.allocator}",
            f"  tick ms p50/p90/p99: {_ms(self.tick_ms_p50)} / {_ms(self.tick_ms_p90)} / {_ms(self.tick_ms_p99)}; "
            f"per 80 ms step p50 {_ms(self.step_ms_p50)} ms",
            f"  host work per tick ms: mean {_ms(self.host_ms_mean)}, p50 {_ms(self.host_ms_p50)}, "
            f"p99 {_ms(self.host_ms_p99)}; engine-thread CPU (between ticks included) p50 {_ms(self.host_cpu_ms_p50)}, "
            f"p99 {_ms(self.host_cpu_ms_p99)}: inside the device's calls p50 {_ms(self.device_call_cpu_ms_p50)}, "
            f"the engine's own work p50 {_ms(self.own_cpu_ms_p50)}; host work per 80 ms step "
            f"{_ms(self.host_ms_per_step)}",
            f"  token latency ms (slot at the engine -> id on the host, {self.latency_samples} ids, whole run) "
            f"p50/p99: {_ms(self.latency_ms_p50, 1)} / {_ms(self.latency_ms_p99, 1)}; steady state p50/p99: "
            f"{_ms(self.steady_latency_ms_p50, 1)} / {_ms(self.steady_latency_ms_p99, 1)}",
            f"  output tokens/s {self.output_tokens_per_s:.0f}; audio x real time (all streams) "
            f"{self.realtime_factor:.1f}; {'keeps up with' if self.keeps_up else 'falls behind'} real time",
            f"  memory-bound floor at the median batch {self.floor_ms:.3f} ms/step{over}",
            *([f"  {self.evictions} evictions of streams to host memory: the device held fewer than "
               f"{self.streams} streams at once"] if self.evictions else []),
        ]


def measure_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Device memory bandwidth (bytes/s): the fastest of `repeats` read+write elementwise passes over a large
    array, updated in place after a first pass. Passes that each wrote a fresh array measured the allocator
    as much as the memory: on the 2-core CPU they gave 1.5-25 GB/s from run to run (floors of 7 to 81 ms for
    the same mid-size batch) where in-place passes give 39-41 GB/s."""
    x = jnp.zeros(num_bytes // 4, jnp.float32)
    double = jax.jit(lambda a: a * 2.0, donate_argnums=0)
    x = double(x).block_until_ready()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = double(x).block_until_ready()
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * num_bytes / fastest


def memory_floor_seconds(engine: AsyncEngine, kv_bytes: float, bandwidth: float) -> float:
    params = sum(leaf.nbytes for leaf in engine.core.programs.param_leaves)
    return (params + kv_bytes) / bandwidth


def _latency_ms(counts: np.ndarray) -> tuple[float | None, float | None]:
    """p50 and p99 in ms of a `LatencyHistogram`'s counts (None for each without samples)."""
    return tuple(None if v is None else v * 1e3 for v in (LatencyHistogram.percentile(counts, q) for q in (50, 99)))


def _live_kv_bytes(engine: AsyncEngine) -> int:
    """KV bytes the live sessions hold, from the engine's published metrics snapshot."""
    cache = engine.core.cache
    used = engine.metrics().pages_used
    return sum(used[name] * spec.bytes_per_page(cache.dtype) for name, spec in cache.specs.items())


async def run_streams(engine: AsyncEngine, *, streams: int, seconds: float, paced: bool, delay_ms=None,
                      seed: int = 0) -> BenchResult:
    """Runs `streams` concurrent transcriptions of `seconds` of synthetic audio each."""
    rng = np.random.default_rng(seed)
    slots = int(round(seconds / SLOT_SECONDS))
    audio = (rng.standard_normal((streams, slots * SAMPLES_PER_SLOT)) * 0.05).astype(np.float32)
    await engine.wait_until_idle()
    core = engine.core  # read after the run, or through counters the engine thread publishes
    # Steady state: from when every stream is past its prompt prefill and has caught up with the audio
    # that queued meanwhile, until the first stream ends its input (the end-of-stream flush is catch-up
    # work by design); the as-fast-as-possible mode counts everything after the prompts.
    window = {"start": None, "end": None}
    latency_at = {}  # the latency histogram's counts when the steady state starts and ends
    first_tick = core.ticks_recorded
    latency_before = core.token_latency.counts.copy()
    evictions_before = engine.metrics().evictions
    live_kv = [0]
    sessions = [await engine.start_transcription(delay_ms=delay_ms) for _ in range(streams)]
    prompt_slots = prompt_length(n_delay_from_ms(sessions[0].delay_ms), engine.model_config.n_left_pad_tokens)
    start = time.perf_counter()

    async def feed(index, session):
        consumer = asyncio.create_task(consume(session))
        if paced:
            offset = SLOT_SECONDS * index / streams  # spread the streams over one tick
            for slot in range(slots):
                await asyncio.sleep(max(0.0, start + offset + slot * SLOT_SECONDS - time.perf_counter()))
                await session.append(audio[index, slot * SAMPLES_PER_SLOT : (slot + 1) * SAMPLES_PER_SLOT])
            if window["end"] is None:
                window["end"] = core.ticks_recorded
                latency_at["end"] = core.token_latency.counts.copy()
        else:
            await session.append(audio[index])
        await session.finish()
        return await consumer

    async def consume(session):
        done = None
        async for event in session:
            if hasattr(event, "usage"):
                done = event
        return done

    async def watch():
        steady_start = SteadyStart(paced=paced, prompt_slots=prompt_slots)
        while True:
            # Once it has started, the streams' counters are not read again (every ms for an unpaced run).
            if window["start"] is None and steady_start.observe(
                    [s.backlog.consumed for s in sessions], [s.backlog.queued for s in sessions], core.ticks_recorded):
                window["start"] = steady_start.tick
                latency_at["start"] = core.token_latency.counts.copy()
            live_kv[0] = max(live_kv[0], _live_kv_bytes(engine))
            # Unpaced streams can go from their prompts to their end within a few ms (the tiny models):
            # watched every 20 ms, such a run had no steady state at all.
            await asyncio.sleep(SLOT_SECONDS / 4 if paced else 1e-3)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(feed(i, s) for i, s in enumerate(sessions)))
    finally:
        watcher.cancel()
    wall = time.perf_counter() - start
    await engine.wait_until_idle()  # and its metrics current
    end = window["end"] if window["end"] is not None else core.ticks_recorded
    steady = window["start"] is not None and end > window["start"]
    # A run that never caught up still reports its ticks: those of the whole run, said to be so.
    ticks = core.tick_stats.window(*((window["start"], end) if steady else (first_tick, core.ticks_recorded)))
    tick_ms = [t.total_s * 1e3 for t in ticks]
    steps = [max(1, t.steps / max(1, t.rows)) for t in ticks]  # 80 ms steps each tick ran
    step_ms = [t.total_s * 1e3 / n for t, n in zip(ticks, steps)]
    host_ms = [t.host_s * 1e3 for t in ticks]
    tick_p50, tick_p90, tick_p99 = percentiles(tick_ms, (50, 90, 99))
    [step_p50] = percentiles(step_ms, (50,))
    host_p50, host_p99 = percentiles(host_ms, (50, 99))
    cpu_p50, cpu_p99 = percentiles([t.host_cpu_s * 1e3 for t in ticks if t.host_cpu_s is not None], (50, 99))
    split = [t for t in ticks if t.host_cpu_s is not None and t.device_call_cpu_s is not None]
    [calls_p50] = percentiles([t.device_call_cpu_s * 1e3 for t in split], (50,))
    [own_p50] = percentiles([(t.host_cpu_s - t.device_call_cpu_s) * 1e3 for t in split], (50,))
    latency = core.token_latency.counts - latency_before
    latency_p50, latency_p99 = _latency_ms(latency)
    steady_p50 = steady_p99 = None
    if steady:
        steady_p50, steady_p99 = _latency_ms(latency_at.get("end", core.token_latency.counts) - latency_at["start"])
    tokens = sum(len(done.token_ids) for done in results if done is not None)
    rows = float(np.median([t.rows for t in ticks])) if ticks else None
    # The floor of a tick with the median batch: every weight once, plus each row's live KV once.
    floor = memory_floor_seconds(engine, live_kv[0] / streams * (rows or 0), measure_bandwidth()) * 1e3
    return BenchResult(
        streams=streams, paced=paced, audio_seconds=seconds, wall_seconds=wall, ticks=len(ticks), rows_p50=rows,
        tick_ms_p50=tick_p50, tick_ms_p90=tick_p90, tick_ms_p99=tick_p99, step_ms_p50=step_p50,
        host_ms_mean=float(np.mean(host_ms)) if host_ms else None, host_ms_p50=host_p50, host_ms_p99=host_p99,
        host_cpu_ms_p50=cpu_p50, host_cpu_ms_p99=cpu_p99, device_call_cpu_ms_p50=calls_p50, own_cpu_ms_p50=own_p50,
        host_ms_per_step=sum(host_ms) / sum(steps) if ticks else None,
        latency_samples=int(latency.sum()), latency_ms_p50=latency_p50,
        latency_ms_p99=latency_p99, steady_latency_ms_p50=steady_p50, steady_latency_ms_p99=steady_p99,
        output_tokens_per_s=tokens / wall, realtime_factor=streams * seconds / wall,
        keeps_up=steady and keeps_up(paced=paced, tick_ms_p99=tick_p99, latency_ms_p99=steady_p99,
                                     wall_seconds=wall, audio_seconds=seconds),
        steady=steady,
        floor_ms=floor, step_over_floor=None if step_p50 is None else step_p50 / floor,
        evictions=engine.metrics().evictions - evictions_before)
