"""The minimum rate of request bodies read before admission (serving/limits.py `read_at_min_rate`), after
Apache's mod_reqtimeout `body=20,MinRate=500`: the body must be in by the grace period plus one second per
MinRate bytes received, else 408 and the connection closes. It applies to every body a route reads before it
admits a stream or that no limit counts (an upload's form, a Mode A request's first line on either route, a JSON
body: a completion, a Mode B session's creation or chunk); a Mode A first line is timed from its first byte, a
client's silence before it being the idle timeout's to bound. `body_min_rate = 0` turns the rule off. Trickling
clients are raw asyncio sockets; the server runs with a grace of a fraction of a second so that no test waits
for the real 20 s. Last, a body read (http_errors.body_read) honours a cancel that comes as its data does."""
import asyncio
import base64
import http.client
import io
import json
import time

import aiohttp
import numpy as np
import pytest
import soundfile

from jaxstream.serving.config import ServerConfig
from jaxstream.serving.http_errors import body_read
from jaxstream.serving.http_sessions import PREFIX as SESSIONS
from jaxstream.serving.limits import Limits, SlowBody, read_at_min_rate
from jaxstream.serving.testing import ServerThread
from serve_fixtures import audio, engine, engine_returns_to_baseline  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

GRACE_S = 0.3
MIN_RATE = 20_000  # bytes/s
# A trickling client gives up after this long without an answer: the idle timeout (150 s) never fires first,
# so without the rule no answer comes.
GIVE_UP_S = 20.0
TRICKLE_EVERY_S = 0.1  # one byte each time: 10 B/s, far under MIN_RATE
FORM = "multipart/form-data; boundary=XyZ"


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(body_grace_s=GRACE_S, body_min_rate=MIN_RATE)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def pcm16(audio):
    """The sample as the server receives it (PCM16)."""
    return np.round(np.clip(audio, -1, 1 - 2**-15) * 32768).astype(np.int16)


@pytest.fixture(scope="module")
def reference(engine, pcm16):
    return asyncio.run(engine.transcribe(pcm16.astype(np.float32) / 32768))


