"""Audio appends applied in batches (`RealtimeScheduler.add_audio_many`, which the engine thread calls with
every append queued since its last tick): any interleaving of sessions, several appends of one session in
one batch, an end of input mid-batch and an append refused mid-batch give each stream exactly
transformers' greedy `generate` tokens, and free everything."""
import asyncio
import time
import types
from pathlib import Path

import numpy as np
import pytest

from jaxstream.engine import async_engine, stream_rows, transcription_scheduler
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.builders import build_realtime_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.residency import TickStats
from jaxstream.engine.transcription_session import (PROGRESS, AudioBacklog, GeneratedIds, TranscriptionDelta,
                                                    TranscriptionDone, transcript_sink, transcription_prompt)
from jaxstream.errors import EngineError, InvalidRequestError
from jaxstream.models import loading
from jaxstream.models.audio import load_audio, n_delay_from_ms, offline_features, prompt_length
from jaxstream.models.tokenizers import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
N_DELAY = n_delay_from_ms(480)
SMALL = dict(max_sessions=4, page_size=4, encoder_page_size=4, batch_buckets=(4,), realtime_step_buckets=(1, 4),
             realtime_prefill_buckets=((4, 40),))


def build_core(**config):
    loaded = loading.load_model(FIXTURES / "voxtral_tiny", dtype="float32")
    return build_realtime_core(loaded.model, EngineConfig(**SMALL, **config),
                               load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json"))


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))


@pytest.fixture(scope="module")
def core():
    return build_core()


def mel_slots(reference):
    """transformers' log-mel of the fixture audio at 480 ms, as 80 ms slots [slots, 8, 128]."""
    features = reference[f"features_d{N_DELAY}"][0].T
    return np.ascontiguousarray(features.reshape(-1, 8, features.shape[1]), np.float32)


def test_batched_appends_give_each_stream_transformers_tokens(core, reference):
    slots = mel_slots(reference)
    expected = reference[f"generate_d{N_DELAY}"][0, prompt_length(N_DELAY):].tolist()
    events = {name: [] for name in ("a", "b", "c", "limited")}
    limit = 5
    prompt = reference[f"prompt_ids_d{N_DELAY}"][0]
    for name, sink in events.items():
        core.add_session(name, n_delay=N_DELAY, prompt_ids=prompt, backlog=AudioBacklog(),
                         sink=transcript_sink(sink.append, core.tokenizer, delay_ms=480, prompt_len=len(prompt)),
                         max_slots=limit if name == "limited" else None)
    rng = np.random.default_rng(0)
    sent = {"a": 0, "b": 0, "c": 0}
    batches = 0
    while any(position < len(slots) for position in sent.values()):
        appends = []
        for _ in range(int(rng.integers(1, 7))):  # sessions in random order, some twice in a batch
            unfinished = [n for n, position in sent.items() if position < len(slots)]
            if not unfinished:
                break
            name = str(rng.choice(unfinished))
            size = int(rng.choice([0, 1, 1, 2, 5]))
            chunk = slots[sent[name] : sent[name] + size]
            sent[name] += len(chunk)
            total = len(slots) if sent[name] == len(slots) else None  # the end of input, mid-batch
            appends.append((name, chunk, 1280.0 * len(chunk), total))
        if batches == 3:  # within the limit, then past it in the same batch: refused, the session ends
            appends[1:1] = [("limited", slots[:3], 3840.0, None), ("limited", slots[3:8], 6400.0, None)]
        core.add_audio_many(appends)
        batches += 1
        for _ in range(int(rng.integers(0, 3))):
            if core.has_work():
                core.step()
    while core.has_work():
        core.step()
    for name in ("a", "b", "c"):
        done = events[name][-1]
        assert isinstance(done, TranscriptionDone) and done.token_ids == expected, name
        assert done.usage.audio_seconds == pytest.approx(len(slots) * 0.08)
    [error] = events["limited"]
    assert isinstance(error, InvalidRequestError) and "more audio than its limit" in str(error)
    assert core.at_baseline() and core.rows.mel.num_held == 0


