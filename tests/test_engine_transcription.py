"""Realtime transcription sessions over the tiny Voxtral fixture: any chunking of the audio gives exactly
transformers' greedy `generate` tokens; sessions with different delays batched together equal their solo
runs; eviction to host memory and back changes nothing; every way a session ends frees its pages."""
import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.transcription_session import (
    GeneratedIds, TranscriptAssembler, TranscriptionDelta, TranscriptionDone, word_timings)
from jaxstream.errors import EngineError, SessionClosedError
from jaxstream.models.audio import (
    ALLOWED_DELAYS_MS, MAX_SAMPLE_MAGNITUDE, n_delay_from_ms, prompt_length, resample_to_16k,
)
from jaxstream.models.tokenizers import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))


# Every test must leave the module's engine idle with no pages, slots or host memory held.
pytestmark = pytest.mark.usefixtures("engine_returns_to_baseline")


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(max_sessions=16, page_size=4, encoder_page_size=4, batch_buckets=(16,),
                          realtime_step_buckets=(1, 4), realtime_prefill_buckets=((4, 40),))
    engine = AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=config, dtype="float32")
    yield engine
    engine.close()


def expected_tokens(reference, delay_ms):
    n_delay = n_delay_from_ms(delay_ms)
    return reference[f"generate_d{n_delay}"][0, prompt_length(n_delay):].tolist()


async def stream(session, audio, rng, *, pause=None):
    """Appends `audio` in random pieces (sometimes tiny, sometimes seconds), then finishes; collects events.
    `pause`: an awaitable run once half the audio is in (the session sits idle meanwhile)."""
    position, paused = 0, pause is None
    while position < len(audio):
        size = int(rng.choice([1, 37, 640, 1280, 4000, 20000]))
        await session.append(audio[position : position + size])
        position += size
        if not paused and position >= len(audio) // 2:
            paused = True
            await pause
        await asyncio.sleep(0)
    await session.finish()
    return [event async for event in session]


def expected_logprobs(reference, delay_ms):
    """float64 log-softmax of transformers' generate logits at each token it chose."""
    from scipy.special import log_softmax

    logits = reference[f"generate_logits_d{n_delay_from_ms(delay_ms)}"].astype(np.float64)
    return log_softmax(logits, axis=-1)[np.arange(len(logits)), logits.argmax(-1)]


def check_events(events, tokens, tokenizer, audio_seconds, delay_ms, logprobs=None):
    *deltas, done = events
    assert isinstance(done, TranscriptionDone) and all(isinstance(d, TranscriptionDelta) for d in deltas)
    assert done.token_ids == tokens and done.delay_ms == delay_ms
    assert done.text == tokenizer.decode(tokens) == "".join(d.text for d in deltas)
    streamed = [t for d in deltas for t in d.token_ids]
    assert streamed == tokens[: len(streamed)]
    assert [lp for d in deltas for lp in d.logprobs] == done.logprobs[: len(streamed)]
    assert len(done.logprobs) == len(tokens) and all(lp <= 0 for lp in done.logprobs)
    if logprobs is not None:
        np.testing.assert_allclose(done.logprobs, logprobs, atol=2e-4)
    assert done.usage.audio_seconds == audio_seconds and done.usage.output_tokens == len(tokens)
    assert done.usage.prompt_tokens == prompt_length(n_delay_from_ms(delay_ms))


async def test_random_chunkings_match_transformers_generate(engine, reference):
    audio = reference["audio"]
    runs = [(480, 0), (480, 1), (160, 2), (160, 3)]
    sessions = [await engine.start_transcription(delay_ms=delay) for delay, _ in runs]
    results = await asyncio.gather(*(stream(s, audio, np.random.default_rng(seed))
                                     for s, (_, seed) in zip(sessions, runs)))
    for (delay, _), events in zip(runs, results):
        check_events(events, expected_tokens(reference, delay), engine.tokenizer, len(audio) / 16000, delay,
                     expected_logprobs(reference, delay))


async def test_concurrent_sessions_with_every_delay_equal_their_solo_runs(engine, reference):
    audio = reference["audio"][:30000]
    solo = {}
    for delay in ALLOWED_DELAYS_MS:
        done = await engine.transcribe(audio, delay_ms=delay)
        solo[delay] = done.token_ids
    assert len(solo) == 16
    sessions = [await engine.start_transcription(delay_ms=delay) for delay in ALLOWED_DELAYS_MS]
    results = await asyncio.gather(*(stream(s, audio, np.random.default_rng(i)) for i, s in enumerate(sessions)))
    for delay, events in zip(ALLOWED_DELAYS_MS, results):
        check_events(events, solo[delay], engine.tokenizer, len(audio) / 16000, delay)


