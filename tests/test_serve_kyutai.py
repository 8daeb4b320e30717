"""Kyutai's STT protocol on `/api/asr-streaming` (specs/realtime_protocols.md §9), driven over loopback by a
`websockets` client speaking msgpack (the `msgpack` package, packed as Kyutai's Unmute client packs): words
and times against the engine's own result for the same audio, markers, steps, auth, "no free channels",
malformed frames and a hypothesis fuzz."""
import asyncio
import math
import re

import msgpack
import numpy as np
import pytest
import soxr
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as sync_connect

from jaxstream.errors import CapacityError
from jaxstream.serving.config import ServerConfig
from jaxstream.serving.kyutai import FRAME_SAMPLES, INPUT_RATE, ROUTE, WordStream
from jaxstream.serving.limits import Limits
from jaxstream.serving.testing import ServerThread, wait_engine_baseline
from jaxstream.transcription import word_timings
from serve_fixtures import audio, engine, engine_returns_to_baseline, server  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow

_KINDS = {"Ready": {"type"}, "Word": {"type", "text", "start_time"}, "EndWord": {"type", "stop_time"},
          "Step": {"type", "step_idx", "prs", "buffered_pcm"}, "Marker": {"type", "id"}, "Error": {"type", "message"}}


def packed(message, single_floats: bool = True) -> bytes:
    """As Unmute's client packs (f32 samples), or with doubles (values beyond f32)."""
    return msgpack.packb(message, use_bin_type=True, use_single_float=single_floats)


def unpacked(frame) -> dict:
    assert isinstance(frame, bytes), f"a text frame: {frame!r}"
    message = msgpack.unpackb(frame, raw=False)
    assert isinstance(message, dict) and set(message) == _KINDS[message["type"]], message
    return message


class KyutaiClient:
    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def connect(cls, server, query="", **kwargs) -> "KyutaiClient":
        # Unbounded receive queue: a test that stops reading (Steps keep coming) still sees the close.
        return cls(await websockets.connect(server.url(ROUTE) + query, max_size=None, max_queue=None, **kwargs))

    async def send(self, message) -> None:
        await self.ws.send(message if isinstance(message, (bytes, str)) else packed(message))

    async def audio(self, pcm: np.ndarray) -> None:
        for begin in range(0, pcm.size, FRAME_SAMPLES):
            await self.send({"type": "Audio", "pcm": pcm[begin:begin + FRAME_SAMPLES].tolist()})

    async def message(self, timeout: float = 30.0) -> dict:
        return unpacked(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, kind: str, skip=("Step",), timeout: float = 60.0) -> list[dict]:
        """Messages up to and including the first `kind` (those of types in `skip` left out)."""
        messages = []
        while True:
            message = await self.message(timeout)
            if message["type"] not in skip:
                messages.append(message)
            if message["type"] == kind:
                return messages

    async def close(self) -> None:
        await self.ws.close()


def at_24k(pcm16k: np.ndarray) -> np.ndarray:
    return soxr.resample(pcm16k, 16000, INPUT_RATE).astype(np.float32)


@pytest.fixture(scope="module")
def speech(audio):
    """The sample at 24 kHz, then 2 s of silence: enough trailing audio for a marker to come back."""
    return np.concatenate([at_24k(audio), np.zeros(2 * INPUT_RATE, np.float32)])


@pytest.fixture(scope="module")
def reference_words(engine, speech):
    """The engine's word timings for the same 24 kHz audio, through its own API."""
    async def run():
        session = await engine.start_transcription(sample_rate=INPUT_RATE)
        await session.append(speech)
        await session.finish()
        return [event async for event in session][-1].words

    return [(w.word, w.start, w.end) for w in asyncio.run(run())]