async def test_a_batch_of_appends_that_fails_ends_only_the_sessions_in_it(reference, monkeypatch):
    """An engine bug while applying a batch of appends ends the sessions that appended in it, with the
    error; a session with nothing in that batch goes on, and the engine keeps serving."""
    config = EngineConfig(**SMALL)
    async with AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=config, dtype="float32") as engine:
        audio = reference["audio"]
        expected = (await engine.transcribe(audio)).token_ids
        bystander = await engine.start_transcription()
        await bystander.append(audio[:20000])
        await engine.wait_until_idle()
        victim = await engine.start_transcription()
        add_audio_many = engine.core.add_audio_many

        def failing(appends):
            if any(append.request_id == victim.session_id for append in appends):
                raise RuntimeError("a bug in the append path")
            add_audio_many(appends)

        monkeypatch.setattr(engine.core, "add_audio_many", failing)
        await victim.append(audio[:4000])
        with pytest.raises(EngineError, match="a bug in the append path"):
            async for _ in victim:
                pass
        monkeypatch.undo()
        await bystander.append(audio[20000:])
        await bystander.finish()
        assert [event async for event in bystander][-1].token_ids == expected
        assert (await engine.transcribe(audio)).token_ids == expected
        await engine.wait_until_idle()
        assert engine.core.at_baseline()


def test_a_busy_device_waits_for_the_paced_streams_whose_slot_is_due(reference, monkeypatch):
    """Paced streams' slots arrive spread over each 80 ms: once ticks take half a slot or more, a tick
    holds back until every stream whose next slot is due has it (one dispatch for all), or until the wait
    has passed since the oldest slot arrived; a stream that stopped sending is not waited for. A device
    with time to spare dispatches at once. The tokens are transformers' either way."""
    core = build_core(realtime_batch_wait_ms=50)
    # The scheduler's clock (arrival times, waits) moves only when the test says: a loaded machine's
    # slow ticks must not age the slots.
    clock = types.SimpleNamespace(now=1000.0)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now, thread_time=time.thread_time)
    monkeypatch.setattr(stream_rows, "time", fake_time)
    monkeypatch.setattr(transcription_scheduler, "time", fake_time)
    slots = mel_slots(reference)
    expected = reference[f"generate_d{N_DELAY}"][0, prompt_length(N_DELAY):].tolist()
    events = {name: [] for name in ("a", "b")}
    prompt = reference[f"prompt_ids_d{N_DELAY}"][0]
    for name, sink in events.items():
        core.add_session(name, n_delay=N_DELAY, prompt_ids=prompt, backlog=AudioBacklog(),
                         sink=transcript_sink(sink.append, core.tokenizer, delay_ms=480, prompt_len=len(prompt)))
    first = len(prompt) + 2
    core.add_audio_many([(name, slots[:first], 0.0, None) for name in events])
    while core.has_work():
        core.step()
    fed = {name: first for name in events}

    def dispatched_now(*names, busy=True):
        """Appends the next slot of `names`, runs a tick after one that took 60 ms (`busy`) or 1 ms;
        returns the streams it dispatched."""
        core.add_audio_many([(name, slots[fed[name] : fed[name] + 1], 1280.0, None) for name in names])
        core.record_tick(TickStats(2, 2, 0.060 if busy else 0.001, 0.0, 0.001))
        before = {name: core.sessions[name].fed for name in events}
        core.step()
        moved = {name for name in events if core.sessions[name].fed > before[name]}
        for name in moved:
            fed[name] += 1
        return moved

    assert dispatched_now("a", busy=False) == {"a"}  # the device has time to spare: no waiting
    assert dispatched_now("a") == set() and core.held_until == 1000.0 + 0.05  # b's slot is due
    clock.now += 0.03
    assert dispatched_now("b") == {"a", "b"}  # here it is: one dispatch carries both
    clock.now += 0.05
    assert dispatched_now("a") == set()
    clock.now += 0.05  # the wait has passed since a's slot arrived: a goes alone
    assert dispatched_now() == {"a"}
    clock.now += 0.13  # b stopped sending: it is no longer due
    assert dispatched_now("a") == {"a"}
    core.add_audio_many([(name, slots[fed[name]:], 1280.0, len(slots)) for name in events])
    while core.has_work():
        core.step()
    for name, sink in events.items():
        assert sink[-1].token_ids == expected, name
    assert core.at_baseline()