async def test_transcribe_takes_audio_at_any_rate_as_a_session_does(engine, reference):
    """`transcribe(pcm, sample_rate=...)` resamples as `start_transcription(sample_rate=...)` does (it took 16 kHz
    only: 22.05 kHz audio from soundfile.read was transcribed as if it were 16 kHz, without a word)."""
    import soxr

    audio = soxr.resample(reference["audio"][:40000], 16000, 22050).astype(np.float32)
    session = await engine.start_transcription(sample_rate=22050)
    await session.append(audio)
    await session.finish()
    expected = [event async for event in session][-1]
    done = await engine.transcribe(audio, sample_rate=22050)
    assert done.token_ids == expected.token_ids and done.text == expected.text
    assert done.usage.audio_seconds == pytest.approx(len(audio) / 22050)


async def test_parked_sessions_evicted_to_host_resume_identically(engine, reference):
    """Also checks that serving (prefill, catch-up steps, eviction, restore) never compiles."""
    audio = reference["audio"]
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    held = [engine.core.cache.take_slot() for _ in range(14)]  # two device slots left for three sessions
    try:
        evictions = engine.core.evictions
        idle = asyncio.Event()
        first = [await engine.start_transcription(delay_ms=480) for _ in range(2)]
        tasks = [asyncio.create_task(stream(s, audio, np.random.default_rng(i), pause=idle.wait()))
                 for i, s in enumerate(first)]
        await asyncio.sleep(0.5)
        await engine.wait_until_idle()  # both parked mid-stream, holding the two slots
        third = await engine.start_transcription(delay_ms=160)
        third_events = await stream(third, audio, np.random.default_rng(9))
        idle.set()
        first_events = await asyncio.gather(*tasks)
        assert engine.core.evictions > evictions
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        for slot in held:
            engine.core.cache.release_slot(slot)
    assert compiles == []
    check_events(third_events, expected_tokens(reference, 160), engine.tokenizer, len(audio) / 16000, 160)
    for events in first_events:
        check_events(events, expected_tokens(reference, 480), engine.tokenizer, len(audio) / 16000, 480)


async def test_memory_per_stream_stays_within_the_windows(engine, reference):
    audio = np.tile(reference["audio"], 2)  # 6.6 s: past both tiny windows (12 frames, 96 tokens)
    session = await engine.start_transcription(delay_ms=480)
    peak = {"encoder": 0, "decoder": 0}
    for start in range(0, len(audio), 2560):
        await session.append(audio[start : start + 2560])
        await asyncio.sleep(0.01)
        state = engine.core.sessions.get(session.session_id)
        if state is not None:
            for name in peak:
                peak[name] = max(peak[name], state.pages[name].num_allocated)
    await session.finish()
    events = [event async for event in session]
    assert len(events[-1].token_ids) == (len(audio) + 40960 + 21760 + 1279) // 1280 - 39
    for name, spec in engine.core.cache.specs.items():
        assert 0 < peak[name] <= spec.pages_per_window


async def test_abort_cancel_and_bad_input_free_everything(engine, reference):
    audio = reference["audio"]
    aborted = await engine.start_transcription()
    await aborted.append(audio[:30000])
    await aborted.abort()
    assert [event async for event in aborted] == []

    cancelled = await engine.start_transcription()
    await cancelled.append(audio)
    listener = asyncio.create_task(anext(aiter(cancelled)))
    await engine.wait_until_idle()
    listener.cancel()  # the consumer walks away mid-stream
    await asyncio.gather(listener, return_exceptions=True)

    bad = await engine.start_transcription()
    await bad.append(audio[:5000])
    with pytest.raises(ValueError):
        await bad.append(np.full(100, np.nan, np.float32))
    with pytest.raises(ValueError):
        await bad.append(audio[:100].astype(np.int16))
    await bad.append(audio[5000:])  # the session survives a rejected append
    await bad.finish()
    events = [event async for event in bad]
    assert events[-1].token_ids == expected_tokens(reference, 480)
    with pytest.raises(SessionClosedError):
        await bad.append(audio[:10])


