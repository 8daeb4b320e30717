"""The HTTP behaviours of serve_chaos.py (OpenAI's uploads, completions, Mode A and Mode B streaming input, SSE, the
info routes: specs/realtime_protocols.md §7, §8), and the client that goes away mid-stream on any route; with the
helpers other behaviour modules use for uploads and SSE streams.
"""
import asyncio
import contextlib
import json
import random

import aiohttp

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from serve_chaos_clients import (KYUTAI_FRAME, PIECES, RATE_24K, WAIT_S, Bad, Chaos, append, behaviour, code_of,
                                 deltas, env, env_append, envelope, feed, kyutai_audio, openai_socket, pieces)

SESSIONS = "/v1/streaming_input/sessions"


# -- uploads and SSE (spec §7, §8) -----------------------------------------------------------------------------------
def upload(c: Chaos, file: bytes, **fields) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", file, filename="audio.wav", content_type="audio/wav")
    for name, value in {"model": c.model, **fields}.items():
        form.add_field(name, value)
    return form


async def sse_events(response, count: int | None = None, pause=None) -> list[tuple[int | None, dict | str]]:
    """(id, data) of an SSE answer's events, up to its end or its `count`-th event: data is the JSON object, or the
    `[DONE]` text. `pause`, when given, is awaited after each event (a client that reads slowly)."""
    if response.status != 200 or response.content_type != "text/event-stream":
        raise Bad(f"HTTP {response.status} {response.content_type}: {(await response.read())[:200]!r}")
    events, event_id, data = [], None, []
    while count is None or len(events) < count:
        line = await asyncio.wait_for(response.content.readline(), WAIT_S)
        if not line:
            break
        line = line.decode().removesuffix("\n")
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:  # a blank line ends an event; a comment (": keepalive") has no data
            text = "\n".join(data)
            events.append((event_id, text if text == "[DONE]" else json.loads(text)))
            event_id, data = None, []
            if pause is not None:
                await pause()
    return events


def stream_text(events: list[tuple[int | None, dict | str]]) -> str:
    """The transcript of a complete transcription stream (sse_events): deltas, `transcript.text.done`, `[DONE]`."""
    data = [event for _, event in events]
    if data[-1:] != ["[DONE]"] or len(data) < 2 or data[-2].get("type") != "transcript.text.done":
        raise Bad(f"the stream did not end with transcript.text.done and [DONE]: {data[-2:]}")
    if deltas(data[:-2]) != data[-2]["text"]:
        raise Bad("the stream's deltas do not add up to its text")
    return data[-2]["text"]


async def sse_text(response) -> str:
    return stream_text(await sse_events(response))


@behaviour
async def http_transcription(c, rng):
    piece, fmt = rng.choice(list(PIECES)), rng.choice(("json", "text", "verbose_json"))
    body = await c.call("POST", "/v1/audio/transcriptions", 200, data=upload(c, c.wav[piece], response_format=fmt))
    c.same(("16k", piece), body.decode().removesuffix("\n") if fmt == "text" else json.loads(body)["text"])


@behaviour
async def http_transcription_sse(c, rng):
    piece = rng.choice(list(PIECES))
    async with c.http.post(c.url + "/v1/audio/transcriptions", data=upload(c, c.wav[piece], stream="true")) as r:
        c.same(("16k", piece), await sse_text(r))