async def test_the_engine_thread_sleeps_once_a_held_batch_is_gone(reference, monkeypatch):
    """A tick holds a stream's slot for the other's; both sessions then end, and the held batch's deadline
    passes. The engine thread, with nothing to run, sleeps until a command comes (at most 50 ms at a time)
    instead of spinning on that deadline."""
    config = EngineConfig(**SMALL, realtime_batch_wait_ms=1000)
    async with AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=config, dtype="float32") as engine:
        # The engine's clock for arrivals and deadlines moves only when the test says (see above).
        clock = types.SimpleNamespace(now=1000.0)
        fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now, thread_time=time.thread_time,
                                          monotonic=time.monotonic)
        for module in (stream_rows, transcription_scheduler, async_engine):
            monkeypatch.setattr(module, "time", fake_time)
        audio = reference["audio"]
        sessions = [await engine.start_transcription() for _ in range(2)]
        for session in sessions:
            await session.append(audio[:12800])  # past the prompt: both decoding
        await engine.wait_until_idle()
        engine.core.record_tick(TickStats(2, 2, 0.060, 0.050, 0.001))  # a busy device (the thread is idle)
        await sessions[0].append(audio[12800:14080])
        async with asyncio.timeout(10):
            while engine.core.held_until is None:  # held for the second stream's slot
                await asyncio.sleep(0.005)
        for session in sessions:
            await session.abort()
        await engine.wait_until_idle()
        clock.now += 2.0  # past the held batch's deadline
        iterations = [0]
        has_work = engine.core.has_work

        def counted():
            iterations[0] += 1
            return has_work()

        engine.core.has_work = counted
        await asyncio.sleep(0.5)
        del engine.core.has_work
        assert iterations[0] <= 20  # ~10 sleeps of 50 ms; a spinning thread loops thousands of times
        assert engine.core.at_baseline()


def test_a_burst_of_new_streams_is_prefilled_in_one_dispatch(reference):
    """The default prefill buckets hold 32 rows at the default delay: 32 streams that start together are
    prefilled by one dispatch, not 8 per tick (which left them decoding in staggered, padded groups)."""
    loaded = loading.load_model(FIXTURES / "voxtral_tiny", dtype="float32")
    tokenizer = load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json")
    prompt = reference[f"prompt_ids_d{N_DELAY}"][0]
    small = build_realtime_core(loaded.model, EngineConfig(max_sessions=4), tokenizer, warm_up=False)
    assert {rows for rows, _ in small.prefill_buckets} == {1, 4}  # never more rows than sessions
    core = build_realtime_core(loaded.model, EngineConfig(max_sessions=64), tokenizer, warm_up=False)
    chunk = max(chunk for rows, chunk in core.prefill_buckets if rows == 32)
    assert chunk >= len(prompt) and {(1, chunk), (8, chunk)} <= set(core.prefill_buckets)
    slots = mel_slots(reference)[: len(prompt)]
    for i in range(32):
        core.add_session(f"s{i}", n_delay=N_DELAY, prompt_ids=prompt, sink=lambda item: None, backlog=AudioBacklog())
    core.add_audio_many([(f"s{i}", slots, 0.0, None) for i in range(32)])
    booked = []
    core._schedule(booked)  # noqa: SLF001 - what one tick would dispatch
    [dispatch] = booked
    assert dispatch.key == ("prefill", 32, chunk) and len(dispatch.rows) == 32


