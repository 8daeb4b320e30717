"""Transcription streams with an audio limit (`start_transcription(max_audio_seconds=...)`): under window
admission (`EngineConfig(realtime_admission="window")`) admission commits each stream the pages of its whole
length instead of its whole windows, so more streams share the pools at once; the limit is enforced (an append
past it is refused whole) and the transcripts are the same.
"""
import asyncio
import math

import numpy as np
import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.errors import InvalidRequestError
from jaxstream.models import loading
from jaxstream.models.audio import load_audio, n_delay_from_ms, right_pad_samples, left_pad_samples, stream_slot_bound

from engine_fixtures import long_window_tiny_voxtral

SAMPLE = load_audio(loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav")[:24_000]
LIMIT_S = 1.5
STREAMS = 3
PAGE, ENCODER_PAGE = 16, 32

pytestmark = pytest.mark.usefixtures("engine_returns_to_baseline")


@pytest.fixture(scope="module")
def engine():
    """The random tiny Voxtral fixture's weights with windows much longer than the streams (encoder 512
    frames, decoder 256 slots), and pools that hold one stream's full windows but not two: a stream of
    LIMIT_S seconds needs 5 of the 16 decoder pages of a window and 9 of the 16 encoder pages."""
    model, tokenizer = long_window_tiny_voxtral(encoder_window=512, decoder_window=256)
    # Usable pages: 24 and 30, one full window (16) each, not two.
    config = EngineConfig(max_sessions=STREAMS, page_size=PAGE, encoder_page_size=ENCODER_PAGE,
                          num_pages=1 + 24, encoder_num_pages=1 + 30, batch_buckets=(STREAMS,),
                          realtime_step_buckets=(1, 4), realtime_prefill_buckets=((STREAMS, 32),),
                          realtime_admission="window")
    engine = AsyncEngine(model, config=config, tokenizer=tokenizer)
    yield engine
    engine.close()


def test_the_slot_bound_holds_the_stream():
    n_delay = n_delay_from_ms(480)
    for seconds in (0.01, 1.0, 1.5, 3.53, 60.0):
        samples = math.floor(seconds * 16000)
        slots = (left_pad_samples() + samples + right_pad_samples(samples, n_delay)) // 1280
        assert slots <= stream_slot_bound(seconds, n_delay) <= slots + 2


async def test_limited_streams_share_pools_that_hold_one_full_window(engine):
    """Each stream appends its first half, waits for the engine to compute it, then the rest: without a
    limit only one stream holds the pools at a time and the others take turns through host memory
    (evictions); with one, all three are resident together. The tokens are the same either way."""
    capacity = {name: pool.capacity for name, pool in engine.core.cache.pools.items()}
    windows = {name: spec.pages_per_window for name, spec in engine.core.cache.specs.items()}
    assert all(windows[name] <= capacity[name] < 2 * windows[name] for name in capacity)
    expected = (await engine.transcribe(SAMPLE)).token_ids
    half = SAMPLE.size // 2
    evictions = {}
    for limit in (None, LIMIT_S):
        await engine.wait_until_idle()
        before = engine.metrics().evictions
        sessions = [await engine.start_transcription(max_audio_seconds=limit) for _ in range(STREAMS)]
        for session in sessions:
            await session.append(SAMPLE[:half])
        first = [session.backlog.sent for session in sessions]
        async with asyncio.timeout(120):
            while any(s.backlog.consumed < sent for s, sent in zip(sessions, first)):
                await asyncio.sleep(0.05)

        async def rest(session):
            await session.append(SAMPLE[half:])
            await session.finish()
            return [event async for event in session][-1]

        done = await asyncio.wait_for(asyncio.gather(*(rest(s) for s in sessions)), timeout=120)
        assert [d.token_ids for d in done] == [expected] * STREAMS
        await engine.wait_until_idle()
        evictions[limit] = engine.metrics().evictions - before
    assert evictions[None] > 0 and evictions[LIMIT_S] == 0


async def test_an_append_past_the_limit_is_refused_whole_and_the_stream_goes_on(engine):
    expected = (await engine.transcribe(SAMPLE[:16000])).token_ids
    session = await engine.start_transcription(max_audio_seconds=1.0)
    await session.append(SAMPLE[:12000])
    with pytest.raises(InvalidRequestError, match="limit of 1 s"):
        await session.append(SAMPLE[12000:20000])
    await session.append(SAMPLE[12000:16000])
    await session.finish()
    assert [event async for event in session][-1].token_ids == expected


async def test_audio_past_the_committed_slots_ends_the_stream_with_an_error(engine):
    """The engine thread's own check, for a caller that went around the session's (here by clearing it):
    pages past the commitment were never reserved, so the stream ends instead of taking them."""
    session = await engine.start_transcription(max_audio_seconds=0.5)
    session.max_audio_seconds = None
    await session.append(np.zeros(48000, np.float32))
    with pytest.raises(InvalidRequestError, match="more audio than its limit"):
        async for _ in session:
            pass


@pytest.mark.parametrize("limit", [0, -1.0, math.nan, math.inf, True, "3"])
async def test_a_bad_limit_is_a_clear_error(engine, limit):
    with pytest.raises(InvalidRequestError, match="max_audio_seconds"):
        await engine.start_transcription(max_audio_seconds=limit)