def _wav(pcm16: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm16, 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _upload(model: str, wav: bytes) -> bytes:
    return (b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + model.encode() + b"\r\n"
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + wav + b"\r\n--XyZ--\r\n")


async def _answer(reader: asyncio.StreamReader) -> tuple[str, dict, dict]:
    """The status line, headers (lower-case names) and JSON body of one response with a Content-Length."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in head[1:] if line)}
    return head[0], headers, json.loads(await reader.readexactly(int(headers["content-length"])))


async def _trickle(server, path: str, headers: str, first: bytes, chunked: bool, late_s: float = 0.0):
    """Sends the head of a POST to `path` and, `late_s` later, `first` body bytes, then one more byte every
    TRICKLE_EVERY_S until an answer comes (or GIVE_UP_S passes: an AssertionError). Then ends the body and checks
    the server closes the connection. Returns the answer."""
    host, port = server.url("", "http").removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    announced = len(first) + 1000  # with Content-Length: more than the trickle ever sends

    def framed(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data

    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {announced}"
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}{framing}\r\n\r\n".encode())
    if late_s:
        await writer.drain()
        await asyncio.sleep(late_s)
    writer.write(framed(first))
    sent = len(first)

    async def trickle():
        nonlocal sent
        while True:
            await asyncio.sleep(TRICKLE_EVERY_S)
            writer.write(framed(b"a"))
            sent += 1
            await writer.drain()

    trickler = asyncio.create_task(trickle())
    try:
        try:
            answer = await asyncio.wait_for(_answer(reader), GIVE_UP_S)
        except TimeoutError:
            raise AssertionError(f"no answer to a body trickled for {GIVE_UP_S:g} s") from None
        finally:
            trickler.cancel()
            await asyncio.gather(trickler, return_exceptions=True)
        # The body's end: aiohttp stops reading what is left of it (its lingering close) and closes at once.
        writer.write(b"0\r\n\r\n" if chunked else b"a" * (announced - sent))
        assert await asyncio.wait_for(reader.read(), 30) == b"", "the connection stayed open"
        return answer
    finally:
        writer.close()


JSON = "Content-Type: application/json\r\n"
MODE_A = "Content-Type: application/json\r\nX-Streaming-Input: true\r\n"
# What each route reads before it admits a stream, or in a request that no limit counts: (path, headers, the
# body's first bytes). The completion routes read their body before they look at the model: this server's
# speech model answers them as a text model's server would.
BODIES = {
    "upload": ("/v1/audio/transcriptions", f"Content-Type: {FORM}\r\n", None),
    "streaming input": ("/v1/audio/transcriptions", MODE_A, b'{"model": "'),
    "completion": ("/v1/completions", JSON, b'{"model": "m", "prompt": "'),
    "completion streaming input": ("/v1/completions", MODE_A, b'{"model": "'),
    "session": (SESSIONS, JSON, b'{"modality": "'),
    "session chunk": (None, JSON, b'{"sequence_id": 0, "payload": "'),
}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("kind", list(BODIES))
async def test_a_trickled_body_is_a_408_that_closes_the_connection(server, pcm16, kind, chunked):
    """A body that arrives a byte at a time held its connection forever: the idle timeout (150 s) is per read,
    and each byte is a read. Before admission nothing counts such a request against any limit, so a few
    thousand of them exhaust the server's sockets; a Mode B chunk or a completion's JSON (up to 4 MB) is never
    counted at all. Now each of them falls behind the minimum rate after the grace period: 408 with
    `Connection: close` (RFC 9110 15.5.9), and the connection closes."""
    model = server.state.model_id
    path, headers, first = BODIES[kind]
    first = first or _upload(model, _wav(pcm16))[:300]
    async with aiohttp.ClientSession() as http:
        if path is None:  # a chunk of an open session
            async with http.post(server.url(SESSIONS, "http"), json={}) as response:
                assert response.status == 201
                session = (await response.json())["session_id"]
            path = f"{SESSIONS}/{session}/chunks"
        try:
            status, response_headers, answer = await _trickle(server, path, headers, first, chunked)
        finally:
            if kind == "session chunk":  # the session's input, so that it ends
                chunk = {"sequence_id": 0, "payload": base64.b64encode(pcm16[:8000].tobytes()).decode(),
                         "end_of_input": True}
                async with http.post(server.url(path, "http"), json=chunk) as response:
                    assert response.status == 202, await response.text()
    assert status == "HTTP/1.1 408 Request Timeout", (status, answer)
    assert response_headers["connection"].lower() == "close"
    assert answer["error"]["code"] == "body_too_slow" and answer["error"]["type"] == "invalid_request_error"
    assert f"{MIN_RATE} bytes/s" in answer["error"]["message"]


# -- Mode A's first line: timed from its first byte ---------------------------------------------------------
LATE_S = 4 * GRACE_S  # a client silent this long after opening its request: past the grace, under the idle timeout
MODE_A_ROUTES = {"audio": "/v1/audio/transcriptions", "text": "/v1/completions"}


def _post_late(server, path: str, body: bytes, late_s: float) -> tuple[int, bytes]:
    """POSTs a chunked Mode A request whose body (one chunk) starts `late_s` after its head, with http.client
    (the standard library's HTTP client: it sends the head at endheaders and decodes the chunked answer)."""
    host, port = server.url("", "http").removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=GIVE_UP_S)
    try:
        connection.putrequest("POST", path)
        for name, value in (("X-Streaming-Input", "true"), ("Content-Type", "application/x-ndjson"),
                            ("Transfer-Encoding", "chunked")):
            connection.putheader(name, value)
        connection.endheaders()  # the head goes out now: the server's handler starts reading the body
        time.sleep(late_s)  # nobody speaks yet
        connection.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("route", list(MODE_A_ROUTES))
async def test_a_mode_a_first_line_that_comes_late_but_fast_is_read(server, pcm16, reference, route):
    """The parameters line is optional (spec §7.1): a push-to-talk or VAD-gated client opens its request and sends
    its first line, its first audio, once someone speaks. The minimum rate's clock started with the request, so
    such a client was cut with a 408 `body_too_slow` once it had been silent for the grace period (20 s by
    default), a line sent at full speed included; its silence is the idle timeout's to bound, as it was before the
    rule. The audio route transcribes the line as `engine.transcribe` does; the text route, reading the same body,
    answers as it does to any Mode A line of this speech model's server (400 unsupported_model)."""
    line = json.dumps({"payload": base64.b64encode(pcm16.tobytes()).decode(), "end_of_input": True}).encode()
    status, body = await asyncio.to_thread(_post_late, server, MODE_A_ROUTES[route], line + b"\n", LATE_S)
    if route == "text":
        answer = json.loads(body)
        assert (status, answer["error"]["code"]) == (400, "unsupported_model"), answer
        return
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == reference.text, events[-1]


@pytest.mark.parametrize("kind", ["streaming input", "completion streaming input"])
async def test_a_mode_a_first_line_that_starts_late_and_trickles_is_a_408(server, kind):
    """The first line's clock starts at its first byte, not never: a line that starts late and then trickles
    falls behind the minimum rate as one that starts at once (test_a_trickled_body_is_a_408...)."""
    path, headers, first = BODIES[kind]
    status, response_headers, answer = await _trickle(server, path, headers, first, chunked=True, late_s=LATE_S)
    assert status == "HTTP/1.1 408 Request Timeout", (status, answer)
    assert answer["error"]["code"] == "body_too_slow" and response_headers["connection"].lower() == "close"


async def test_an_upload_above_the_minimum_rate_is_transcribed(server, pcm16, reference):
    """Pieces of the form 50 ms apart, 8 times the minimum rate and well past the grace period (a slow link):
    the upload is answered as any other."""
    body, piece = _upload(server.state.model_id, _wav(pcm16)), MIN_RATE // 20 * 8

    async def paced():
        for start in range(0, len(body), piece):
            yield body[start:start + piece]
            await asyncio.sleep(0.05)

    assert len(body) / (piece * 20) > 2 * GRACE_S  # the upload outlasts the grace period
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=paced(),
                             headers={"Content-Type": FORM}) as response:
            answer = await response.json()
    assert response.status == 200 and answer["text"] == reference.text, answer