def test_an_appender_waiting_before_the_engine_took_its_stream_leaves_the_waiters_with_room():
    waiters, backlog = set(), AudioBacklog()
    backlog.start_waiting()  # more than the bound queued before the engine applied `add_session`
    backlog.attach(lambda: 0, lambda: 0, waiters, stream=object())
    assert backlog in waiters  # the engine's ticks wake it
    backlog.stop_waiting()
    assert not waiters  # used to stay: every dispatch of the stream then posted a stray PROGRESS


def test_consumed_audio_is_read_from_the_rows_and_waiting_appenders_are_woken(core, reference):
    """`AudioBacklog.consumed` follows the row's dispatched slots (no per-session update in a tick); an
    appender waiting for room gets PROGRESS from the tick that consumes its stream's audio, not from one
    that does not; once the stream ends the last count stays and the engine's set of waiters is empty."""
    slots = mel_slots(reference)
    prompt = reference[f"prompt_ids_d{N_DELAY}"][0]
    events = {name: [] for name in ("a", "b")}
    backlogs = {name: AudioBacklog() for name in events}
    for name, sink in events.items():
        core.add_session(name, n_delay=N_DELAY, prompt_ids=prompt, sink=sink.append, backlog=backlogs[name])
    core.add_audio_many([(name, slots[: len(prompt) + 3], 0.0, None) for name in events])
    for backlog in backlogs.values():
        backlog.sent = len(prompt) + 3
    assert all(backlog.queued == len(prompt) + 3 for backlog in backlogs.values())
    while core.has_work():
        core.step()
    assert all(backlog.consumed == len(prompt) + 3 and backlog.queued == 0 for backlog in backlogs.values())
    backlogs["a"].start_waiting()
    core.add_audio_many([(name, slots[len(prompt) + 3 : len(prompt) + 5], 2560.0, None) for name in events])
    for backlog in backlogs.values():
        backlog.sent += 2
    core.step()  # dispatches the next slot (of two) of both streams: only a waits
    assert all(backlog.consumed == len(prompt) + 4 and backlog.queued == 1 for backlog in backlogs.values())
    assert events["a"].count(PROGRESS) == 1 and PROGRESS not in events["b"]
    backlogs["a"].stop_waiting()
    backlogs["b"].start_waiting()
    core.add_audio_many([(name, slots[len(prompt) + 5 :], 1280.0, len(slots)) for name in events])
    while core.has_work():
        core.step()
    assert backlogs["a"].consumed == backlogs["b"].consumed == len(slots) - 1  # the last slot is never fed
    assert not core._waiting and core.at_baseline()  # noqa: SLF001
    backlogs["b"].stop_waiting()



