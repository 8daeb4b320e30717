"""Random client behaviour against one `TranscriptionSession` and the real front-end worker, with a recording
link in place of the engine (which never consumes, so the backlog bound bites): appends of any size that are
awaited, refused for backlog (`wait=False`), refused as bad audio, or cancelled mid-flight; then a finish (maybe
cancelled) or an abort. The oracle: the slots the link received are exactly `offline_features` of the audio the
session accepted, in order, with the stream's end, or nothing after an abort. Then random clients through the
tiny engine itself, whose transcripts must equal their accepted audio's. Both ways a stream used to hang forever
(a refused or a cancelled append dropping slots the front end had already taken) fail both tests."""
import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.audio_front_end import FrontEndWorker
from jaxstream.engine.config import EngineConfig
from jaxstream.errors import BacklogError, InvalidAudioError, InvalidRequestError
from jaxstream.models import audio
from jaxstream.models.loading import BUILTIN_MODELS
from test_engine_front_end import _RecordingLink, session_on

N_DELAY = 6  # session_on's (480 ms)


appends = st.lists(st.tuples(st.integers(0, 12000), st.sampled_from(["await", "nowait", "cancel", "bad"])),
                   min_size=1, max_size=8)


async def _drive(steps, ending, max_queued, limit, seed):
    rng = np.random.default_rng(seed)
    worker, link = FrontEndWorker(), _RecordingLink()
    session = session_on(worker, link, max_queued_slots=max_queued, max_audio_seconds=limit)
    accepted = []
    try:
        for size, how in steps:
            pcm = (0.1 * rng.standard_normal(size)).astype(np.float32)
            # The session's own count of its audio decides this: refused and cancelled appends must keep it true.
            if limit is not None and (sum(p.size for p in accepted) + size) / audio.SAMPLING_RATE > limit:
                with pytest.raises(InvalidRequestError):
                    await session.append(pcm, wait=False)
            elif how == "bad" and size:
                pcm[size // 2] = np.nan
                with pytest.raises((InvalidAudioError, BacklogError)):  # refused whole, either way
                    await session.append(pcm, wait=False)
            elif how == "cancel":  # waits for the worker or for room (none comes), then is cancelled
                task = asyncio.create_task(session.append(pcm))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                accepted.append(pcm)  # the front end had it: it counts
            else:
                try:
                    await session.append(pcm, wait=how == "await" and max_queued >= 1000)
                except BacklogError:
                    continue  # refused whole
                accepted.append(pcm)
        if ending == "abort":
            await session.abort("test")
        else:
            task = asyncio.create_task(session.finish())
            await asyncio.sleep(0)
            if ending == "finish_cancelled":
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(1000):  # the end leaves from the worker's callback
                if link.audio and link.audio[-1][2] is not None:
                    break
                await asyncio.sleep(0.005)
    finally:
        worker.close()
    return link, accepted


@settings(max_examples=100, deadline=None)
@given(steps=appends, ending=st.sampled_from(["finish", "finish_cancelled", "abort"]),
       max_queued=st.sampled_from([3, 1000]), limit=st.sampled_from([None, 1.5]), seed=st.integers(0, 2**16))
def test_random_clients_get_exactly_the_features_of_the_audio_accepted(steps, ending, max_queued, limit, seed):
    link, accepted = asyncio.run(_drive(steps, ending, max_queued, limit, seed))
    if ending == "abort":
        assert link.aborted == ["test"] and all(total is None for _, _, total in link.audio)
        return
    pcm = np.concatenate(accepted) if accepted else np.zeros(0, np.float32)
    assert link.audio and link.audio[-1][2] is not None, "the stream's end never reached the engine"
    slots = np.concatenate([mel for mel, _, _ in link.audio]).reshape(-1, audio.NUM_MEL_BINS)
    assert sum(samples for _, samples, _ in link.audio) == pcm.size
    assert link.audio[-1][2] == slots.shape[0] // audio.MEL_FRAMES_PER_SLOT
    np.testing.assert_allclose(slots, audio.offline_features(pcm, N_DELAY), rtol=0, atol=1e-6)


SAMPLE = audio.load_audio(BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav")


async def _client(session, rng) -> tuple[np.ndarray | None, str]:
    """One random client of the bundled sample: returns the audio its session accepted (None: it aborted)
    and what it did, for a failure's message."""
    accepted, done, log = [], 0, []
    while done < SAMPLE.size:
        piece = SAMPLE[done:done + int(rng.integers(0, 8000))]
        how = rng.choice(["await", "nowait", "cancel", "abort"], p=[0.55, 0.2, 0.2, 0.05])
        log.append(f"{how} {piece.size}")
        if how == "abort":
            await session.abort("client_gone")
            return None, " ".join(log)
        if how == "cancel":  # after its audio reached the front end (the first await), or after it returned
            task = asyncio.create_task(session.append(piece))
            await asyncio.sleep(float(rng.choice([0, 0.001, 0.01])))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            try:
                await session.append(piece, wait=how == "await")
            except BacklogError:
                continue  # refused whole: sent again in a later step
        accepted.append(piece)
        done += piece.size
    await session.finish()
    return np.concatenate(accepted), " ".join(log)


async def _last_event(session):
    return [event async for event in session][-1]


async def test_random_clients_through_the_engine_get_the_transcript_of_what_they_sent():
    """Three random clients at a time on the tiny engine (its backlog bound 0.5 s, so appends wait for the
    engine and are refused by it): every one that finished gets the tokens of its accepted audio transcribed
    alone; none stalls (a round's appends, and each transcript, must end within 60 s)."""
    engine = AsyncEngine.from_pretrained("tiny", EngineConfig(max_sessions=3, max_queued_audio_seconds=0.5))
    try:
        for seed in range(4):
            sessions = [await engine.start_transcription() for _ in range(3)]
            results = await asyncio.wait_for(asyncio.gather(
                *(_client(s, np.random.default_rng([seed, i])) for i, s in enumerate(sessions))), 60)
            for session, (sent, log) in zip(sessions, results):
                if sent is None:
                    assert session.outcome == "client_gone"
                    continue
                tokens = (await asyncio.wait_for(_last_event(session), 60)).token_ids
                expected = (await engine.transcribe(sent)).token_ids
                assert tokens == expected, f"seed {seed}: {log}"
    finally:
        await engine.shutdown()