async def test_a_failing_session_does_not_affect_another(engine, reference):
    audio = reference["audio"]
    good, bad = await engine.start_transcription(), await engine.start_transcription()

    class Exploding:
        def push_many(self, tokens):
            raise RuntimeError("detokenizer failure")

    await bad.append(audio[:20000])
    await engine.wait_until_idle()
    bad._transcript._decoder = Exploding()  # the detokenizer runs on the consumer's side, on this event loop
    results = await asyncio.gather(stream(good, audio, np.random.default_rng(5)),
                                   stream(bad, audio[20000:], np.random.default_rng(6)), return_exceptions=True)
    # The failure reaches its own caller as an EngineError naming the cause (from append or the iterator),
    # and the engine lets go of the session.
    assert isinstance(results[1], EngineError) and "detokenizer failure" in str(results[1])
    check_events(results[0], expected_tokens(reference, 480), engine.tokenizer, len(audio) / 16000, 480)
    await engine.wait_until_idle()
    assert engine.core.at_baseline()


async def test_a_resampled_session_ending_loud_finishes_as_the_offline_path(engine):
    """8 kHz audio at the largest magnitude appends accept, whose resampled tail overshoots it: the session
    ends (it once never did: its end failed in the front end), with the tokens of the same recording resampled
    offline and clipped to the checked range, transcribed at 16 kHz."""
    rate = 8000
    pcm = (MAX_SAMPLE_MAGNITUDE * np.sign(np.sin(2 * np.pi * 700 * np.arange(2 * rate) / rate))).astype(np.float32)
    session = await engine.start_transcription(sample_rate=rate)
    for begin in range(0, pcm.size, 640):
        await session.append(pcm[begin:begin + 640])
    await session.finish()
    events = await asyncio.wait_for(_collect(session), timeout=120)
    offline = np.clip(resample_to_16k(pcm, rate), -MAX_SAMPLE_MAGNITUDE, MAX_SAMPLE_MAGNITUDE)
    assert events[-1].token_ids == (await engine.transcribe(offline)).token_ids
    assert session.outcome == "done"


async def test_a_front_end_failing_on_the_end_ends_the_session_and_frees_it(engine, reference, monkeypatch):
    """Should the front end fail on a stream's end, the engine would wait for that end forever: the session
    ends with an EngineError from its iterator, and the engine frees what it held (the module's fixture
    checks the engine is back at its baseline)."""
    session = await engine.start_transcription()
    await session.append(reference["audio"][:20000])

    def broken_end():
        raise RuntimeError("the end of the stream broke")

    monkeypatch.setattr(session._front.log_mel, "finish", broken_end)  # noqa: SLF001 - the session's own front end
    await asyncio.wait_for(session.finish(), timeout=60)
    with pytest.raises(EngineError, match="the end of its audio could not be processed"):
        await asyncio.wait_for(_collect(session), timeout=60)
    with pytest.raises(SessionClosedError):
        await session.append(reference["audio"][:10])


async def _collect(session):
    return [event async for event in session]


def test_word_timings_follow_markers_minus_the_delay():
    tokenizer = load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json")
    byte_id = {bytes([b]): 1000 + b for b in range(100)}  # the tiny vocabulary: single bytes 0..99
    first, second = [byte_id[c] for c in (b" ", b"H", b"I")], [byte_id[c] for c in (b" ", b"O", b"K")]
    pad, word = tokenizer.streaming_pad_id, tokenizer.streaming_word_id
    ids = [pad, word, *first, pad, pad, word, *second, pad]
    words = word_timings(ids, tokenizer, audio_seconds=10.0)
    # Token i describes real audio at (i + 1) * 80 ms: a word starts at its marker (ids 1 and 7) and ends
    # 80 ms after its last text token (ids 4 and 10).
    assert [w.word for w in words] == ["HI", "OK"]
    np.testing.assert_allclose([(w.start, w.end) for w in words], [(2 * 0.08, 6 * 0.08), (8 * 0.08, 12 * 0.08)])
    clipped = word_timings(ids, tokenizer, audio_seconds=0.7)
    np.testing.assert_allclose([(w.start, w.end) for w in clipped], [(2 * 0.08, 6 * 0.08), (8 * 0.08, 0.7)])
    # Times are milliseconds that never pass the end of the audio: a recording of 47,948 samples (2.99675 s)
    # whose last word is clipped ends it at 2.996 (rounding to 2.997 put it after the recording).
    odd = word_timings([*ids[:-1], *[pad] * 26, word, *first, pad], tokenizer, audio_seconds=47948 / 16000)
    assert odd[-1].word == "HI" and odd[-1].end == 2.996 and odd[-1].start <= odd[-1].end
    late = word_timings([*[pad] * 38, word, *first], tokenizer, audio_seconds=47948 / 16000)
    assert (late[-1].start, late[-1].end) == (2.996, 2.996)  # a word that starts in the last half-millisecond
    # Without markers, a space-led text token starts a new word at its own time.
    plain = word_timings([*first, *second], tokenizer, audio_seconds=10.0)
    np.testing.assert_allclose([(w.start, w.end) for w in plain], [(0.08, 4 * 0.08), (4 * 0.08, 7 * 0.08)])
    # A marker inside a word (before a piece without a space) does not split it: the words are the text's,
    # "HIOK" here, and the marker times nothing.
    joined = [pad, word, *first, pad, word, *second[1:], pad]
    assert tokenizer.decode(joined) == " HIOK"
    assert [(w.word, w.start, w.end) for w in word_timings(joined, tokenizer, audio_seconds=10.0)] == [
        ("HIOK", 0.16, 0.8)]


