"""The engine's batched audio front end (jaxstream/engine/audio_front_end.py): appends of many sessions
queued together are computed in one pass, yet every session gets exactly its offline features
(`offline_features`, the oracle), in its own order; a bad append fails alone; a closed session's queued
work is skipped. Then the same through `TranscriptionSession` (with a recording link instead of an engine)."""
import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxstream.engine import audio_front_end
from jaxstream.engine.audio_front_end import FrontEndWorker
from jaxstream.engine.transcription_session import TranscriptAssembler, TranscriptionSession
from jaxstream.errors import EngineDeadError, EngineError, InvalidAudioError, SessionClosedError
from jaxstream.models import audio
from jaxstream.models.tokenizers import load_tokenizer


@pytest.fixture
def worker():
    worker = FrontEndWorker()
    yield worker
    worker.close()


@pytest.fixture
def passes(monkeypatch):
    """The number of streams in each batched log-mel computation, in order."""
    sizes = []
    real = audio_front_end.take_ready

    def recording(requests):
        sizes.append(len(requests))
        return real(requests)

    monkeypatch.setattr(audio_front_end, "take_ready", recording)
    return sizes


class _GatedLogMel(audio.StreamingLogMel):
    """Holds the worker inside its first push until `gate` is set, so that the jobs submitted meanwhile
    are all queued when the worker comes back: they form one pass."""

    def __init__(self):
        super().__init__(n_delay=6)
        self.entered, self.gate = threading.Event(), threading.Event()

    def push(self, pcm):
        self.entered.set()
        self.gate.wait()
        return super().push(pcm)


async def hold(worker):
    gated = worker.stream(_GatedLogMel())
    blocker = worker.submit(gated, np.zeros(10, np.float32))
    await asyncio.to_thread(gated.log_mel.entered.wait)
    return gated.log_mel.gate, blocker


def recordings(count, seed=0):
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(int(rng.integers(12000, 20000)))).astype(np.float32) for _ in range(count)]


async def test_one_pass_serves_many_sessions_each_in_its_own_order(worker, passes):
    pcms, delays, piece = recordings(3), (1, 6, 15), 1280
    streams = [worker.stream(audio.StreamingLogMel(n_delay)) for n_delay in delays]
    gate, blocker = await hold(worker)
    futures = [[] for _ in streams]
    for begin in range(0, max(p.size for p in pcms), piece):  # interleaved: round r holds every stream's r-th piece
        for stream, pcm, pending in zip(streams, pcms, futures):
            if begin < pcm.size:
                pending.append(worker.submit(stream, pcm[begin:begin + piece]))
    for stream, pending in zip(streams, futures):
        pending.append(worker.submit(stream, None))  # finish
    gate.set()
    await blocker
    for stream, pcm, n_delay, pending in zip(streams, pcms, delays, futures):
        slots = np.concatenate(await asyncio.gather(*pending))
        np.testing.assert_allclose(slots.reshape(-1, 128), audio.offline_features(pcm, n_delay), rtol=0, atol=1e-6)
        assert stream.log_mel.done
    # After the blocker's pass, each computation takes one job of every stream that has one left: as
    # many computations as the longest stream has jobs, covering every job.
    assert passes[0] == 1 and len(passes) - 1 == max(map(len, futures)) and sum(passes) - 1 == sum(map(len, futures))


async def test_bad_audio_fails_its_own_append_only(worker, passes):
    good, other = recordings(2, seed=1)
    bad_stream, good_stream = (worker.stream(audio.StreamingLogMel(6)) for _ in range(2))
    gate, blocker = await hold(worker)
    bad = worker.submit(bad_stream, np.array([0.0, np.nan], np.float32))
    too_loud = worker.submit(bad_stream, np.full(100, 40000.0, np.float32))  # PCM16-scaled floats
    fine = worker.submit(good_stream, good)
    gate.set()
    await blocker
    with pytest.raises(audio.AudioError, match="NaN"):
        await bad
    with pytest.raises(audio.AudioError, match="magnitude"):
        await too_loud
    assert passes == [1, 1]  # the good append was computed in the same pass as the rejected ones
    assert bad_stream.log_mel.samples_received == 0  # a rejected append leaves its stream as it was
    slots = [await fine, await worker.submit(good_stream, None)]
    np.testing.assert_allclose(np.concatenate(slots).reshape(-1, 128), audio.offline_features(good, 6), atol=1e-6)
    # ... and the session that sent the bad audio goes on as if it never had.
    slots = [await worker.submit(bad_stream, other), await worker.submit(bad_stream, None)]
    np.testing.assert_allclose(np.concatenate(slots).reshape(-1, 128), audio.offline_features(other, 6), atol=1e-6)


