"""One-shot HTTP requests that find the server full wait their turn (serving/request_queue.py), as vLLM queues the
requests beyond its max_num_seqs: completions and chats at the connection limit, uploads at the engine's sessions.
First come, first served; up to `request_queue_s`, then the 429 / 503; a client that leaves gives its place up."""
import asyncio
import logging
import re

import aiohttp
import pytest

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.request_queue import RequestQueue
from jaxstream.serving.testing import ServerThread, sample_audio, shared_engine, wait_engine_baseline, wait_until
from test_serve_http_completions import engine as text_model_engine  # noqa: F401 - a pytest fixture


# -- the queue itself ---------------------------------------------------------------------------------------------
async def test_first_come_first_served_and_only_the_head_looks():
    queue, room, order, looks = RequestQueue(), [0], [], []

    def attempt_for(name):
        async def attempt():
            looks.append(name)
            if room[0]:
                room[0] -= 1
                return name
            return None
        return attempt

    async def request(name):
        order.append(await queue.take(attempt_for(name), wait_s=30))

    tasks = []
    for name in "abcd":
        tasks.append(asyncio.create_task(request(name)))
        await asyncio.sleep(0.01)  # each arrives after the one before
    await asyncio.sleep(0.2)
    assert len(queue) == 4 and set(looks) == {"a"}  # only the head looks: a newcomer queues behind it
    for _ in range(4):
        room[0] += 1
        await asyncio.sleep(0.12)
    await asyncio.gather(*tasks)
    assert order == list("abcd") and len(queue) == 0


async def test_a_request_that_gives_up_passes_its_turn_on():
    queue = RequestQueue()
    room = [False]

    async def attempt():
        return True if room[0] else None

    async def failing():
        raise RuntimeError("draining")

    head = asyncio.create_task(queue.take(attempt, wait_s=0.3))  # times out at the head
    await asyncio.sleep(0.01)
    gone = [False]
    second = asyncio.create_task(queue.take(attempt, wait_s=30, gone=lambda: gone[0]))
    await asyncio.sleep(0.01)
    third = asyncio.create_task(queue.take(failing, wait_s=30))
    await asyncio.sleep(0.01)
    fourth = asyncio.create_task(queue.take(attempt, wait_s=30))
    await asyncio.sleep(0.01)
    fifth = asyncio.create_task(queue.take(attempt, wait_s=30))
    assert await head is None
    gone[0] = True
    assert await asyncio.wait_for(second, 5) is None  # its client left: noticed within CHECK_S
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(third, 5)  # a refusal ends its wait, and the next one's turn comes
    fourth.cancel()
    await asyncio.gather(fourth, return_exceptions=True)
    room[0] = True
    assert await asyncio.wait_for(fifth, 5) is True
    assert len(queue) == 0
    # No wait: refused when another request waits, even with room (it would jump the queue).
    room[0] = False
    waiting = asyncio.create_task(queue.take(attempt, wait_s=30))
    await asyncio.sleep(0.01)
    room[0] = True
    assert await queue.take(attempt, wait_s=0) is None
    assert await asyncio.wait_for(waiting, 5) is True
    # A full waiting room refuses at once: each waiter holds the body it sent.
    room[0] = False
    waiters = [asyncio.create_task(queue.take(attempt, wait_s=30, max_waiting=2)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert len(queue) == 2 and await queue.take(attempt, wait_s=30, max_waiting=2) is None
    room[0] = True
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [True, True]


# -- completions at the connection limit --------------------------------------------------------------------------
def waiting(server) -> float:
    return server.state.metrics.registry.get_sample_value("jaxstream_http_requests_waiting")


async def test_completions_beyond_the_connection_limit_wait_their_turn(text_model_engine):
    """Five long completions, 50 ms apart, at a server of one connection: all answered, in the order they came, the
    gauge counting the waiting. They used to get 429 `capacity` at once."""
    server = ServerThread(text_model_engine, ServerConfig(limits=Limits(max_connections=1)))
    finished, most_waiting = [], 0
    try:
        async with aiohttp.ClientSession() as http:
            async def complete(n):
                async with http.post(server.url("/v1/completions", "http"), json={
                        "prompt": "w5 w17", "max_tokens": 200, "temperature": 0, "ignore_eos": True}) as response:
                    assert response.status == 200, await response.text()
                    finished.append(n)

            tasks = []
            for n in range(5):
                tasks.append(asyncio.create_task(complete(n)))
                await asyncio.sleep(0.05)
            while len(finished) < 5 and not any(task.done() and task.exception() for task in tasks):
                most_waiting = max(most_waiting, waiting(server))
                await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)
        assert finished == list(range(5)) and most_waiting >= 2 and waiting(server) == 0
    finally:
        server.close()
    await wait_engine_baseline(text_model_engine)


async def test_no_queue_refuses_at_once(text_model_engine):
    server = ServerThread(text_model_engine, ServerConfig(limits=Limits(max_connections=1, request_queue_s=0)))
    try:
        async with aiohttp.ClientSession() as http:
            async def complete():
                async with http.post(server.url("/v1/completions", "http"), json={
                        "prompt": "w5 w17", "max_tokens": 48, "temperature": 0, "ignore_eos": True}) as response:
                    return response.status, (await response.json()).get("error", {}).get("code")

            answers = await asyncio.gather(*(complete() for _ in range(4)))
        assert (200, None) in answers and (429, "capacity") in answers
    finally:
        server.close()
    await wait_engine_baseline(text_model_engine)


def test_request_queue_s_is_zero_or_more():
    for bad in (-1, None, True, float("inf")):
        with pytest.raises(ValueError, match="request_queue_s must be a number of seconds, 0 or more"):
            Limits(request_queue_s=bad)
    assert Limits(request_queue_s=0).request_queue_s == 0


# -- uploads at the engine's sessions ----------------------------------------------------------------------------
def wav_bytes() -> bytes:
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, sample_audio(), 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def test_an_upload_waits_for_an_engine_session_without_a_log_line_a_try(caplog):
    """Every engine session held (by realtime streams), an upload waits; it used to ask the engine every 50 ms, each
    refusal an INFO log line (1,200 a minute). Once a session ends, the upload takes it."""
    engine = shared_engine()
    server = ServerThread(engine)
    held = [await engine.start_transcription() for _ in range(engine.max_live_sessions - engine.live_sessions)]
    try:
        form = aiohttp.FormData()
        form.add_field("file", wav_bytes(), filename="sample.wav", content_type="audio/wav")
        form.add_field("model", server.state.model_id)
        async with aiohttp.ClientSession() as http:
            with caplog.at_level(logging.INFO):
                async def transcribe():
                    async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form) as response:
                        return response.status, await response.json()

                upload = asyncio.create_task(transcribe())
                await wait_until(lambda: waiting(server) == 1, 30)
                await asyncio.sleep(0.5)
                assert not upload.done()
                refusals = [r for r in caplog.records if re.search("rejected.*capacity", r.getMessage())]
                assert len(refusals) <= 1, [r.getMessage() for r in refusals]
                await held.pop().abort()
                status, answer = await asyncio.wait_for(upload, 60)
                assert status == 200 and answer["text"], answer
    finally:
        for session in held:
            await session.abort()
        server.close()
    await wait_engine_baseline(engine)