def test_markers_are_the_word_boundaries_of_text_without_spaces():
    """Chinese and Japanese text has no spaces: its [STREAMING_WORD] markers are its word boundaries, as the
    spec's marker is (a marker inside a word of ASCII letters joins it, above). A byte-level stub tokenizer."""

    class Bytes:
        streaming_word_id, streaming_pad_id = 33, 32

        def is_control(self, token):
            return token < 1000

        def token_bytes(self, token):
            return bytes([token - 1000])

        def decode(self, ids):
            return b"".join(self.token_bytes(t) for t in ids if t >= 1000).decode()

    def ids(text):
        return [1000 + b for b in text.encode()]

    word = Bytes.streaming_word_id
    stream = [word, *ids("今天"), word, *ids("天气"), word, *ids("很好"), 32, word, *ids(" ok"), word, *ids("ay")]
    words = word_timings(stream, Bytes(), audio_seconds=10.0)
    assert [(w.word, w.start, w.end) for w in words] == [
        ("今天", 0.08, 0.64), ("天气", 0.64, 1.2), ("很好", 1.2, 1.76), ("okay", 1.84, 2.4)]


def test_delta_times_never_pass_the_end_of_the_audio():
    """A delta's time is its newest token's, at most the audio received, in milliseconds within it: for a
    recording of 47,948 samples (2.99675 s) the deltas said 2.997 (rounded to the nearest), after the recording,
    while its words end at 2.996."""
    tokenizer = load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json")
    pad, word = tokenizer.streaming_pad_id, tokenizer.streaming_word_id
    ids = [pad] * 40 + [word] + [1000 + b for b in b" HI"]  # the text describes audio past 2.99675 s
    assembler = TranscriptAssembler(tokenizer, delay_ms=480, prompt_len=39)
    events = assembler.events(GeneratedIds(ids[:-1], [0.0] * (len(ids) - 1), 47948, False))
    events += assembler.events(GeneratedIds(ids[-1:], [0.0], 47948, True))
    deltas, done = events[:-1], events[-1]
    assert [d.text for d in deltas] == [" H", "I"] and done.words[-1].end == 2.996
    assert [d.audio_seconds for d in deltas] == [2.996, 2.996]


async def test_tensor_parallel_over_four_devices_gives_identical_tokens(reference):
    mesh = jax.make_mesh((2, 2), ("data", "tp"))
    config = EngineConfig(max_sessions=2, page_size=4, encoder_page_size=4, batch_buckets=(2,),
                          realtime_step_buckets=(4,), realtime_prefill_buckets=((2, 40),), mesh=mesh)
    engine = AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=config, dtype="float32")
    try:
        assert engine.core.cache.state["stacks"]["encoder"][0][0].sharding.spec[1] == "tp"
        audio = reference["audio"]
        sessions = [await engine.start_transcription(delay_ms=delay) for delay in (480, 160)]
        results = await asyncio.gather(*(stream(s, audio, np.random.default_rng(i)) for i, s in enumerate(sessions)))
    finally:
        await engine.shutdown()
    for delay, events in zip((480, 160), results):
        assert events[-1].token_ids == expected_tokens(reference, delay)