async def test_a_closed_stream_skips_its_queued_work(worker, passes):
    stream = worker.stream(audio.StreamingLogMel(6))
    gate, blocker = await hold(worker)
    queued = worker.submit(stream, recordings(1)[0])
    stream.close()
    gate.set()
    await blocker
    assert (await queued).shape == (0, 8, 128)
    assert stream.log_mel.samples_received == 0 and passes == [1]


async def test_resampled_streams_match_their_resampled_audio(worker):
    """Streams at 24 kHz and 8 kHz (soxr streaming on the worker), batched with a 16 kHz one: each gets the
    offline features of what soxr's stream resampler makes of the same pieces."""
    import soxr

    pcm = recordings(1, seed=2)[0]
    rates = (24000, 8000, 16000)
    streams = [worker.stream(audio.StreamingLogMel(6), rate) for rate in rates]
    inputs = [soxr.resample(pcm, 16000, rate).astype(np.float32) for rate in rates]
    pieces = [np.array_split(x, 8) for x in inputs]
    outputs = [[] for _ in rates]
    pushed = [0 for _ in rates]
    for step in range(8):
        results = await asyncio.gather(*(s.push(p[step]) for s, p in zip(streams, pieces)))
        for i, (out, result) in enumerate(zip(outputs, results)):
            out.append(result)
            # The prediction an append refused for backlog relies on: exact at 16 kHz; through the resampler
            # never short, and at most two slots over once the prompt is out.
            pushed[i] += pieces[i][step].size
            made = sum(len(slots) for slots in out)
            ahead = streams[i].slots_at(pushed[i]) - made
            assert ahead == 0 if rates[i] == 16000 else 0 <= ahead <= (2 if made else audio.prompt_length(6))
    for stream, out, rate, parts in zip(streams, outputs, rates, pieces):
        out.append(await stream.finish())
        resampled = parts
        if rate != 16000:
            resampler = soxr.ResampleStream(rate, 16000, 1, dtype="float32", quality="HQ")
            resampled = [resampler.resample_chunk(p) for p in parts] + [
                resampler.resample_chunk(np.zeros(0, np.float32), last=True)]
        expected = audio.offline_features(np.concatenate(resampled), 6)
        np.testing.assert_allclose(np.concatenate(out).reshape(-1, 128), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("amplitude", [1.0, audio.MAX_SAMPLE_MAGNITUDE])
async def test_a_resampled_stream_ending_loud_finishes_as_the_offline_path(worker, amplitude):
    """An 8 kHz square wave at full scale, or at the largest magnitude appends accept: soxr's ringing
    overshoots it (to 1.36 x), in the appends and in the tail the end flushes alike. Both are clipped to the
    range the input was checked against, so the stream ends (the tail was once refused, and the stream could
    never end) with the features of the whole recording resampled offline, clipped the same way."""
    rate = 8000
    pcm = (amplitude * np.sign(np.sin(2 * np.pi * 700 * np.arange(rate) / rate))).astype(np.float32)
    stream = worker.stream(audio.StreamingLogMel(6), rate)
    out = [await stream.push(pcm[begin:begin + 640]) for begin in range(0, pcm.size, 640)]
    out.append(await stream.finish())
    assert stream.log_mel.done
    limit = audio.MAX_SAMPLE_MAGNITUDE
    offline = np.clip(audio.resample_to_16k(pcm, rate), -limit, limit)
    np.testing.assert_allclose(np.concatenate(out).reshape(-1, 128), audio.offline_features(offline, 6),
                               rtol=0, atol=1e-6)


async def test_close_answers_what_was_queued_and_refuses_the_rest():
    worker = FrontEndWorker()
    stream = worker.stream(audio.StreamingLogMel(6))
    queued = worker.submit(stream, np.zeros(16000, np.float32))
    await asyncio.to_thread(worker.close)
    assert (await queued).shape == (audio.StreamingLogMel(6).push(np.zeros(16000, np.float32)), 8, 128)
    with pytest.raises(EngineDeadError):
        worker.submit(stream, np.zeros(10, np.float32))


# -- through TranscriptionSession -----------------------------------------------------------------------------
class _RecordingLink:
    """Stands in for the engine: records the commands a session sends."""

    def __init__(self):
        self.audio, self.aborted = [], []

    def send_audio(self, mel_slots, samples, total_slots=None):
        assert not self.aborted, "audio sent after the abort"
        self.audio.append((mel_slots, samples, total_slots))

    def abort(self, reason):
        self.aborted.append(reason)


TEKKEN = load_tokenizer(Path(__file__).parent / "fixtures" / "voxtral_tiny" / "tekken.json")


def session_on(worker, link, session_id="s", max_queued_slots=1000, max_audio_seconds=None, log_mel=None,
               sample_rate=audio.SAMPLING_RATE):
    transcript = TranscriptAssembler(TEKKEN, delay_ms=480, prompt_len=audio.prompt_length(6))
    front_end = worker.stream(log_mel or audio.StreamingLogMel(6), sample_rate)
    return TranscriptionSession(link, session_id, 480, front_end, transcript, sample_rate=sample_rate,
                                max_queued_slots=max_queued_slots, max_audio_seconds=max_audio_seconds)


async def test_sessions_send_their_own_slots_and_a_bad_append_raises_from_itself(worker):
    pcms = recordings(2, seed=3)
    links = [_RecordingLink(), _RecordingLink()]
    sessions = [session_on(worker, link, f"s{i}") for i, link in enumerate(links)]
    bad = np.array([np.inf], np.float32)

    async def feed(session, pcm, with_bad):
        for begin in range(0, pcm.size, 1280):
            await session.append(pcm[begin:begin + 1280])
            if with_bad and begin == 6400:
                with pytest.raises(InvalidAudioError, match="NaN or infinite"):
                    await session.append(bad)
        await session.finish()

    await asyncio.gather(*(feed(s, p, i == 0) for i, (s, p) in enumerate(zip(sessions, pcms))))
    for link, pcm in zip(links, pcms):
        slots = np.concatenate([mel for mel, _, _ in link.audio]).reshape(-1, 128)
        np.testing.assert_allclose(slots, audio.offline_features(pcm, 6), atol=1e-6)
        assert sum(samples for _, samples, _ in link.audio) == pcm.size
        assert link.audio[-1][2] == slots.shape[0] // 8 and not link.aborted


async def test_abort_while_the_append_is_queued(worker):
    link = _RecordingLink()
    session = session_on(worker, link)
    gate, blocker = await hold(worker)
    append = asyncio.create_task(session.append(recordings(1)[0]))
    await asyncio.sleep(0)  # the append is now waiting for the worker
    await session.abort("client_gone")
    gate.set()
    await blocker
    await append  # returns quietly: the session ended while it waited
    assert link.aborted == ["client_gone"] and link.audio == [] and session.outcome == "client_gone"
    assert session._front.log_mel.samples_received == 0  # noqa: SLF001 - its queued work was skipped


async def test_a_cancelled_append_or_finish_still_hands_its_audio_on(worker):
    """The front end takes an append's audio once it has it, so an append cancelled meanwhile (a caller's
    timeout) still sends its slots, in order, and a cancelled finish still ends the stream: a dropped
    append left a hole the engine waited on forever."""
    pcm = recordings(1, seed=4)[0]
    link = _RecordingLink()
    session = session_on(worker, link)
    await session.append(pcm[:9000])  # the prompt
    gate, blocker = await hold(worker)
    cancelled = asyncio.create_task(session.append(pcm[9000:12000]))
    await asyncio.sleep(0)  # waiting for the worker
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    later = asyncio.create_task(session.append(pcm[12000:]))
    gate.set()
    await blocker
    await later
    ending = asyncio.create_task(session.finish())
    await asyncio.sleep(0)
    ending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ending
    for _ in range(500):  # the end goes out when the worker has done it
        if link.audio[-1][2] is not None:
            break
        await asyncio.sleep(0.01)
    slots = np.concatenate([mel for mel, _, _ in link.audio]).reshape(-1, 128)
    np.testing.assert_allclose(slots, audio.offline_features(pcm, 6), atol=1e-6)
    assert sum(samples for _, samples, _ in link.audio) == pcm.size and link.audio[-1][2] == slots.shape[0] // 8


async def test_an_append_cancelled_while_waiting_for_room_still_hands_its_slots_on(worker):
    link = _RecordingLink()
    session = session_on(worker, link, max_queued_slots=1)  # no engine consumes: the second append waits
    pcm = recordings(1, seed=5)[0]
    await session.append(pcm[:9000])  # a lone append always fits
    waiting = asyncio.create_task(session.append(pcm[9000:12000]))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if session.backlog.waiting:
            break
    assert session.backlog.waiting and len(link.audio) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(link.audio) == 2 and session.backlog.sent == sum(len(mel) for mel, _, _ in link.audio)


async def test_a_finish_cancelled_while_an_append_waits_for_room_still_ends_the_stream(worker):
    """finish() waits for the order lock behind an append that waits for room; a caller's timeout there
    used to lose the end for good (and a second finish() returned at once): the engine never learnt where
    the stream ends."""
    link = _RecordingLink()
    session = session_on(worker, link, max_queued_slots=1)  # no engine consumes: the second append waits
    pcm = recordings(1, seed=5)[0]
    await session.append(pcm[:9000])
    waiting = asyncio.create_task(session.append(pcm[9000:12000]))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if session.backlog.waiting:
            break
    ending = asyncio.create_task(session.finish())
    await asyncio.sleep(0.01)
    ending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ending
    waiting.cancel()  # the append hands its slots on and lets the end follow
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(session.finish(), timeout=30)  # waits for the same end
    slots = np.concatenate([mel for mel, _, _ in link.audio]).reshape(-1, 128)
    np.testing.assert_allclose(slots, audio.offline_features(pcm[:12000], 6), atol=1e-6)
    assert link.audio[-1][2] == slots.shape[0] // 8 and [t for _, _, t in link.audio[:-1]] == [None, None]
    with pytest.raises(SessionClosedError):
        await session.append(pcm[12000:])


async def test_a_loud_resampled_session_ends_with_all_its_slots(worker):
    """Through a session: the end of an 8 kHz stream at the largest accepted magnitude reaches the engine
    with the stream's total slot count (it once failed in the front end, and the engine waited forever)."""
    link = _RecordingLink()
    session = session_on(worker, link, sample_rate=8000)
    pcm = (audio.MAX_SAMPLE_MAGNITUDE * np.sign(np.sin(2 * np.pi * 700 * np.arange(8000) / 8000))).astype(np.float32)
    for begin in range(0, pcm.size, 640):
        await session.append(pcm[begin:begin + 640])
    await asyncio.wait_for(session.finish(), timeout=30)
    slots = sum(len(mel) for mel, _, _ in link.audio)
    assert link.audio[-1][2] == slots and not link.aborted and session.outcome is None


class _BrokenEnd(audio.StreamingLogMel):
    """A front end whose end of stream fails (an unforeseen bug, as the unclipped resampler tail was)."""

    def __init__(self):
        super().__init__(n_delay=6)

    def finish(self):
        raise RuntimeError("the end of the stream broke")


async def test_a_front_end_failing_on_the_end_ends_the_session_with_an_error(worker):
    """The engine waits for a stream's end to finish it: when the front end fails there, the session must not
    stay live. It ends at once: its engine session is aborted (freed), its iterator raises an EngineError
    naming the failure, finish() returns, and it takes no more audio."""
    link = _RecordingLink()
    session = session_on(worker, link, log_mel=_BrokenEnd())
    await session.append(recordings(1, seed=6)[0])
    await asyncio.wait_for(session.finish(), timeout=30)
    with pytest.raises(EngineError, match="the end of its audio could not be processed .*the end of the stream broke"):
        async for _ in session:
            pass
    assert link.aborted == ["front_end_failed"] and all(total is None for _, _, total in link.audio)
    assert isinstance(session.outcome, EngineError)
    with pytest.raises(SessionClosedError):
        await session.append(np.zeros(160, np.float32))