async def test_a_streamed_request_is_paced_by_its_client_once_admitted(server, pcm16, reference):
    """Mode A's lines after the first are live audio, paced by the client (one that sends only while someone
    speaks pauses for as long as nobody does): no minimum rate applies to them. Here the audio starts a
    second after the parameters line, when the rule would have cut the body at GRACE_S."""
    lines = [{"model": server.state.model_id}]
    lines += [{"payload": base64.b64encode(pcm16[i:i + 8000].tobytes()).decode()} for i in range(0, pcm16.size, 8000)]
    lines.append({"end_of_input": True})

    async def body():
        yield json.dumps(lines[0]).encode() + b"\n"
        await asyncio.sleep(1.0)
        for line in lines[1:]:
            yield json.dumps(line).encode() + b"\n"

    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=body(),
                             headers={"X-Streaming-Input": "true"}) as response:
            assert response.status == 200
            text = (await response.read()).decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == reference.text, events[-1]


# -- the rule itself --------------------------------------------------------------------------------------------
class _Body:
    """A request body fed by the test: `read()` returns it all at its end; `received` counts what came."""

    def __init__(self):
        self.received, self.cancelled = 0, False
        self._stream = asyncio.StreamReader()

    def feed(self, data: bytes, end: bool = False) -> None:
        self.received += len(data)
        self._stream.feed_data(data)
        if end:
            self._stream.feed_eof()

    async def read(self) -> bytes:
        try:
            return await self._stream.read()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_bytes_received_extend_the_deadline():
    """mod_reqtimeout's rule: each MinRate bytes received add one second to the grace period. 3,000 bytes at
    1,000 B/s earn 3 s, so a body that then pauses for a second (past its 0.2 s of grace) is not cut."""
    limits, body = Limits(body_grace_s=0.2, body_min_rate=1000), _Body()

    async def client():
        body.feed(b"x" * 3000)
        await asyncio.sleep(1.0)
        body.feed(b"y", end=True)

    feeder = asyncio.create_task(client())
    assert await read_at_min_rate(body.read(), limits, lambda: body.received) == b"x" * 3000 + b"y"
    await feeder


async def test_a_body_behind_the_rate_is_cut_and_its_read_cancelled():
    """100 bytes at 1,000 B/s earn 0.1 s: a body that sends nothing more is cut at about 0.3 s; the pending
    read is cancelled, not left running."""
    limits, body = Limits(body_grace_s=0.2, body_min_rate=1000), _Body()
    body.feed(b"x" * 100)
    with pytest.raises(SlowBody, match="1000 bytes/s"):
        await asyncio.wait_for(read_at_min_rate(body.read(), limits, lambda: body.received), GIVE_UP_S)
    assert body.cancelled