def test_a_failed_dispatch_ends_the_sessions_of_its_tick_and_frees_their_audio(monkeypatch):
    """A tick's first program call raises: the sessions of every dispatch of that tick end with the error,
    the dispatch never run included, and the slab blocks of their booked slots come back with their pages."""
    from jaxstream.engine.builders import build_realtime_core
    from jaxstream.engine.transcription_session import AudioBacklog, transcription_prompt
    from jaxstream.models import loading

    loaded = loading.load_model(FIXTURES / "voxtral_tiny", dtype="float32")
    config = EngineConfig(max_sessions=4, page_size=4, encoder_page_size=4, batch_buckets=(4,),
                          realtime_step_buckets=(1,), realtime_prefill_buckets=((4, 40),))
    core = build_realtime_core(loaded.model, config, load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json"))
    cfg, n_delay = loaded.model.cfg, n_delay_from_ms(480)
    prompt = transcription_prompt(cfg, n_delay)
    slots = np.random.default_rng(0).standard_normal((len(prompt) + 1, cfg.mel_frames_per_token,
                                                      cfg.encoder.num_mel_bins)).astype(np.float32)
    events = {"decoding": [], "prefilling": []}
    for name, sink in events.items():
        core.add_session(name, n_delay=n_delay, prompt_ids=prompt, sink=sink.append,
                         backlog=AudioBacklog())
    core.add_audio("decoding", slots[: len(prompt)], 0.0)
    while core.has_work():
        core.step()
    assert core.sessions["decoding"].fed == len(prompt) and not core.rows.mel.num_held  # prefilled
    core.add_audio("decoding", slots[len(prompt):], 1280.0)
    core.add_audio("prefilling", slots[: len(prompt)], 0.0)

    def run(key, batch):
        assert key[0] == "decode"  # scheduled first; the prefill is booked but never called
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.programs, "run", run)
    core.step()
    for sink in events.values():
        assert isinstance(sink[-1], RuntimeError) and str(sink[-1]) == "device lost"
    assert core.at_baseline() and core.rows.mel.num_held == 0


def test_a_tick_whose_scheduling_fails_after_booking_frees_what_it_booked(monkeypatch):
    """Window admission: a new stream's admission evicts an idle parked one to host memory, and the copy
    fails after the tick already booked a decoding stream's slots. The error ends every session (what
    AsyncEngine does with an error from a tick); the booked slab blocks used to stay held for good."""
    from jaxstream.engine.builders import build_realtime_core
    from jaxstream.engine.transcription_session import AudioBacklog, transcription_prompt
    from jaxstream.models import loading

    loaded = loading.load_model(FIXTURES / "voxtral_tiny", dtype="float32")
    config = EngineConfig(max_sessions=2, page_size=4, encoder_page_size=4, batch_buckets=(2,),
                          realtime_step_buckets=(1,), realtime_prefill_buckets=((2, 40),), realtime_admission="window")
    core = build_realtime_core(loaded.model, config, load_tokenizer(FIXTURES / "voxtral_tiny" / "tekken.json"))
    cfg, n_delay = loaded.model.cfg, n_delay_from_ms(480)
    prompt = transcription_prompt(cfg, n_delay)
    slots = np.random.default_rng(0).standard_normal((len(prompt) + 4, cfg.mel_frames_per_token,
                                                      cfg.encoder.num_mel_bins)).astype(np.float32)
    for name in ("decoding", "idle"):
        core.add_session(name, n_delay=n_delay, prompt_ids=prompt, sink=lambda item: None, backlog=AudioBacklog())
        core.add_audio(name, slots[: len(prompt) + 1], 0.0)
    while core.has_work():
        core.step()
    core.rows.last_arrival[core.sessions["idle"].row] -= 5.0  # parked, and idle long enough to be evicted
    core.add_session("new", n_delay=n_delay, prompt_ids=prompt, sink=lambda item: None, backlog=AudioBacklog())
    core.add_audio("new", slots[: len(prompt)], 0.0)  # needs the idle stream's slot
    core.add_audio("decoding", slots[len(prompt) + 1:], 1280.0)  # booked before the admission

    def offload(*args, **kwargs):
        raise RuntimeError("host copy failed")

    monkeypatch.setattr(core.cache, "offload", offload)
    with pytest.raises(RuntimeError, match="host copy failed"):
        core.step()
    monkeypatch.undo()
    for session in list(core.sessions.values()):
        core.fail(session, RuntimeError("engine tick failed"))
    while core.has_work():
        core.step()
    assert not core.sessions and core.rows.mel.num_held == 0 and core.at_baseline()
