"""Demand admission (`EngineConfig(realtime_admission="demand")`, engine/realtime_admission.py): streams
without an audio limit take pages as they grow instead of a whole window each, so as many run at once as
their lengths fit; when they outgrow the pools, newer streams move to host memory for older ones and come
back with the same tokens, and the oldest stream is never the one that moves.
"""
import asyncio
import itertools
import logging
import time

import numpy as np
import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.errors import CapacityError, SessionClosedError
from jaxstream.models import loading
from jaxstream.models.audio import load_audio

from engine_fixtures import long_window_tiny_voxtral

SAMPLE = load_audio(loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav")
STREAMS = 3
PAGE, ENCODER_PAGE = 16, 32

pytestmark = pytest.mark.usefixtures("engine_returns_to_baseline")


def _build(**config) -> AsyncEngine:
    """The random tiny Voxtral fixture's weights with windows much longer than the streams (encoder 512
    frames, decoder 256 slots) and pools that hold one stream's full windows but not two (usable pages 24
    and 30, a window is 16 of each): under window admission one stream would run at a time."""
    model, tokenizer = long_window_tiny_voxtral(encoder_window=512, decoder_window=256)
    config = {"max_sessions": STREAMS, "batch_buckets": (STREAMS,), "realtime_prefill_buckets": ((STREAMS, 32),),
              "num_pages": 1 + 24, "encoder_num_pages": 1 + 30, **config}
    config = EngineConfig(page_size=PAGE, encoder_page_size=ENCODER_PAGE, realtime_step_buckets=(1, 4),
                          realtime_admission="demand", **config)
    return AsyncEngine(model, config=config, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def engine():
    engine = _build()
    yield engine
    engine.close()


async def _run_together(engine, audio, chunks: int, *, wait: bool) -> list:
    """STREAMS streams started in order, each fed `audio` in `chunks` parts interleaved with the others
    (with `wait`, every part waits for the engine to compute the previous one), then finished; their final
    outputs."""
    sessions = [await engine.start_transcription(session_id=f"stream{i}") for i in range(STREAMS)]
    bounds = [len(audio) * k // chunks for k in range(chunks + 1)]
    for begin, end in zip(bounds, bounds[1:]):
        for session in sessions:
            await session.append(audio[begin:end])
        sent = [session.backlog.sent for session in sessions]
        async with asyncio.timeout(120):
            while wait and any(s.backlog.consumed < n for s, n in zip(sessions, sent)):
                await asyncio.sleep(0.02)

    async def finish(session):
        await session.finish()
        return [event async for event in session][-1]

    return await asyncio.wait_for(asyncio.gather(*(finish(s) for s in sessions), return_exceptions=True), timeout=120)


async def test_streams_share_pools_that_hold_one_full_window(engine):
    """Three 1.5 s streams (5 of a window's 16 decoder pages and 9 of its 16 encoder pages each) run at once,
    with no evictions and the tokens of a stream run alone. (Under window admission the same three hold the
    pools one at a time: test_engine_stream_limits.py.)"""
    audio = SAMPLE[:24_000]
    capacity = {name: pool.capacity for name, pool in engine.core.cache.pools.items()}
    windows = {name: spec.pages_per_window for name, spec in engine.core.cache.specs.items()}
    assert all(windows[name] <= capacity[name] < 2 * windows[name] for name in capacity)
    expected = (await engine.transcribe(audio)).token_ids
    before = engine.metrics().evictions
    done = await _run_together(engine, audio, chunks=2, wait=True)
    assert [d.token_ids for d in done] == [expected] * STREAMS
    await engine.wait_until_idle()
    assert engine.metrics().evictions == before


async def test_pools_planned_for_the_streams_length_hold_them_all_at_once(monkeypatch):
    """Default-sized pools on a device whose memory holds three 4.4 s streams' pages (and a whole window of each
    pool) but not three streams' whole windows. Planned for 4.4 s streams (`planned_stream_seconds`), the pools
    hold all three at once: none moves to host memory, and each has the tokens of a stream run alone. Scaled
    alike (planned for whole windows), the same memory holds two."""
    from jaxstream.engine import builders, sharding
    from jaxstream.models.audio import SAMPLING_RATE

    seconds = len(SAMPLE) / SAMPLING_RATE
    model, _ = long_window_tiny_voxtral(encoder_window=512, decoder_window=256)
    config = EngineConfig(max_sessions=STREAMS, page_size=PAGE, encoder_page_size=ENCODER_PAGE,
                          planned_stream_seconds=seconds)
    specs = builders.realtime_stack_specs(model.cfg, config)
    planned = builders.planned_stream_pages(model.cfg, config)
    dtype = builders.engine_dtype(config)
    needed = sum(max(STREAMS * planned[spec.name], spec.pages_per_window) * spec.bytes_per_page(dtype)
                 for spec in specs)
    monkeypatch.setattr(builders, "_free_device_bytes", lambda placement: needed / config.kv_memory_fraction)

    def streams(pools):
        return min((spec.num_pages - 1) // planned[spec.name] for spec in pools)

    alike = builders.fit_pools(specs, EngineConfig(max_sessions=STREAMS, page_size=PAGE, encoder_page_size=ENCODER_PAGE,
                                                   planned_stream_seconds=None), sharding.Placement(None, "tp"))
    assert streams(alike) == STREAMS - 1
    engine = _build(num_pages=None, encoder_num_pages=None, planned_stream_seconds=seconds)
    try:
        assert streams(engine.core.cache.specs.values()) == STREAMS
        expected = (await engine.transcribe(SAMPLE)).token_ids
        before = engine.metrics().evictions
        done = await _run_together(engine, SAMPLE, chunks=3, wait=False)
        assert [d.token_ids for d in done] == [expected] * STREAMS
        await engine.wait_until_idle()
        assert engine.metrics().evictions == before
    finally:
        engine.close()


async def test_streams_that_outgrow_the_pools_take_turns_newest_first(engine, caplog):
    """Three 4.4 s streams need ~12 encoder pages each (36 > 30), all their audio queued at once: as they
    grow, newer streams move to host memory so the older ones can go on, and come back bit for bit: every
    stream ends with the tokens of a stream run alone, and the first one never moves. (A stream parked with
    no audio for a second may move for anyone: here none waits for audio.)"""
    expected = (await engine.transcribe(SAMPLE)).token_ids
    before = engine.metrics().evictions
    with caplog.at_level(logging.INFO, logger="jaxstream.engine.residency"):
        done = await _run_together(engine, SAMPLE, chunks=3, wait=False)
    assert [d.token_ids for d in done] == [expected] * STREAMS
    await engine.wait_until_idle()
    assert engine.metrics().evictions > before
    evicted = [r.getMessage().split(" session ")[1].split()[0] for r in caplog.records
               if r.getMessage().startswith("evicted ")]
    assert evicted and "stream0" not in evicted, evicted


async def test_with_host_memory_full_the_newest_starved_stream_ends_and_the_others_finish():
    """No host memory to move streams to (`host_offload_bytes=0`): when the three 4.4 s streams outgrow
    the pools, no stream can give way, so the newest one ends with `CapacityError` instead of all three
    waiting forever; the two older ones finish with the tokens of a stream run alone."""
    engine = _build(host_offload_bytes=0)
    try:
        expected = (await engine.transcribe(SAMPLE)).token_ids
        done = await _run_together(engine, SAMPLE, chunks=3, wait=False)
        assert [d.token_ids for d in done[:2]] == [expected] * 2
        assert isinstance(done[2], CapacityError) and "host memory" in str(done[2]), done[2]
        await engine.wait_until_idle()
        assert engine.core.at_baseline()
    finally:
        engine.close()


async def test_with_host_memory_full_a_newer_stream_between_chunks_gives_way_to_the_oldest():
    """The oldest stream grows when the pools are full and the two newer ones hold their pages between chunks
    (no audio queued, so they ask for nothing): the newest ends with `CapacityError` (it used to be the
    oldest, the one stream asking for a page), the oldest finishes with the tokens of a stream run alone,
    and so does the middle one. Encoder pages in use: the first 6 (1 s), the others 10 each (3.5 s), of 30;
    the first needs 11 by its end."""
    engine = _build(host_offload_bytes=0)

    async def computed(session):
        async with asyncio.timeout(60):
            while session.backlog.consumed < session.backlog.sent:
                await asyncio.sleep(0.02)

    async def result(session):
        await session.finish()
        return [event async for event in session][-1]

    try:
        expected = (await engine.transcribe(SAMPLE)).token_ids
        sessions = [await engine.start_transcription(session_id=f"stream{i}") for i in range(STREAMS)]
        await sessions[0].append(SAMPLE[:16_000])
        await computed(sessions[0])
        for session in sessions[1:]:
            await session.append(SAMPLE[:56_000])
            await computed(session)
        await sessions[0].append(SAMPLE[16_000:])
        assert (await asyncio.wait_for(result(sessions[0]), timeout=60)).token_ids == expected
        with pytest.raises(CapacityError, match="host memory"):
            [event async for event in sessions[2]]
        await sessions[1].append(SAMPLE[56_000:])
        assert (await asyncio.wait_for(result(sessions[1]), timeout=60)).token_ids == expected
        await engine.wait_until_idle()
        assert engine.core.at_baseline()
    finally:
        engine.close()


async def test_an_older_stream_in_host_memory_comes_back_when_a_newer_one_holds_the_pages():
    """A pauses long enough to be moved to host memory for B, whose growth then fills the pools; host memory
    has no room for B. When A speaks again it cannot come back, and B, wrapping on its own pages, never asks
    for one: A used to wait as long as B streamed (6 s here, for good with a longer B). Now B ends with
    `CapacityError` after `STARVED_SECONDS`, and A finishes with the tokens of a stream run alone."""
    model, tokenizer = long_window_tiny_voxtral(encoder_window=128, decoder_window=64)
    engine = AsyncEngine(model, tokenizer=tokenizer, config=EngineConfig(
        max_sessions=2, batch_buckets=(2,), realtime_prefill_buckets=((2, 32),), page_size=16, encoder_page_size=32,
        num_pages=1 + 4, encoder_num_pages=1 + 4, realtime_step_buckets=(1, 4), realtime_admission="demand",
        host_offload_bytes=150_000, cache_silent_prefix=False))

    async def computed(session):
        async with asyncio.timeout(60):
            while session.backlog.consumed < session.backlog.sent:
                await asyncio.sleep(0.02)

    try:
        expected = (await engine.transcribe(SAMPLE[:24_000])).token_ids
        a = await engine.start_transcription(session_id="A")
        await a.append(SAMPLE[:16_000])
        await computed(a)
        await asyncio.sleep(1.3)  # idle: any stream may move it
        b = await engine.start_transcription(session_id="B")
        await b.append(SAMPLE[:32_000])
        await computed(b)
        assert engine.core.sessions["A"].offloaded is not None
        await a.append(SAMPLE[16_000:24_000])
        async with asyncio.timeout(60):
            for begin in itertools.cycle(range(32_000, 60_000, 1280)):  # B streams at real time until it ends
                try:
                    await b.append(SAMPLE[begin:begin + 1280])
                except SessionClosedError:
                    break
                await asyncio.sleep(0.08)
        with pytest.raises(CapacityError, match="host memory"):
            [event async for event in b]
        await a.finish()
        assert [event async for event in a][-1].token_ids == expected
        await engine.wait_until_idle()
        assert engine.core.at_baseline()
    finally:
        engine.close()


async def test_an_older_stream_prefilling_in_pieces_displaces_a_newer_decoding_one():
    """A (2.4 s delay: its prompt is prefilled in pieces of 8 slots) starts first; B (480 ms) is decoding when
    the encoder pool runs out mid-prompt. A tick places its decoding streams, then its prefilling ones: B found
    no page and could not displace the older A, and A then waited "behind" the starved B without trying, though
    it may move B to host memory. Neither ever advanced (found by a scheduler fuzz). Both now finish with the
    tokens of their audio run alone."""
    model, tokenizer = long_window_tiny_voxtral(encoder_window=512, decoder_window=256)
    engine = AsyncEngine(model, tokenizer=tokenizer, config=EngineConfig(
        max_sessions=2, batch_buckets=(2,), realtime_step_buckets=(1,), realtime_prefill_buckets=((2, 8),),
        page_size=16, encoder_page_size=32, encoder_num_pages=1 + 16, num_pages=1 + 40, realtime_admission="demand"))
    audio = np.concatenate([SAMPLE, SAMPLE])
    try:
        solo = {delay: (await engine.transcribe(audio[:length], delay_ms=delay)).token_ids
                for delay, length in ((2400, 48_000), (480, 80_000))}
        a = await engine.start_transcription(2400, session_id="A")
        b = await engine.start_transcription(480, session_id="B")
        await b.append(audio[:48_000])
        await engine.wait_until_idle()
        await b.append(audio[48_000:80_000])  # B goes on talking as A's long prompt fills
        await a.append(audio[:48_000])
        await a.finish()
        await b.finish()

        async def last(session):
            return [event async for event in session][-1].token_ids

        ends = await asyncio.wait_for(asyncio.gather(last(a), last(b)), timeout=120)
        assert ends == [solo[2400], solo[480]]
        await engine.wait_until_idle()
        assert engine.core.at_baseline()
    finally:
        engine.close()


@pytest.mark.parametrize("seed", [0, 1])
async def test_random_clients_in_short_pools_get_solo_tokens_and_leave_nothing_behind(seed):
    """Six streams in pools of one window (16 pages each; a 4.4 s stream needs 12 encoder pages): random
    lengths, chunk sizes and pauses (some over a second, so parked streams go idle), two of them aborted
    halfway. Every stream that finishes has the tokens of its audio run alone, whatever moved to host memory
    and back meanwhile, and the engine ends with no session, page, slot or host copy left."""
    rng = np.random.default_rng(seed)
    engine = _build(max_sessions=6, batch_buckets=(2, 6), realtime_prefill_buckets=((6, 32),), num_pages=1 + 16,
                    encoder_num_pages=1 + 16)
    try:
        lengths = rng.integers(8_000, len(SAMPLE), 6)
        solo = {int(n): (await engine.transcribe(SAMPLE[:n])).token_ids for n in lengths}
        aborted = set(rng.choice(6, 2, replace=False).tolist())

        async def client(i: int, start_delay: float):
            await asyncio.sleep(start_delay)
            session = await engine.start_transcription(session_id=f"client{i}")
            audio, sent = SAMPLE[: lengths[i]], 0
            while sent < len(audio):
                step = int(rng.integers(640, 8_000))
                await session.append(audio[sent: sent + step])
                sent += step
                if i in aborted and sent > len(audio) // 2:
                    await session.abort()
                    return None
                await asyncio.sleep(float(rng.choice([0.0, 0.02, 0.1, 1.2], p=[0.4, 0.3, 0.2, 0.1])))
            await session.finish()
            return [event async for event in session][-1]

        done = await asyncio.wait_for(asyncio.gather(*(client(i, 0.3 * i) for i in range(6))), timeout=240)
        for i, result in enumerate(done):
            if i in aborted:
                assert result is None
            else:
                assert result.token_ids == solo[int(lengths[i])], i
        await engine.wait_until_idle()
        assert engine.core.at_baseline()
    finally:
        engine.close()



def test_a_tick_that_holds_its_decoding_streams_back_ends_no_stream_for_starvation(monkeypatch):
    """Host memory full (0 bytes): B (2.4 s delay) arrives after A and before C (480 ms, both decoding) and finds
    no page for its long prompt's next piece; it may displace C, but host memory refuses C. A tick that holds its
    decoding streams back to batch them with paced ones (`_hold`, here forced on two ticks in a row) dispatches
    nothing, yet they advance a moment later: such a tick used to read as "no stream can advance" and end C at
    once. C now ends only on the starvation rule's own terms, after the held ticks."""
    from jaxstream.engine.builders import build_realtime_core
    from jaxstream.engine.transcription_session import AudioBacklog, transcription_prompt
    from jaxstream.models.audio import n_delay_from_ms

    model, tokenizer = long_window_tiny_voxtral(encoder_window=256, decoder_window=128)
    core = build_realtime_core(model, EngineConfig(
        max_sessions=3, batch_buckets=(3,), realtime_step_buckets=(1,), realtime_prefill_buckets=((3, 8),),
        page_size=16, encoder_page_size=32, encoder_num_pages=1 + 18, num_pages=1 + 16, realtime_admission="demand",
        host_offload_bytes=0), tokenizer)
    cfg, rng = model.cfg, np.random.default_rng(0)
    delays = {"A": 480, "B": 2400, "C": 480}
    prompts = {name: transcription_prompt(cfg, n_delay_from_ms(delay)) for name, delay in delays.items()}
    events = {name: [] for name in delays}

    def add(name, slots):
        core.add_audio(name, rng.standard_normal((slots, cfg.mel_frames_per_token, cfg.encoder.num_mel_bins),
                                                 dtype=np.float32), 0.0)

    for name, delay in delays.items():
        core.add_session(name, n_delay=n_delay_from_ms(delay), prompt_ids=prompts[name], sink=events[name].append,
                         backlog=AudioBacklog())
    add("A", len(prompts["A"]))
    add("C", len(prompts["C"]))
    while core.has_work():
        core.step()
    add("B", len(prompts["B"]))
    unheld, held_ticks = core._hold, []

    def hold_twice(decode, ready, resident):
        if core._starved_since is not None and len(held_ticks) < 2:  # B starved on an earlier tick
            held_ticks.append(core.tick)
            core.held_until = time.perf_counter() + 0.01
            return True
        return unheld(decode, ready, resident)

    monkeypatch.setattr(core, "_hold", hold_twice)
    ended = {}
    for tick in range(60):  # A and C stream at real time: a slot every other tick
        if tick % 2 == 0:
            add("A", 1)
            add("C", 1)
        core.step()
        ended.update({name: core.tick for name, items in events.items()
                      if name not in ended and items and isinstance(items[-1], BaseException)})
    assert held_ticks == [held_ticks[0], held_ticks[0] + 1], held_ticks
    assert list(ended) == ["C"] and isinstance(events["C"][-1], CapacityError), events
    assert ended["C"] > held_ticks[-1], (ended, held_ticks)
    assert core.sessions["B"].fed == len(prompts["B"])  # its prompt is in: it got C's pages
    for name in ("A", "B"):
        core.abort(name)
    while core.has_work():
        core.step()
    assert core.at_baseline()