@behaviour
async def http_sse_client_drop(c, rng):
    async with c.http.post(c.url + "/v1/audio/transcriptions", data=upload(c, c.wav["full"], stream="true")) as r:
        if r.status != 200:
            raise Bad(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        await asyncio.wait_for(r.content.readline(), WAIT_S)
        r.close()  # drops the connection mid-stream


@behaviour
async def http_bad_uploads(c, rng):
    """A file cut inside its samples (what it holds is transcribed), and three refused uploads: undecodable, empty,
    cut inside its 44-byte header (no sample), no file at all, the wrong model or format, JSON instead of a form."""
    wav = c.wav["full"]
    cut = rng.randrange(60, len(wav))
    body = await c.call("POST", "/v1/audio/transcriptions", 200, data=upload(c, wav[:cut]))
    c.same(("cut", cut // 2), json.loads(body)["text"])  # (an odd cut drops half a sample)
    no_file = aiohttp.FormData({"model": c.model}, default_to_multipart=True)
    cases = [(upload(c, rng.randbytes(200)), 400, "invalid_audio"), (upload(c, b""), 400, "invalid_audio"),
             (upload(c, wav[:rng.randrange(1, 46)]), 400, "invalid_audio"), (no_file, 400, "invalid_request"),
             (upload(c, wav, model="nope"), 404, "model_not_found"),
             (upload(c, wav, response_format="mp3"), 400, "invalid_request"),
             ({"json": {"model": c.model}}, 400, "invalid_request")]
    for form, status, code in rng.sample(cases, 3):
        kwargs = form if isinstance(form, dict) else {"data": form}
        await c.call("POST", "/v1/audio/transcriptions", status, code, **kwargs)


@behaviour
async def http_completions_refused(c, rng):
    """/v1/completions and /v1/chat/completions serve text LMs: the tiny speech model's server refuses them with the
    documented 4xx."""
    path, body = rng.choice((("/v1/completions", {"prompt": "Hello"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})))
    await c.call("POST", path, 400, "unsupported_model", json={"model": c.model, **body, "stream": rng.random() < 0.5})
    await c.call("POST", path, 404, "model_not_found", json={"model": "nope", **body})
    await c.call("POST", path, 400, "invalid_json", data=b'{"model": ', headers={"Content-Type": "application/json"})


@behaviour
async def http_info(c, rng):
    for path in ("/health", "/healthz", "/ping"):
        if json.loads(await c.call("GET", path, 200)) != {"status": "ok"}:  # open to all: it names no model
            raise Bad(f"{path} is not ok")
    if json.loads(await c.call("GET", "/v1/models", 200))["data"][0]["id"] != c.model:
        raise Bad("/v1/models does not list the served model")
    if b"jaxstream_engine_healthy 1.0" not in await c.call("GET", "/metrics", 200):
        raise Bad("/metrics: the engine is not healthy")


def chunk_lines(c: Chaos, piece: str) -> list[dict]:
    parts = [c.pcm[piece][i:i + 8000] for i in range(0, c.pcm[piece].size, 8000)]
    return [{"sequence_id": n, "modality": "audio", "payload": encode_pcm16_base64(part),
             "end_of_input": n == len(parts) - 1} for n, part in enumerate(parts)]


async def mode_a_body(c: Chaos, piece: str, rng: random.Random):
    """A Mode A body: the parameters line, then the piece's chunks, sent as fast as they go or 50 ms apart."""
    for line in [{"model": c.model}] + chunk_lines(c, piece):
        yield json.dumps(line).encode() + b"\n"
        await asyncio.sleep(rng.choice((0, 0.05)))


def mode_a(c: Chaos, body):
    return c.http.post(c.url + "/v1/audio/transcriptions", data=body, headers={"X-Streaming-Input": "true"})


@behaviour
async def http_streaming_input(c, rng):
    """Mode A: an NDJSON body of audio chunks, answered by SSE while it arrives."""
    piece = rng.choice(list(PIECES))
    async with mode_a(c, mode_a_body(c, piece, rng)) as r:
        c.same(("16k", piece), await sse_text(r))


@behaviour
async def http_session(c, rng):
    """Mode B: a session, its chunks (the first one twice), its result; a chunk for no session is a 404."""
    piece = rng.choice(list(PIECES))
    created = json.loads(await c.call("POST", SESSIONS, 201, json={"model": c.model}))
    base = f"{SESSIONS}/{created['session_id']}"
    chunks = chunk_lines(c, piece)
    for chunk in chunks[:1] + chunks:
        async with c.http.post(c.url + base + "/chunks", json=chunk) as r:
            if r.status not in (200, 202):
                raise Bad(f"chunk {chunk['sequence_id']}: HTTP {r.status}: {(await r.read())[:200]!r}")
    c.same(("16k", piece), json.loads(await c.call("GET", base + "/result", 200))["text"])
    await c.call("POST", SESSIONS + "/nope/chunks", 404, "session_not_found", json=chunks[0])


@behaviour
async def http_session_resume(c, rng):
    """Mode B with `stream: true`: its /events stream dropped after its first events (while chunks still arrive) and
    resumed with Last-Event-ID (the header, or the `last_event_id` query of EventSource polyfills) gets every later
    event once, in order (spec §8). Resumed after its end: from its last id, `[DONE]` again; from an id it never had,
    an `error` invalid_last_event_id and `[DONE]`, both with its last id; from one that is no number, a 422."""
    piece = rng.choice(list(PIECES))
    created = json.loads(await c.call("POST", SESSIONS, 201, json={"model": c.model, "stream": True}))
    base = c.url + f"{SESSIONS}/{created['session_id']}"

    def resumed(last_id) -> dict:
        if rng.random() < 0.5:
            return {"headers": {"Last-Event-ID": str(last_id)}}
        return {"params": {"last_event_id": str(last_id)}}

    async def send():
        for chunk in chunk_lines(c, piece):
            async with c.http.post(base + "/chunks", json=chunk) as r:
                if r.status != 202:
                    raise Bad(f"chunk {chunk['sequence_id']}: HTTP {r.status}: {(await r.read())[:200]!r}")
            await asyncio.sleep(rng.choice((0, 0.05)))

    async with asyncio.TaskGroup() as group:
        group.create_task(send())
        async with c.http.get(base + "/events") as r:
            first = await sse_events(r, rng.randint(1, 2))
            r.close()  # the stream drops
        await asyncio.sleep(rng.uniform(0, 1))
        async with c.http.get(base + "/events", **resumed(first[-1][0])) as r:
            events = first + await sse_events(r)
    if [n for n, _ in events] != list(range(1, len(events) + 1)):
        raise Bad(f"event ids {[n for n, _ in events]} (resumed after {first[-1][0]})")
    c.same(("16k", piece), stream_text(events))
    last, after = len(events), rng.choice(("last", "never", "nan"))
    if after == "nan":
        await c.call("GET", base.removeprefix(c.url) + "/events", 422, "invalid_last_event_id",
                     headers={"Last-Event-ID": rng.choice(("-1", "x", "1.5"))})
        return
    async with c.http.get(base + "/events", **resumed(last + (rng.randint(1, 9) if after == "never" else 0))) as r:
        tail = await sse_events(r)
    expected = [(last, "[DONE]")] if after == "last" else [(last, "invalid_last_event_id"), (last, "[DONE]")]
    if [(n, code_of(data) if isinstance(data, dict) else data) for n, data in tail] != expected:
        raise Bad(f"resumed after the end ({after}): {tail}")


@behaviour
async def http_sse_slow_reader(c, rng):
    """A transcription stream (an upload's `stream=true`, or Mode A) read one event at a time, with pauses: the
    client's slowness costs it nothing, every event arrives."""
    piece = rng.choice(("head", "tail"))
    request = (c.http.post(c.url + "/v1/audio/transcriptions", data=upload(c, c.wav[piece], stream="true"))
               if rng.random() < 0.5 else mode_a(c, mode_a_body(c, piece, rng)))
    async with request as r:
        c.same(("16k", piece), stream_text(await sse_events(r, pause=lambda: asyncio.sleep(rng.uniform(0.05, 0.3)))))


# -- the client going away on every route -------------------------------------------------------------------------
@behaviour
async def midway_drops(c, rng):
    """The client goes away mid-stream on another route: its TCP connection drops, without a close frame or the
    rest of its request body. Nothing to expect but that the server frees what it held (each round's end checks)."""
    route = rng.choice(("openai", "kyutai", "envelope", "upload", "mode_a"))
    if route in ("upload", "mode_a"):
        boundary, wav = f"chaos{rng.getrandbits(32)}", c.wav["full"]
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{c.model}\r\n--{boundary}\r\n'
                'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n').encode()
        # Mode A: the parameters, then chunks but the last (which ends the input).
        lines = [json.dumps(line).encode() + b"\n" for line in [{"model": c.model}] + chunk_lines(c, "full")[:-1]]
        parts = [head, wav[:rng.randrange(len(wav))]] if route == "upload" else lines[:rng.randint(1, len(lines))]

        async def body():
            for part in parts:
                yield part
            await asyncio.sleep(3600)  # the rest never comes

        headers = ({"Content-Type": f"multipart/form-data; boundary={boundary}"} if route == "upload"
                   else {"X-Streaming-Input": "true"})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.2, 2.0)):  # then the request is cancelled, its connection closed
                async with c.http.post(c.url + "/v1/audio/transcriptions", data=body(), headers=headers) as r:
                    await r.read()
                raise Bad(f"{route}: HTTP {r.status} before the body ended")
        return
    if route == "openai":
        ws = await openai_socket(c, rng)
        chunks, make, rate = pieces(c.pcm24["full"], rng, (1920, 4800)), append, RATE_24K
    elif route == "kyutai":
        ws = await c.open("/api/asr-streaming", packed=True)
        await ws.until("Ready")
        chunks, make, rate = pieces(c.pcm24["full"], rng, (KYUTAI_FRAME,)), kyutai_audio, RATE_24K
    else:
        ws = await envelope(c)
        await ws.send(env("input_audio_buffer.commit", "u", final=False))
        chunks, make, rate = pieces(c.pcm["full"], rng), env_append, SAMPLING_RATE
    await feed(ws, chunks[:rng.randint(1, len(chunks))], make, rng, rate)
    ws.drop()