def test_collected_slots_count_only_slots_whose_text_was_handed_on():
    """`AudioBacklog.collected` (what Kyutai markers wait for): after every tick it is at most the consumed
    count, and the ids handed to the stream so far hold every text id that the stream's whole run generates
    from the positions it counts; once the engine is idle with the stream's audio all dispatched it equals
    the consumed count; after the end it keeps the last count. The embedded model on the bundled sample
    (the fixture's random weights generate no text)."""
    loaded = loading.load_model("tiny")
    core = build_realtime_core(loaded.model, EngineConfig(**SMALL), load_tokenizer(loaded.tokenizer_path))
    n_delay = n_delay_from_ms(480)
    prompt = transcription_prompt(loaded.config, n_delay)
    features = offline_features(load_audio(loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav"), n_delay)
    slots = np.ascontiguousarray(features.reshape(-1, 8, features.shape[1]), np.float32)

    def run(halves):
        handed, backlog = [], AudioBacklog()
        core.add_session("s", n_delay=n_delay, prompt_ids=prompt, backlog=backlog,
                         sink=transcript_sink(handed.append, core.tokenizer, delay_ms=480, prompt_len=len(prompt)))
        # Ids handed on so far: the deltas' (the end's event holds the whole stream's).
        ids = lambda: [token for event in handed if isinstance(event, TranscriptionDelta)  # noqa: E731
                       for token in event.token_ids]
        counts = []
        for begin, end in halves:
            core.add_audio_many([("s", slots[begin:end], 1280.0 * (end - begin),
                                  len(slots) if end == len(slots) else None)])
            while core.has_work():
                core.step()
                counts.append((backlog.collected, backlog.consumed, len(ids())))
            if end < len(slots):
                assert backlog.collected == backlog.consumed == end
        assert isinstance(handed[-1], TranscriptionDone) and core.at_baseline()
        assert backlog.collected == backlog.consumed == len(slots) - 1  # the last slot is never fed
        return handed[-1].token_ids, counts

    expected, _ = run([(0, len(slots))])
    text = [i for i, token in enumerate(expected) if not core.tokenizer.is_control(token)]
    half = len(slots) // 2
    got, counts = run([(0, half), (half, len(slots))])
    assert got == expected
    # Position p generates id p - (len(prompt) - 1): the ids below `covered` come from counted positions.
    for collected, consumed, handed in counts:
        covered = collected - len(prompt) + 1
        assert collected <= consumed and all(i < handed for i in text if i < covered), (collected, handed)
    assert any(i < half - len(prompt) + 1 for i in text)  # text in the first half: the checks saw some


async def test_collected_slots_count_only_once_their_ids_are_posted_to_the_event_loop():
    """AsyncEngine's sinks collect a tick's events in an outbox posted after the tick; `collected` used to
    count the slots inside the tick, so a reader on the event loop (Kyutai's markers) could see a slot
    counted whose text was still in the outbox (4 of 223 reads with a 10 us thread switch interval). The
    engine now posts what a dispatch handed on before the count is raised."""
    loaded = loading.load_model("tiny")
    sample = load_audio(loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav")
    async with AsyncEngine(loaded.model, config=EngineConfig(**SMALL),
                           tokenizer=load_tokenizer(loaded.tokenizer_path)) as engine:
        core, unposted = engine.core, []
        advance = core._advance  # noqa: SLF001

        def checked(*args):
            advance(*args)  # hands ids on, then counts their slots
            unposted.extend(item for _, _, item in engine._engine_thread.outbox  # noqa: SLF001
                            if isinstance(item, GeneratedIds))

        core._advance = checked  # noqa: SLF001 - on the engine thread, right after each count
        done = await engine.transcribe(sample)
    assert done.text and not unposted


async def test_transcribe_appends_a_long_recording_in_pieces_of_the_backlog_bound():
    """`AsyncEngine.transcribe` appended a whole recording at once (a lone append passes the backlog bound), so
    the engine's shared mel slab grew to hold all of it and kept that size for the engine's lifetime (2,048 blocks
    for 90 s here; about 512 MiB for a 2-hour file). It appends pieces of `max_queued_audio_seconds`: the slab
    keeps its 1,024 blocks, and the tokens are those of the recording appended whole."""
    audio = (0.1 * np.random.default_rng(0).standard_normal(16_000 * 90)).astype(np.float32)
    config = EngineConfig(**SMALL, max_queued_audio_seconds=5.0)
    engines = [AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=config, dtype="float32")
               for _ in range(2)]
    try:
        whole = await engines[1].start_transcription()
        await whole.append(audio)
        await whole.finish()
        expected = [event async for event in whole][-1].token_ids
        done = await engines[0].transcribe(audio)
        assert done.token_ids == expected and done.usage.audio_seconds == 90.0
        assert len(engines[0].core.rows.mel.data) == 1024 < len(engines[1].core.rows.mel.data)
    finally:
        for engine in engines:
            engine.close()