async def test_from_the_first_byte_the_clock_waits_for_one():
    """With from_first_byte (a Mode A first line) the grace period starts at the body's first byte: a body silent
    for 5 times its grace, then complete at once, is read; the same body without the option is cut."""
    limits = Limits(body_grace_s=0.2, body_min_rate=1000)

    async def late(body: _Body) -> None:
        await asyncio.sleep(1.0)
        body.feed(b"x" * 100, end=True)

    body = _Body()
    feeder = asyncio.create_task(late(body))
    assert await read_at_min_rate(body.read(), limits, lambda: body.received, from_first_byte=True) == b"x" * 100
    await feeder
    body = _Body()
    feeder = asyncio.create_task(late(body))
    with pytest.raises(SlowBody):
        await read_at_min_rate(body.read(), limits, lambda: body.received)
    feeder.cancel()


async def test_from_the_first_byte_a_body_behind_the_rate_is_still_cut():
    """After its first byte the rule is mod_reqtimeout's as ever: 100 bytes that come late and are not followed
    by the rest are cut, the read cancelled."""
    limits, body = Limits(body_grace_s=0.2, body_min_rate=1000), _Body()

    async def late() -> None:
        await asyncio.sleep(0.5)
        body.feed(b"x" * 100)

    feeder = asyncio.create_task(late())
    with pytest.raises(SlowBody, match="1000 bytes/s"):
        await asyncio.wait_for(read_at_min_rate(body.read(), limits, lambda: body.received, from_first_byte=True),
                               GIVE_UP_S)
    assert body.cancelled
    await feeder


async def test_a_minimum_rate_of_0_is_no_rule():
    """TOML has no null, so `body_min_rate = 0` is how a server file turns the rule off (mod_reqtimeout's
    `MinRate` is likewise off unless set); it was refused as not positive. A body that sends nothing for 5 times
    its grace period is then read."""
    assert Limits(body_min_rate=0) == Limits(body_min_rate=None)
    with pytest.raises(ValueError, match="positive"):
        Limits(body_min_rate=-1)
    limits, body = Limits(body_grace_s=0.1, body_min_rate=0), _Body()

    async def late() -> None:
        await asyncio.sleep(0.5)
        body.feed(b"x", end=True)

    feeder = asyncio.create_task(late())
    assert await read_at_min_rate(body.read(), limits, lambda: body.received) == b"x"
    await feeder


async def test_a_read_that_swallows_its_cancel_is_cancelled_again():
    """A read may swallow a cancel (Python 3.11's wait_for, each body_read's until it used asyncio.timeout, drops
    one that comes as its inner read completes) and go on: a Mode A request trickling its first line sometimes
    got no answer for the idle timeout, its read cancelled once and still waiting for the line's end. Here the
    read swallows its first cancel as wait_for did; it is cancelled again and the body is cut all the same."""
    limits, attempts = Limits(body_grace_s=0.1, body_min_rate=1000), []

    async def read():
        try:
            await asyncio.sleep(GIVE_UP_S)
        except asyncio.CancelledError:
            attempts.append("swallowed")
        try:
            await asyncio.sleep(GIVE_UP_S)
        except asyncio.CancelledError:
            attempts.append("cancelled")
            raise

    with pytest.raises(SlowBody):
        await asyncio.wait_for(read_at_min_rate(read(), limits, lambda: 0), GIVE_UP_S / 2)
    assert attempts == ["swallowed", "cancelled"]


# -- a body read and its cancel ---------------------------------------------------------------------------
async def test_a_cancel_that_comes_with_the_data_ends_the_reader():
    """asyncio's contract: a task whose cancel() returned True gets CancelledError at its await. Python 3.11's
    wait_for (body_read's) broke it when the cancel came in the loop iteration that completed its inner read:
    it returned the data and dropped the cancel, so a reader looping over a body (Mode A's, which end_request
    cancels when the stream ends) went on to its next read, and the request waited for the idle timeout
    (150 s) to end. Here the data and the cancel come together, as they do when a line arrives just as the
    stream ends; the reader must end at once. (Python 3.12's wait_for is built on asyncio.timeout: there the
    old code passes too.)"""
    body, reads = asyncio.StreamReader(), []

    async def reader():
        while data := await body_read(body.read(100), Limits()):
            reads.append(data)

    task = asyncio.create_task(reader())
    for _ in range(3):
        await asyncio.sleep(0)  # the reader, and wait_for's inner read if any, wait for data
    body.feed_data(b"x")  # the data arrives ...
    assert task.cancel()  # ... in the same loop iteration as the cancel
    try:
        await asyncio.wait([task], timeout=GIVE_UP_S)
        assert task.cancelled(), f"the reader went on to read again after {reads}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
