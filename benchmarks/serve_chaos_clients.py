"""WebSocket clients for serve_chaos.py: a socket that speaks each protocol of `jaxstream serve` and checks its
answers, what every behaviour shares (`Chaos`), and the behaviours on the WebSocket routes, well-behaved and
hostile, each checking that the server answers as specs/realtime_protocols.md says (strict mode, default limits).
serve_chaos_replay.py replays a failing run's frames step by step.

A behaviour is `async def name(c: Chaos, rng: random.Random)`, registered with @behaviour: it returns when the run
ended as expected and raises Bad (or anything else) when not; serve_chaos_http.py adds the HTTP ones,
serve_chaos_vad.py the server-VAD ones and serve_chaos_limits.py those that meet the server's limits, keys and
routing refusals. One registered with `needs` runs only where `needs(c)` is None (else: what it would need).
"""
import asyncio
import contextvars
import io
import json
import random

import aiohttp
import msgpack
import numpy as np
import soundfile
import soxr
import websockets

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from jaxstream.serving.limits import Limits

LIMITS = Limits()  # the server's defaults: what the oversized behaviours exceed
WAIT_S = 60.0  # for one awaited event or answer
PIECES = {"full": (0, None), "head": (0, 28000), "tail": (20000, None)}  # slices of the sample, 16 kHz samples
RATE_24K = 24000  # the OpenAI dialect's audio/pcm and Kyutai's float PCM
KYUTAI_FRAME = 1920  # 80 ms at 24 kHz
BEHAVIOURS = {}
NEEDS = {}  # behaviour -> needs(c): None when it can run against this server, else what it lacks
KINDS = {}  # behaviour -> the kind of served model it talks to: "speech" (the default) or "text"
_SOCKETS = contextvars.ContextVar("sockets")  # the sockets the current run opened


class Bad(Exception):
    """A run that did not end as the protocol says: str() is the reason."""


def behaviour(fn=None, *, needs=None, kind: str = "speech"):
    """Registers `fn` (@behaviour, or @behaviour(needs=...) for one that runs only where `needs(c)` is None; `kind`:
    the served model it needs, a speech-to-text or a text model)."""
    def register(fn):
        BEHAVIOURS[fn.__name__] = fn
        KINDS[fn.__name__] = kind
        if needs is not None:
            NEEDS[fn.__name__] = needs
        return fn

    return register(fn) if fn is not None else register


def of_kind(kind: str, names=None) -> list[str]:
    """The behaviours (of `names`, default all) for a server of a `kind` model, sorted."""
    return sorted(name for name in (BEHAVIOURS if names is None else names) if KINDS[name] == kind)


def unavailable(c: "Chaos", name: str) -> str | None:
    """Why the behaviour `name` cannot run against c's server (None: it can)."""
    return NEEDS[name](c) if name in NEEDS else None


def closed_reason(exc: websockets.ConnectionClosed) -> str:
    if exc.rcvd is None:
        return "the connection dropped without a close frame"
    return f"the server closed with {exc.rcvd.code} {exc.rcvd.reason!r}"


def code_of(event: dict):
    """An error event's code, where each dialect puts it (vLLM, OpenAI, /ws); None for other events."""
    fields = event["error"] if isinstance(event.get("error"), dict) else event.get("payload") or event
    return fields.get("code") if event.get("type") == "error" and isinstance(fields, dict) else None