async def test_word_stream_gives_the_engine_words_whatever_the_deltas(engine):
    """`WordStream` over any split of any id sequence into deltas gives exactly `word_timings` of the whole
    sequence: the engine's words, which are the words of the text."""
    tokenizer = engine.tokenizer
    spaced = [i for i in range(1000, tokenizer.vocab_size) if tokenizer.token_bytes(i)[:1] == b" "
              and tokenizer.token_bytes(i)[1:2].isalpha()][:3]
    plain = [i for i in range(1000, tokenizer.vocab_size) if tokenizer.token_bytes(i)[:1].isalpha()][:3]
    ids = st.sampled_from([tokenizer.streaming_word_id, tokenizer.streaming_pad_id, *spaced, *plain])

    @settings(max_examples=100, deadline=None, database=None)
    @given(tokens=st.lists(ids, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
           audio=st.floats(0.0, 4.0))
    # Found by this test: shifting window times by a float offset moved a clamped time by a millisecond.
    @example(tokens=[tokenizer.streaming_word_id, spaced[0], spaced[0]], cuts=[3], audio=0.0025)
    @example(tokens=[tokenizer.streaming_word_id, plain[0], spaced[0]], cuts=[3], audio=0.0025)
    def check(tokens, cuts, audio):
        stream, words, start = WordStream(tokenizer), [], 0
        for cut in sorted(cuts):
            words += stream.push(tokens[start:max(start, cut)], audio)
            start = max(start, cut)
        words += stream.flush(tokens[start:], audio)
        assert words == word_timings(tokens, tokenizer, audio)
        # and they are the text's words: a marker inside a word does not split it
        assert [w.word for w in words] == tokenizer.decode(tokens).split()

    check()


async def test_words_with_times_then_the_marker(server, speech, reference_words):
    """Audio, a marker, trailing silence: every word with its times comes before the marker and equals the
    engine's own word timings; a Step per 80 ms frame, in order, with pause estimates that reach 1 in the
    silence."""
    client = await KyutaiClient.connect(server)
    assert await client.message() == {"type": "Ready"}
    talk = speech[:-2 * INPUT_RATE]
    await client.audio(talk)
    await client.send({"type": "Marker", "id": 7})
    await client.audio(speech[talk.size:])
    messages = await client.until("Marker", skip=())
    assert messages[-1] == {"type": "Marker", "id": 7}
    steps = [m for m in messages if m["type"] == "Step"]
    words = [m for m in messages if m["type"] in ("Word", "EndWord")]
    assert [m["type"] for m in words] == ["Word", "EndWord"] * (len(words) // 2)
    streamed = [(w["text"], w["start_time"], e["stop_time"]) for w, e in zip(words[::2], words[1::2])]
    assert reference_words and streamed == reference_words
    assert [s["step_idx"] for s in steps] == list(range(len(steps)))
    assert len(steps) <= speech.size // FRAME_SAMPLES
    assert all(len(s["prs"]) == 4 and all(0.0 <= p <= 1.0 for p in s["prs"]) for s in steps)
    assert any(s["prs"] == [0.0] * 4 for s in steps)  # while the sample speaks
    assert steps[-1]["prs"][0] == pytest.approx(1.0)  # 2 s of silence: past the 0.5 s horizon
    await client.close()


async def test_markers_come_back_in_order(server, speech):
    client = await KyutaiClient.connect(server)
    await client.message()
    await client.send({"type": "Marker", "id": -1})  # before any audio
    await client.audio(speech[:FRAME_SAMPLES * 10])
    await client.send({"type": "Marker", "id": 2 ** 40})
    await client.audio(np.zeros(2 * INPUT_RATE, np.float32))
    first = await client.until("Marker", skip=("Step", "Word", "EndWord"))
    second = await client.until("Marker", skip=("Step", "Word", "EndWord"))
    assert first == [{"type": "Marker", "id": -1}] and second == [{"type": "Marker", "id": 2 ** 40}]
    await client.close()


async def test_a_marker_comes_back_when_the_audio_after_it_just_covers_the_delay(server, engine, speech):
    """The client sends speech, a marker, then only the delay's frames and one more (the front end's
    lookahead), and waits: the marker and the words before it come back although no further audio will
    make the engine run again. (A marker used to wait for two more ticks of consumption after its slot: at
    the end of what a client sent, it came back only with more audio, 10 % of clean runs on an idle
    server.)"""
    client = await KyutaiClient.connect(server)
    await client.message()
    await client.audio(speech[:40 * FRAME_SAMPLES])
    await client.send({"type": "Marker", "id": 3})
    trailing = round(engine.default_delay_ms / 80) + 1
    await client.audio(np.zeros(trailing * FRAME_SAMPLES, np.float32))
    messages = await client.until("Marker", skip=("Step",), timeout=15.0)
    assert messages[-1] == {"type": "Marker", "id": 3} and messages[0]["type"] == "Word"
    await client.close()


async def test_the_drain_sends_the_last_words_then_closes(engine, speech):
    """A drain ends the stream's audio: the words of all the audio sent (the last one too, which no next
    word closed) go out as the engine's own API gives them, then an `Error` says that the server ended the
    stream and how much audio the words cover (nothing said so: the words just stopped), then the socket closes
    with 1001."""

    talk = speech[:-2 * INPUT_RATE]
    session = await engine.start_transcription(sample_rate=INPUT_RATE)
    await session.append(talk)
    await session.finish()
    expected = [(w.word, w.start, w.end) for w in [event async for event in session][-1].words]
    server = ServerThread(engine)
    try:
        client = await KyutaiClient.connect(server)
        await client.message()
        await client.audio(talk)
        draining = server.start_drain(8.0)
        messages = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                messages.append(await client.message())
        assert closed.value.rcvd.code == 1001 and await draining is True
        words = [m for m in messages if m["type"] in ("Word", "EndWord")]
        assert [(w["text"], w["start_time"], e["stop_time"]) for w, e in zip(words[::2], words[1::2])] == expected
        said = [m for m in messages if m["type"] != "Step"]
        assert said[-1]["type"] == "Error" and said[:-1] == words, said[-3:]
        covered = re.search(r"shutting down.* the first ([0-9.]+) s of audio", said[-1]["message"])
        assert float(covered.group(1)) == pytest.approx(talk.size / INPUT_RATE, abs=0.011), said[-1]
    finally:
        server.close()


# -- auth -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(engine):
    server = ServerThread(engine, ServerConfig(api_keys=("k-1",)))
    yield server
    server.close()


@pytest.mark.parametrize("query, headers", [("", {"kyutai-api-key": "k-1"}), ("?auth_id=k-1", {}),
                                            ("", {"Authorization": "Bearer k-1"})])
async def test_kyutai_key_forms_are_accepted(keyed_server, query, headers):
    client = await KyutaiClient.connect(keyed_server, query, additional_headers=headers)
    assert await client.message() == {"type": "Ready"}
    await client.close()


@pytest.mark.parametrize("query, headers", [("", {}), ("", {"kyutai-api-key": "nope"}), ("?auth_id=nope", {})])
async def test_a_missing_or_wrong_key_is_refused_before_the_upgrade(keyed_server, query, headers):
    with pytest.raises(websockets.InvalidStatus) as refused:
        await KyutaiClient.connect(keyed_server, query, additional_headers=headers)
    assert refused.value.response.status_code == 401


# -- capacity -------------------------------------------------------------------------------------------
async def closed_after(client, message: dict) -> int:
    assert await client.message() == message
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await client.message()
    return closed.value.rcvd.code


async def test_no_free_channels_at_the_connection_cap(engine):
    server = ServerThread(engine, ServerConfig(limits=Limits(max_connections=1)))
    try:
        first = await KyutaiClient.connect(server)
        assert await first.message() == {"type": "Ready"}
        second = await KyutaiClient.connect(server)
        assert await closed_after(second, {"type": "Error", "message": "no free channels"}) == 4002
        await first.close()
    finally:
        server.close()


class _FullEngine:
    """The engine surface the server reads, with every transcription slot taken."""

    kind = "realtime"
    model_name = "full"
    default_delay_ms = 480

    def __init__(self):
        from types import SimpleNamespace

        self.config = SimpleNamespace(max_sessions=4)
        self.healthy = True

    def metrics(self):
        from types import SimpleNamespace

        return SimpleNamespace(sessions=4, waiting=0, running=4, parked=0, evicted=0, max_sessions=4,
                               pages_used={}, pages_total={}, ticks=0, recent_tick_seconds=())

    async def start_transcription(self, delay_ms=None, *, session_id=None, sample_rate=16000, max_audio_seconds=None):
        raise CapacityError("the engine holds 4 sessions, its limit; try again later")


async def test_no_free_channels_when_the_engine_is_full():
    server = ServerThread(_FullEngine())
    try:
        client = await KyutaiClient.connect(server)
        assert await closed_after(client, {"type": "Error", "message": "no free channels"}) == 4002
    finally:
        server.close()


# -- malformed frames -----------------------------------------------------------------------------------
async def still_usable(client):
    await client.send({"type": "probe"})
    assert (await client.until("Error"))[-1]["message"].startswith("Unknown message type: 'probe'")


_MALFORMED = {
    "not msgpack": (b"\xc1", "not one msgpack message: FormatError: byte c1"),  # a byte msgpack never uses
    "two messages": (packed({"type": "Audio"}) + b"\x00", "not one msgpack message"),
    "not a map": (packed([1, 2]), "msgpack map"),
    "no type": (packed({"pcm": []}), "Unknown message type: None"),
    "text frame": ('{"type": "Audio"}', "Text frames"),
    "pcm string": (packed({"type": "Audio", "pcm": "AAAA"}), "array of float"),
    "pcm string sample": (packed({"type": "Audio", "pcm": [0.1, "x"]}), "numbers only"),
    "pcm bool sample": (packed({"type": "Audio", "pcm": [0.1, True]}), "numbers only"),
    "pcm nan": (packed({"type": "Audio", "pcm": [math.nan]}), "NaN"),
    "pcm beyond f32": (packed({"type": "Audio", "pcm": [1e300]}, single_floats=False), "magnitude"),
    "pcm16 scale": (packed({"type": "Audio", "pcm": [0.5, 1200.0]}), "[-1, 1]"),
    "marker id string": (packed({"type": "Marker", "id": "7"}), "64-bit integer"),
    "marker id too big": (packed({"type": "Marker", "id": 2 ** 63}), "64-bit integer"),
    "ogg opus": (packed({"type": "OggOpus", "data": b"OggS"}), "OggOpus is not supported"),
}


@pytest.mark.parametrize("frame, contains", list(_MALFORMED.values()), ids=list(_MALFORMED))
async def test_malformed_frames_get_an_error_and_keep_the_socket(server, frame, contains):
    client = await KyutaiClient.connect(server)
    await client.message()
    await client.send(frame)
    error = (await client.until("Error"))[-1]
    assert contains in error["message"], error
    await still_usable(client)
    await client.close()


# msgpack carries integers in [-2**63, 2**64 - 1]; the fuzz covers that whole range, edges included.
_integers = st.integers(-2 ** 63, 2 ** 64 - 1)
_values = st.recursive(st.none() | st.booleans() | _integers | st.floats() | st.text(max_size=8)
                       | st.binary(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=3), max_leaves=10)
_messages = st.fixed_dictionaries({"type": st.sampled_from(["Audio", "Marker", "Init", "OggOpus", "Word", ""])},
                                  optional={"pcm": st.one_of(st.lists(st.floats(-1, 1, width=32), max_size=40),
                                                             _values),
                                            "id": st.one_of(_integers, _values),
                                            "data": _values})
_frames = st.one_of(_messages.map(lambda m: packed(m, single_floats=False)),
                    _values.map(lambda v: packed(v, single_floats=False)), st.binary(max_size=40), st.text(max_size=20))


async def test_fuzzed_frames_get_well_formed_answers(server, engine):
    """Any sequence of frames gets only well-formed Kyutai messages back and the socket stays open: after
    each sequence a sentinel's `Error` arrives. (A plain websocket: the server runs on its own thread.)"""
    with sync_connect(server.url(ROUTE), max_size=None) as ws:
        assert unpacked(ws.recv(timeout=30)) == {"type": "Ready"}

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames=st.lists(_frames, min_size=1, max_size=4))
        def check(frames):
            for frame in frames:
                ws.send(frame)
            ws.send(packed({"type": "fuzz.sentinel"}))
            while True:
                message = unpacked(ws.recv(timeout=30))
                if message["type"] == "Error":
                    assert isinstance(message["message"], str) and message["message"]
                    if message["message"].startswith("Unknown message type: 'fuzz.sentinel'"):
                        break
                elif message["type"] == "Marker":
                    assert isinstance(message["id"], int)

        check()
    await wait_engine_baseline(engine)
    assert engine.healthy
