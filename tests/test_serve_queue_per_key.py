"""One client key (an API key, or an address without keys) cannot hold the server's request queue
(serving/request_queue.py): turns go round the keys, first come first served within each, and at a full queue the
key holding the most places gives its newest up to another key's newcomer. A key's queued requests count against
`max_streams_per_key` (limits.KeyLimits). Over its share a key gets the 429 `rate_limit_exceeded` with Retry-After
of the other per-key limits."""
import asyncio
import base64
import contextlib

import aiohttp
import pytest

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.limits import Limits
from jaxstream.serving.request_queue import OverShare, RequestQueue
from jaxstream.serving.testing import ServerThread, shared_engine, wait_engine_baseline, wait_until
from test_serve_http_completions import text_engine_with_tokenizer
from test_serve_request_queue import waiting, wav_bytes


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer."""
    engine = text_engine_with_tokenizer(tmp_path_factory)
    yield engine
    engine.close()


# -- the queue itself ---------------------------------------------------------------------------------------------
class Room:
    """Places a test hands out one at a time; `served` lists who took them, in order."""

    def __init__(self):
        self.free, self.served = 0, []

    def attempt_for(self, name):
        async def attempt():
            if self.free:
                self.free -= 1
                self.served.append(name)
                return name
            return None
        return attempt

    async def hand_out(self, count: int) -> None:
        for _ in range(count):
            taken = len(self.served)
            self.free += 1
            await wait_until(lambda: len(self.served) > taken, 5)


def arrive(queue, room, name, **kwargs) -> asyncio.Task:
    """`name` (its key: its first letter) asks `queue` for a place; queued once the caller yields."""
    return asyncio.create_task(queue.take(room.attempt_for(name), wait_s=30, key=name[0], **kwargs))


async def test_turns_go_round_the_keys_first_come_first_served_within_each():
    queue, room = RequestQueue(), Room()
    tasks = []
    for name in ("a0", "a1", "a2", "a3", "b0", "b1", "c0"):
        tasks.append(arrive(queue, room, name))
        await asyncio.sleep(0)  # each is queued before the next arrives
    assert len(queue) == 7
    await room.hand_out(2)  # a0, then b0: a's three others came before it, but b had no turn yet
    tasks.append(arrive(queue, room, "a4"))  # behind a's own, whatever came since
    tasks.append(arrive(queue, room, "d0"))  # a newcomer plays in the current round, after the ones already in it
    await asyncio.sleep(0)
    await room.hand_out(7)
    assert await asyncio.gather(*tasks) == ["a0", "a1", "a2", "a3", "b0", "b1", "c0", "a4", "d0"]  # each its own
    assert room.served == ["a0", "b0", "c0", "d0", "a1", "b1", "a2", "a3", "a4"]
    assert len(queue) == 0


async def test_a_full_queue_takes_a_newcomer_from_the_key_holding_most():
    queue, room = RequestQueue(), Room()
    flood = []
    for n in range(4):
        flood.append(arrive(queue, room, f"a{n}", max_waiting=4))
        await asyncio.sleep(0)
    # A lone key may fill the queue, and is then refused as the server's capacity (None), not over a share.
    assert await queue.take(room.attempt_for("a4"), wait_s=30, max_waiting=4, key="a") is None
    b0 = arrive(queue, room, "b0", max_waiting=4)
    with pytest.raises(OverShare) as sent_away:
        await asyncio.wait_for(flood.pop(), 5)  # a's newest gave its place up to b's
    assert sent_away.value.displaced and (sent_away.value.held, sent_away.value.places) == (4, 4)
    with pytest.raises(OverShare) as refused:  # a holds 3 of 4 places while b waits: over its share
        await queue.take(room.attempt_for("a5"), wait_s=30, max_waiting=4, key="a")
    assert not refused.value.displaced and refused.value.held == 3
    others = [b0]
    for name in ("c0", "d0"):  # each takes a place of a's, until every key holds one
        others.append(arrive(queue, room, name, max_waiting=4))
        with pytest.raises(OverShare):
            await asyncio.wait_for(flood.pop(), 5)
    assert len(queue) == 4 and len(flood) == 1
    # Every key holds one place: a fifth key finds the server full; a key holding one is at its share.
    assert await queue.take(room.attempt_for("e0"), wait_s=30, max_waiting=4, key="e") is None
    with pytest.raises(OverShare):
        await queue.take(room.attempt_for("b1"), wait_s=30, max_waiting=4, key="b")
    await room.hand_out(4)
    assert await asyncio.gather(*flood, *others) == ["a0", "b0", "c0", "d0"] == room.served  # a0 the head


# -- over HTTP: completions at a server of one connection ---------------------------------------------------------
KEYS = ("key-a", "key-b", "key-c")
SESSIONS = "/v1/streaming_input/sessions"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


class Client:
    """Completions, each as the key its name starts with; those the server answered in `served`, in that order."""

    def __init__(self, http, server):
        self.http, self.server = http, server
        self.served, self.tasks = [], []

    def waiting(self) -> float:
        return waiting(self.server)

    def send(self, name: str) -> asyncio.Task:
        self.tasks.append(asyncio.create_task(self.complete(name)))
        return self.tasks[-1]

    async def cancel(self) -> None:
        """Cancels what a failed test left waiting."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def complete(self, name: str) -> tuple:
        async with self.http.post(self.server.url("/v1/completions", "http"), headers=bearer(f"key-{name[0]}"), json={
                "prompt": "w5 w17", "max_tokens": 16, "temperature": 0, "ignore_eos": True}) as response:
            answer = await response.json()
            if response.status == 200:
                self.served.append(name)
                return 200, answer["choices"][0]["text"]
            return response.status, answer["error"]["type"], answer["error"]["code"], response.headers["Retry-After"]

    async def hold_the_connection(self) -> str:
        """A Mode B session of key c, the server's one connection while its input stays open; its path."""
        async with self.http.post(self.server.url(SESSIONS, "http"), headers=bearer("key-c"), json={
                "model": self.server.state.model_id, "modality": "text",
                "params": {"max_tokens": 2, "ignore_eos": True}}) as response:
            assert response.status == 201, await response.text()
            return f"{SESSIONS}/{(await response.json())['session_id']}"

    async def release(self, session: str) -> None:
        async with self.http.post(self.server.url(session + "/chunks", "http"), headers=bearer("key-c"), json={
                "sequence_id": 0, "modality": "text", "payload": base64.b64encode(b"w5").decode(),
                "end_of_input": True}) as response:
            assert response.status == 202, await response.text()