class Socket:
    """A WebSocket client: events (JSON, or msgpack with `packed`) out and in. No event within WAIT_S or a close
    the client did not ask for raises Bad."""

    def __init__(self, ws, packed: bool):
        self.ws, self.packed = ws, packed

    @classmethod
    async def open(cls, url: str, packed: bool = False, **options) -> "Socket":
        """`options`: more of websockets.connect's (headers, subprotocols, ...)."""
        options = {"max_size": None, "max_queue": None, "open_timeout": WAIT_S, **options}
        socket = cls(await websockets.connect(url, **options), packed)
        _SOCKETS.get().append(socket)
        return socket

    async def send(self, event) -> None:
        if not isinstance(event, (str, bytes)):
            event = msgpack.packb(event, use_single_float=True) if self.packed else json.dumps(event)
        try:
            await self.ws.send(event)
        except websockets.ConnectionClosed as exc:
            raise Bad(f"sending: {closed_reason(exc)}") from None

    async def recv(self) -> dict:
        try:
            frame = await asyncio.wait_for(self.ws.recv(), WAIT_S)
        except TimeoutError:
            raise Bad(f"no event within {WAIT_S:g} s") from None
        except websockets.ConnectionClosed as exc:
            raise Bad(closed_reason(exc)) from None
        if self.packed != isinstance(frame, bytes):
            raise Bad(f"a {'text' if self.packed else 'binary'} frame: {frame[:100]!r}")
        return msgpack.unpackb(frame) if self.packed else json.loads(frame)

    async def until(self, kind: str, count: int = 1) -> list[dict]:
        """Events up to the `count`-th of type `kind`; an error or a failed transcription on the way is Bad."""
        events = []
        while count:
            events.append(event := await self.recv())
            if event["type"] in ("error", "Error") or event["type"].endswith("transcription.failed"):
                raise Bad(f"awaiting {kind}: {json.dumps(event)[:300]}")
            count -= event["type"] == kind
        return events

    async def error(self, code: str, event_id: str | None = None) -> None:
        """The next event must be the error `code` (echoing `event_id` when given: OpenAI's dialect)."""
        event = await self.recv()
        if code_of(event) != code or (event_id and event["error"].get("event_id") != event_id):
            raise Bad(f"expected error {code}, got {json.dumps(event)[:300]}")

    async def close(self) -> None:
        """The client's close, which the server must answer with 1000."""
        await self.ws.close()
        if self.ws.close_code != 1000:
            raise Bad(f"closing: the server answered {self.ws.close_code} {self.ws.close_reason!r}")

    async def closed_with(self, code: int) -> None:
        """Reads until the server closes, which it must do with `code`."""
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), WAIT_S)
        except TimeoutError:
            raise Bad(f"no close {code} within {WAIT_S:g} s") from None
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is None or exc.rcvd.code != code:
                raise Bad(f"expected close {code}: {closed_reason(exc)}") from None

    def drop(self) -> None:
        """The TCP connection ends without a close frame, as when a client's network goes away."""
        self.ws.transport.abort()


def auth_headers(key: str | None) -> dict:
    """What carries the server's API key on every request (none for a server without keys)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class Chaos:
    """What every behaviour shares: the server's URLs, model, API key and limits, the audio, the transcripts seen so
    far. `http` sends the key on every request (auth_headers); `open` does on every WebSocket. `limits`: what the
    server was started with, when the soak was told (None: the defaults, LIMITS, and no behaviour waits for one).
    `kind`: the served model's, "speech" or "text" (whose /v1/models gives a max_model_len)."""

    def __init__(self, url: str, http: aiohttp.ClientSession, model: str, audio: np.ndarray, key: str | None = None,
                 limits: Limits | None = None, kind: str = "speech"):
        self.url, self.ws_url, self.http, self.model = url, "ws" + url.removeprefix("http"), http, model
        self.kind = kind
        self.key, self.known_limits, self.limits = key, limits is not None, limits or LIMITS
        self.pcm = {name: audio[a:b] for name, (a, b) in PIECES.items()}
        self.wav = {name: wav_bytes(pcm) for name, pcm in self.pcm.items()}
        self.pcm24 = {name: soxr.resample(pcm, SAMPLING_RATE, RATE_24K).astype(np.float32)
                      for name, pcm in self.pcm.items()}
        self.texts: dict = {}

    def same(self, key: tuple, text: str) -> None:
        """`text` must equal every earlier transcript of the same audio (`key`): the engine's results do not
        depend on the batch, so a difference is another stream's text or lost audio."""
        first = self.texts.setdefault(key, text)
        if text != first:
            raise Bad(f"{key}: transcript {text[:80]!r} differs from an earlier run's {first[:80]!r}")

    async def open(self, path: str, packed: bool = False, **options) -> Socket:
        """A WebSocket to `path` that presents the server's key."""
        return await Socket.open(self.ws_url + path, packed, additional_headers=auth_headers(self.key), **options)

    async def realtime(self, path: str = "/v1/realtime", **options) -> Socket:
        """A vLLM-protocol socket, its model validated."""
        ws = await self.open(path, **options)
        await ws.until("session.created")
        await ws.send({"type": "session.update", "model": self.model})
        await ws.until("session.updated")
        return ws

    async def call(self, method: str, path: str, status: int, code: str | None = None, **kwargs) -> bytes:
        """One HTTP request, whose answer must have `status` (and, for an error, OpenAI's shape with `code`)."""
        async with self.http.request(method, self.url + path, **kwargs) as response:
            body = await response.read()
        if response.status != status:
            raise Bad(f"{method} {path}: HTTP {response.status}, expected {status}: {body[:200]!r}")
        if code is not None and json.loads(body).get("error", {}).get("code") != code:
            raise Bad(f"{method} {path}: expected error {code}: {body[:200]!r}")
        return body


def wav_bytes(pcm: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm, SAMPLING_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def pieces(pcm: np.ndarray, rng: random.Random, sizes=(1280, 2560, 4000, 16000)) -> list[np.ndarray]:
    size = rng.choice(sizes)
    return [pcm[i:i + size] for i in range(0, pcm.size, size)]


def append(pcm: np.ndarray) -> dict:
    return {"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(pcm)}


async def feed(ws: Socket, chunks, make, rng: random.Random, rate: int = SAMPLING_RATE) -> None:
    """Sends `make(chunk)` per chunk, as fast as the server takes them or (one run in four) at twice real time."""
    paced = rng.random() < 0.25
    for chunk in chunks:
        await ws.send(make(chunk))
        if paced:
            await asyncio.sleep(chunk.size / rate / 2)


def deltas(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"].endswith("delta"))


async def utterance(c: Chaos, ws: Socket, rng: random.Random, piece: str, binary: bool = False) -> None:
    """One vLLM-protocol utterance (commit, appends, final): deltas adding up to the done's text, which is the
    piece's transcript, and usage whose total is its parts' sum. `binary`: events in binary frames."""
    def frame(event):
        return json.dumps(event).encode() if binary else event

    await ws.send(frame({"type": "input_audio_buffer.commit"}))
    await feed(ws, pieces(c.pcm[piece], rng), lambda pcm: frame(append(pcm)), rng)
    await ws.send(frame({"type": "input_audio_buffer.commit", "final": True}))
    events = await ws.until("transcription.done")
    done, usage = events[-1], events[-1]["usage"]
    if deltas(events) != done["text"]:
        raise Bad(f"deltas {deltas(events)[:80]!r} do not add up to the done's {done['text'][:80]!r}")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise Bad(f"usage does not add up: {usage}")
    c.same(("16k", piece), done["text"])


# -- /v1/realtime, vLLM's protocol (spec §1-§3), and SageMaker's route (§6) ----------------------------------------
@behaviour
async def realtime_utterances(c, rng):
    ws = await c.realtime()
    for _ in range(rng.randint(1, 2)):
        await utterance(c, ws, rng, rng.choice(list(PIECES)))
    await ws.close()


@behaviour
async def realtime_many_sessions(c, rng):
    async def one(piece):
        ws = await c.realtime()
        await utterance(c, ws, rng, piece)
        await ws.close()

    async with asyncio.TaskGroup() as group:
        for _ in range(rng.randint(3, 6)):
            group.create_task(one(rng.choice(("head", "tail"))))


async def half_utterance(c: Chaos, rng: random.Random) -> Socket:
    """A socket whose utterance got part of its audio, and one time in two (with 3 s or more) a first delta."""
    ws = await c.realtime()
    await ws.send({"type": "input_audio_buffer.commit"})
    chunks = pieces(c.pcm["full"], rng)
    sent = chunks[:rng.randint(1, len(chunks))]
    await feed(ws, sent, append, rng)
    if sum(chunk.size for chunk in sent) >= 3 * SAMPLING_RATE and rng.random() < 0.5:
        await ws.until("transcription.delta")
    return ws


@behaviour
async def realtime_tcp_drop(c, rng):
    (await half_utterance(c, rng)).drop()


@behaviour
async def realtime_abrupt_close(c, rng):
    await (await half_utterance(c, rng)).close()


def refused_input(name: str, frames: tuple, code: str) -> None:
    """A behaviour that starts an utterance and sends one to three of `frames`: each gets the error `code`, and the
    final commit then finds the utterance empty (the refused input queued nothing; the socket still works)."""
    async def run(c, rng):
        ws = await c.realtime()
        await ws.send({"type": "input_audio_buffer.commit"})
        for _ in range(rng.randint(1, 3)):
            await ws.send(rng.choice(frames))
            await ws.error(code)
        await ws.send({"type": "input_audio_buffer.commit", "final": True})
        await ws.error("input_audio_buffer_commit_empty")
        await ws.close()

    run.__name__ = name
    behaviour(run)


def _append_of(audio: str) -> dict:
    return {"type": "input_audio_buffer.append", "audio": audio}


refused_input("realtime_malformed_json", ('{"type": "input_audio_buffer.append", "audio": ', "{not json", "[", "\x00"),
              "invalid_json")
refused_input("realtime_malformed_events", ("3", '[{"type": "session.update"}]', {"type": "input_audio_buffer.append"},
                                         {"type": "input_audio_buffer.commit", "final": "maybe"}), "processing_error")
refused_input("realtime_unknown_event", ({"type": "response.create"}, {"audio": "AAAA"}, {"type": 5}),
              "unknown_event")
# Bad padding, an odd byte count, empty, a junk character, more samples than one append may hold.
refused_input("realtime_bad_audio", (*map(_append_of, ("AAA", "AQID", "", "AAAA*AAAA")),
                                     append(np.zeros(int(LIMITS.max_append_seconds * SAMPLING_RATE) + 2))),
              "invalid_audio")
refused_input("realtime_binary_frame", (b"\x00\x01binary", b"\xff", json.dumps(_append_of("AAAA")).encode()),
              "invalid_frame")


@behaviour
async def realtime_oversized_frame(c, rng):
    """A frame over the message limit closes the socket with 1009 (perhaps while the frame is being sent)."""
    ws = await c.realtime()
    try:
        await ws.ws.send(rng.choice(("x", " ")) * (c.limits.max_message_bytes + 1))
    except websockets.ConnectionClosed:
        pass  # closed_with reads why
    await ws.closed_with(1009)


@behaviour
async def realtime_protocol_misuse(c, rng):
    """Events out of order, each refused with its error, until an update validates the model."""
    ws = await c.open("/v1/realtime")
    await ws.until("session.created")
    commit, final = {"type": "input_audio_buffer.commit"}, {"type": "input_audio_buffer.commit", "final": True}
    for event, answer in [(commit, "model_not_validated"), ({"type": "session.update"}, "invalid_event"),
                          ({"type": "session.update", "model": rng.choice(("", "nope"))}, "model_not_found"),
                          ({"type": "session.update", "model": c.model}, "session.updated"),
                          (final, "no_active_generation"), (commit, None), (commit, "generation_in_progress"),
                          (final, "input_audio_buffer_commit_empty")]:
        await ws.send(event)
        if answer == "session.updated":
            await ws.until(answer)
        elif answer is not None:
            await ws.error(answer)
    await ws.close()


@behaviour
async def realtime_idle(c, rng):
    """Commits and sends nothing, or sends audio and never commits: the server sends nothing, keeps the socket
    (for at most half its idle timeout)."""
    ws = await c.realtime()
    await ws.send({"type": "input_audio_buffer.commit"} if rng.random() < 0.5 else append(c.pcm["head"]))
    idle = c.limits.idle_timeout_s
    await asyncio.sleep(rng.uniform(min(1.0, idle / 4), min(8.0, idle / 2)))
    await ws.send({"type": "probe"})
    await ws.error("unknown_event")  # the first event since session.updated
    await ws.close()


@behaviour
async def realtime_append_after_final(c, rng):
    """Audio appended after a final commit, before its done, is the next utterance's (strict mode), and so is a
    commit sent then (it starts once the done is out)."""
    ws = await c.realtime()
    first, second = rng.choice((("head", "tail"), ("tail", "head"), ("full", "head")))
    await ws.send({"type": "input_audio_buffer.commit"})
    await feed(ws, pieces(c.pcm[first], rng), append, rng)
    await ws.send({"type": "input_audio_buffer.commit", "final": True})
    await feed(ws, pieces(c.pcm[second], rng), append, rng)
    if queued := rng.random() < 0.5:
        await ws.send({"type": "input_audio_buffer.commit"})
    c.same(("16k", first), (await ws.until("transcription.done"))[-1]["text"])
    if not queued:
        await ws.send({"type": "input_audio_buffer.commit"})
    await ws.send({"type": "input_audio_buffer.commit", "final": True})
    c.same(("16k", second), (await ws.until("transcription.done"))[-1]["text"])
    await ws.close()


@behaviour
async def sagemaker_utterance(c, rng):
    """SageMaker's route: vLLM's protocol, binary frames read as UTF-8 JSON (not UTF-8: invalid JSON)."""
    ws = await c.realtime("/invocations-bidirectional-stream")
    await ws.send(b"\xff\xfe\x00")
    await ws.error("invalid_json")
    await utterance(c, ws, rng, rng.choice(list(PIECES)), binary=rng.random() < 0.5)
    await ws.close()


# -- /v1/realtime, OpenAI's transcription dialect (spec §4) --------------------------------------------------------
def openai_update(model: str, rate: int = RATE_24K) -> dict:
    return {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": rate}, "turn_detection": None, "transcription": {"model": model}}}}}


async def openai_socket(c: Chaos, rng: random.Random, **options) -> Socket:
    """Asked for in the handshake, or (one time in two) switched to by an OpenAI-shaped first event."""
    ws = await c.open(rng.choice(("/v1/realtime?intent=transcription", "/v1/realtime")), **options)
    await ws.until("session.created")
    await ws.send(openai_update(c.model))
    await ws.until("session.updated")
    await ws.until("rate_limits.updated")
    return ws


@behaviour
async def openai_turns(c, rng):
    """Manual turns, the next one streamed while the previous one finishes: each item's deltas add up to its
    transcript, which is the piece's, and the item ends completed."""
    ws = await openai_socket(c, rng)
    turns = [rng.choice(list(PIECES)) for _ in range(rng.randint(1, 2))]
    for piece in turns:
        await feed(ws, pieces(c.pcm24[piece], rng, (1920, 4800, 24000)), append, rng, RATE_24K)
        await ws.send({"type": "input_audio_buffer.commit"})
    events = await ws.until("conversation.item.done", len(turns))
    items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    for piece, item in zip(turns, items, strict=True):
        (done,) = [e for e in events if e["type"].endswith("transcription.completed") and e["item_id"] == item]
        if deltas([e for e in events if e.get("item_id") == item]) != done["transcript"]:
            raise Bad(f"item deltas do not add up to its transcript {done['transcript'][:80]!r}")
        c.same(("24k", piece), done["transcript"])
    if any(e["item"]["status"] != "completed" for e in events if e["type"] == "conversation.item.done"):
        raise Bad("an item ended other than completed")
    await ws.close()


@behaviour
async def openai_bad_events(c, rng):
    """Three refused events (each error echoes the event's event_id), then a clear drops the open item."""
    ws = await openai_socket(c, rng)
    cases = [("{oops", "invalid_json"), ({"type": "response.create"}, "unsupported_event"),
             ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
             (openai_update(c.model, 16000), "invalid_value"), (_append_of("@@@@"), "invalid_audio"),
             ("[1]", "invalid_event")]
    for event, code in rng.sample(cases, 3):
        event_id = f"evt_{rng.getrandbits(32)}" if isinstance(event, dict) else None
        await ws.send({**event, "event_id": event_id} if event_id else event)
        await ws.error(code, event_id)
    await ws.send(append(c.pcm24["head"][:4800]))
    await ws.send({"type": "input_audio_buffer.clear"})
    events = await ws.until("input_audio_buffer.cleared")
    if [e["item"]["status"] for e in events if e["type"] == "conversation.item.done"] != ["incomplete"]:
        raise Bad("the cleared item did not end incomplete")
    await ws.close()


# -- /api/asr-streaming, Kyutai's protocol (spec §9) ---------------------------------------------------------------
def kyutai_audio(pcm: np.ndarray) -> dict:
    return {"type": "Audio", "pcm": pcm.tolist()}


@behaviour
async def kyutai_stream(c, rng):
    """Audio, a marker, 2 s of silence: the marker comes back after the words of the audio before it. (Only the
    pieces that end after a word: the word in progress at a marker may be cut anywhere.)"""
    ws = await c.open("/api/asr-streaming", packed=True)
    await ws.until("Ready")
    piece, marker = rng.choice(("full", "tail")), rng.getrandbits(40)
    await feed(ws, pieces(c.pcm24[piece], rng, (KYUTAI_FRAME,)), kyutai_audio, rng, RATE_24K)
    await ws.send({"type": "Marker", "id": marker})
    await feed(ws, pieces(np.zeros(2 * RATE_24K, np.float32), rng, (KYUTAI_FRAME,)), kyutai_audio, rng, RATE_24K)
    messages = await ws.until("Marker")
    if messages[-1]["id"] != marker:
        raise Bad(f"marker {messages[-1]['id']} came back, not {marker}")
    c.same(("kyutai", piece), " ".join(m["text"] for m in messages if m["type"] == "Word"))
    await ws.close()


@behaviour
async def kyutai_bad_frames(c, rng):
    """Frames the protocol cannot use get an Error each, and the socket stays open."""
    ws = await c.open("/api/asr-streaming", packed=True)
    await ws.until("Ready")
    bad = [{"type": "Nope"}, b"\xc1", [1, 2], "a text frame", kyutai_audio(np.array([np.nan])),
           {"type": "Marker", "id": "7"}, {"type": "OggOpus", "data": b"OggS"}, kyutai_audio(np.array([3.0]))]
    for frame in rng.sample(bad, 4):
        await ws.send(frame if isinstance(frame, (str, bytes)) else msgpack.packb(frame))
        if (message := await ws.recv())["type"] != "Error":
            raise Bad(f"{message} for {frame!r}")
    await ws.close()


# -- /ws, the JSON envelope (spec §5) ------------------------------------------------------------------------------
async def envelope(c: Chaos) -> Socket:
    ws = await c.open("/ws")
    await ws.until("session.created")
    return ws


def env(kind: str, request_id: str | None = None, **payload) -> dict:
    return {"type": kind, "session_id": "chaos", "request_id": request_id, "payload": payload}


def env_append(pcm: np.ndarray, request_id: str = "u") -> dict:
    return env("input_audio_buffer.append", request_id, audio=encode_pcm16_base64(pcm))


@behaviour
async def envelope_utterance(c, rng):
    ws = await envelope(c)
    await ws.send(env("session.update", "r0", model=c.model))
    await ws.until("session.updated")
    piece = rng.choice(list(PIECES))
    await ws.send(env("input_audio_buffer.commit", "u", final=False))
    await feed(ws, pieces(c.pcm[piece], rng), env_append, rng)
    await ws.send(env("input_audio_buffer.commit", "u", final=True))
    events = [e for e in await ws.until("transcription.done") if e["request_id"] == "u"]
    if deltas([{**e, **e["payload"]} for e in events]) != events[-1]["payload"]["text"]:
        raise Bad("the deltas do not add up to the done's text")
    c.same(("16k", piece), events[-1]["payload"]["text"])
    await ws.send(env("ping", "p"))
    await ws.until("pong")
    await ws.send(env("end", "bye"))
    await ws.until("session_end")
    await ws.closed_with(1000)


@behaviour
async def envelope_bad_messages(c, rng):
    ws = await envelope(c)
    cases = [("not json", "invalid_json"), (b"\x00binary", "invalid_frame"), (env("response.create"), "unknown_event"),
             (env("input_audio_buffer.commit", final=True), "invalid_request"),
             (env("input_audio_buffer.append", audio="@@@"), "invalid_audio"),
             (env("session.update", model="other-model"), "invalid_request"),
             ('{"type": "ping", "request_id": 7}', "invalid_request")]
    for frame, code in rng.sample(cases, 4):
        await ws.send(frame)
        await ws.error(code)
    await ws.send(env("ping", "still-open"))
    await ws.until("pong")
    await ws.close()


@behaviour
async def envelope_cancel_and_barge_in(c, rng):
    """A cancel, or a new commit (barge-in), aborts the running utterance: `cancelled` names it; the barging one
    is transcribed."""
    ws = await envelope(c)
    await ws.send(env("input_audio_buffer.commit", "u1", final=False))
    await ws.send(env_append(c.pcm["head"], "u1"))
    barge_in = rng.random() < 0.5
    await ws.send(env("input_audio_buffer.commit", "u2", final=False) if barge_in else env("cancel", "c1"))
    cancelled = (await ws.until("cancelled"))[-1]["payload"]
    if cancelled["request_ids"] != ["u1"] or cancelled["reason"] != ("barge_in" if barge_in else "client_request"):
        raise Bad(f"cancelled: {cancelled}")
    if barge_in:
        await ws.send(env_append(c.pcm["tail"], "u2"))
        await ws.send(env("input_audio_buffer.commit", "u2", final=True))
        c.same(("16k", "tail"), (await ws.until("transcription.done"))[-1]["payload"]["text"])
    await ws.close()


# -- running them ---------------------------------------------------------------------------------------------------
async def run_one(c: Chaos, name: str, rng: random.Random, timeout: float) -> str | None:
    """Runs one behaviour: None when it ended as expected, else why not. Its sockets are dropped at the end (a
    failed run leaves them open)."""
    _SOCKETS.set(sockets := [])
    try:
        async with asyncio.timeout(timeout):
            await BEHAVIOURS[name](c, rng)
    except TimeoutError:
        return f"no end within {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - any failure of a run is its reason
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        return str(exc) if isinstance(exc, Bad) else f"{type(exc).__name__}: {exc}"[:300]
    finally:
        for socket in sockets:
            socket.drop()
    return None