RATE_LIMITED = (429, "rate_limit_error", "rate_limit_exceeded", "1")


@contextlib.asynccontextmanager
async def client_of(engine, limits: Limits):
    """A Client of a server over `engine` that takes KEYS; what a test leaves waiting is cancelled."""
    server = ServerThread(engine, ServerConfig(api_keys=KEYS, limits=limits))
    try:
        async with aiohttp.ClientSession() as http:
            client = Client(http, server)
            try:
                yield client
            finally:
                await client.cancel()
    finally:
        server.close()
    await wait_engine_baseline(engine)


async def test_one_keys_flood_neither_fills_the_queue_nor_holds_another_key_back(engine):
    """No per-key limit: key a's four requests fill the queue (four places a connection); key b's one still gets a
    place, a's newest giving its own up, and is served right after a's first, not behind all of a's. It used to be
    refused with 429 `capacity`, as every other client was while a's batch waited."""
    async with client_of(engine, Limits(max_connections=1)) as client:
        session = await client.hold_the_connection()
        flood = []
        for n in range(4):
            flood.append(client.send(f"a{n}"))
            await wait_until(lambda: client.waiting() == n + 1, 30)
        # Only a waits: its next is refused as the server's capacity, as before.
        assert (await client.complete("a4"))[::2] == (429, "capacity")
        b0 = client.send("b0")
        assert await asyncio.wait_for(flood.pop(), 30) == RATE_LIMITED  # a's newest gave its place to b0
        assert client.waiting() == 4
        assert await client.complete("a5") == RATE_LIMITED  # a holds 3 of the 4 places while b waits
        await client.release(session)
        answers = await asyncio.wait_for(asyncio.gather(*flood, b0), 60)
        assert client.served == ["a0", "b0", "a1", "a2"] and client.waiting() == 0
        assert len(set(answers)) == 1 and answers[0][0] == 200, answers


async def test_a_keys_waiting_requests_count_against_its_streams(engine):
    """`max_streams_per_key` 2: key a's two waiting requests are its two streams, its third is refused at once; key
    b's request, which came after them, is served after a's first, not after both."""
    async with client_of(engine, Limits(max_connections=1, max_streams_per_key=2)) as client:
        session = await client.hold_the_connection()
        queued = []
        for n, name in enumerate(("a0", "a1", "b0")):
            queued.append(client.send(name))
            await wait_until(lambda: client.waiting() == n + 1, 30)
        assert await client.complete("a2") == RATE_LIMITED and client.waiting() == 3
        await client.release(session)
        answers = await asyncio.wait_for(asyncio.gather(*queued), 60)
        assert client.served == ["a0", "b0", "a1"] and all(answer[0] == 200 for answer in answers), answers


# -- over HTTP: uploads waiting for an engine session -------------------------------------------------------------
async def test_uploads_waiting_for_an_engine_session_take_turns_by_key():
    """Every engine session held (by realtime streams): key a's two uploads wait, then key b's. The first session
    freed goes to a's first, the second to b's, not to a's second, which came before it."""
    engine = shared_engine()
    server = ServerThread(engine, ServerConfig(api_keys=KEYS))
    held = [await engine.start_transcription() for _ in range(engine.max_live_sessions - engine.live_sessions)]
    uploads = {}
    try:
        async with aiohttp.ClientSession() as http:
            async def transcribe(key):
                form = aiohttp.FormData()
                form.add_field("file", wav_bytes(), filename="sample.wav", content_type="audio/wav")
                form.add_field("model", server.state.model_id)
                async with http.post(server.url("/v1/audio/transcriptions", "http"), data=form,
                                     headers=bearer(key)) as response:
                    return response.status, await response.json()

            for n, name in enumerate(("a0", "a1", "b0")):
                uploads[name] = asyncio.create_task(transcribe(f"key-{name[0]}"))
                await wait_until(lambda: waiting(server) == n + 1, 30)
            for left in (2, 1):
                await held.pop().abort()
                await wait_until(lambda: waiting(server) == left, 30)
            status, answer = await asyncio.wait_for(uploads["b0"], 60)  # a1 waits for a third session meanwhile
            assert status == 200 and answer["text"] and not uploads["a1"].done(), answer
            assert await asyncio.wait_for(uploads["a0"], 60) == (200, answer)
            await held.pop().abort()
            assert await asyncio.wait_for(uploads["a1"], 60) == (200, answer)
    finally:
        for task in uploads.values():
            task.cancel()
        for session in held:
            await session.abort()
        server.close()
    await wait_engine_baseline(engine)
