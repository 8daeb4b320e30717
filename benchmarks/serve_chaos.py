"""Robustness soak of a running `jaxstream serve`: concurrent clients that each pick, at random (seeded), a
behaviour, well-behaved or hostile, on every protocol and route the server speaks, for rounds of a given length.
It reports per behaviour how many runs ended as the protocol says they should ("ok") and the first reasons of the
others, and after each round the server's RSS, whether the engine is back at zero sessions, KV pages and open
sockets, and (--log) the tracebacks and ERROR lines in the server's log.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 jaxstream serve --port 8123 > LOG 2>&1 &
    python benchmarks/serve_chaos.py --url http://127.0.0.1:8123 --seed 1 --rounds 3 --round-s 45 \\
        --workers 12 --pid $! --log LOG

The behaviours are functions, one per client behaviour: the WebSocket ones in serve_chaos_clients.py, the HTTP
ones here. "As expected" is what specs/realtime_protocols.md has the server answer in its default (strict) mode
with the default limits: a transcript whose deltas add up to it and that equals every other transcript of the same
audio at the same rate, whatever the route or the load (so cross-talk between streams shows), or the structured
error or HTTP 4xx the spec names for that input, the socket kept or closed as it says. Not ok: no answer within
--timeout, a 5xx, another error, a connection dropped without a close frame that the client did not drop itself.
Exit status 1 when a run was not ok, a round ended with engine sessions, KV pages or sockets still held, or the
log has a traceback. `--once [BEHAVIOUR ...]` runs each behaviour (or the named ones) once instead, one after the
other, to replay what a soak found.
"""
import argparse
import asyncio
import collections
import contextlib
import json
import random
import re
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import soundfile

from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.audio_codecs import encode_pcm16_base64
from serve_chaos_clients import (BEHAVIOURS, KYUTAI_FRAME, PIECES, RATE_24K, WAIT_S, Bad, Chaos, Socket, append,
                                 behaviour, deltas, env, env_append, envelope, feed, kyutai_audio, openai_socket,
                                 pieces, run_one)
from serve_load import SAMPLE, rss_bytes

BASELINE_S = 30.0  # after a round, for the server to free what its clients held
# What a round's clients held and must have given back: the samples of these gauges, summed over their labels.
HELD = re.compile(r"^(jaxstream_(?:engine_sessions|kv_pages_used|ws_connections))(?:\{.*\})? (\S+)$", re.M)


# -- HTTP (spec §7, §8) --------------------------------------------------------------------------------------------
def upload(c: Chaos, file: bytes, **fields) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", file, filename="audio.wav", content_type="audio/wav")
    for name, value in {"model": c.model, **fields}.items():
        form.add_field(name, value)
    return form


async def sse_text(response) -> str:
    """The transcript of a complete transcription stream: deltas, `transcript.text.done`, `[DONE]`."""
    if response.status != 200 or response.content_type != "text/event-stream":
        raise Bad(f"HTTP {response.status} {response.content_type}: {(await response.read())[:200]!r}")
    events = [line[6:].decode().strip() async for line in response.content if line.startswith(b"data: ")]
    if events[-1:] != ["[DONE]"] or json.loads(events[-2])["type"] != "transcript.text.done":
        raise Bad(f"the stream did not end with transcript.text.done and [DONE]: {events[-2:]}")
    events = [json.loads(event) for event in events[:-1]]
    if deltas(events[:-1]) != events[-1]["text"]:
        raise Bad("the stream's deltas do not add up to its text")
    return events[-1]["text"]


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
    """/v1/completions serves text LMs: the tiny speech model's server refuses it with the documented 4xx."""
    await c.call("POST", "/v1/completions", 400, "unsupported_model",
                 json={"model": c.model, "prompt": "Hello", "stream": rng.random() < 0.5})
    await c.call("POST", "/v1/completions", 404, "model_not_found", json={"model": "nope", "prompt": "Hello"})
    await c.call("POST", "/v1/completions", 422, "invalid_json", data=b'{"model": ',
                 headers={"Content-Type": "application/json"})


@behaviour
async def http_info(c, rng):
    for path in ("/health", "/healthz", "/ping"):
        if json.loads(await c.call("GET", path, 200)) != {"status": "ok", "model": c.model}:
            raise Bad(f"{path} is not ok")
    if json.loads(await c.call("GET", "/v1/models", 200))["data"][0]["id"] != c.model:
        raise Bad("/v1/models does not list the served model")
    if b"jaxstream_engine_healthy 1.0" not in await c.call("GET", "/metrics", 200):
        raise Bad("/metrics: the engine is not healthy")


def chunk_lines(c: Chaos, piece: str) -> list[dict]:
    parts = [c.pcm[piece][i:i + 8000] for i in range(0, c.pcm[piece].size, 8000)]
    return [{"sequence_id": n, "modality": "audio", "payload": encode_pcm16_base64(part),
             "end_of_input": n == len(parts) - 1} for n, part in enumerate(parts)]


@behaviour
async def http_streaming_input(c, rng):
    """Mode A: an NDJSON body of audio chunks, answered by SSE while it arrives."""
    piece = rng.choice(list(PIECES))

    async def body():
        for line in [{"model": c.model}] + chunk_lines(c, piece):
            yield json.dumps(line).encode() + b"\n"
            await asyncio.sleep(rng.choice((0, 0.05)))

    async with c.http.post(c.url + "/v1/audio/transcriptions", data=body(), headers={"X-Streaming-Input": "true"}) as r:
        c.same(("16k", piece), await sse_text(r))


@behaviour
async def http_session(c, rng):
    """Mode B: a session, its chunks (the first one twice), its result; a chunk for no session is a 404."""
    piece = rng.choice(list(PIECES))
    created = json.loads(await c.call("POST", "/v1/streaming_input/sessions", 201, json={"model": c.model}))
    base = f"/v1/streaming_input/sessions/{created['session_id']}"
    chunks = chunk_lines(c, piece)
    for chunk in chunks[:1] + chunks:
        async with c.http.post(c.url + base + "/chunks", json=chunk) as r:
            if r.status not in (200, 202):
                raise Bad(f"chunk {chunk['sequence_id']}: HTTP {r.status}: {(await r.read())[:200]!r}")
    c.same(("16k", piece), json.loads(await c.call("GET", base + "/result", 200))["text"])
    await c.call("POST", "/v1/streaming_input/sessions/nope/chunks", 404, "session_not_found", json=chunks[0])


# -- every other route ----------------------------------------------------------------------------------------------
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
        ws = await Socket.open(c.ws_url + "/api/asr-streaming", packed=True)
        await ws.until("Ready")
        chunks, make, rate = pieces(c.pcm24["full"], rng, (KYUTAI_FRAME,)), kyutai_audio, RATE_24K
    else:
        ws = await envelope(c)
        await ws.send(env("input_audio_buffer.commit", "u", final=False))
        chunks, make, rate = pieces(c.pcm["full"], rng), env_append, SAMPLING_RATE
    await feed(ws, chunks[:rng.randint(1, len(chunks))], make, rng, rate)
    ws.drop()


# -- the soak ---------------------------------------------------------------------------------------------------------
async def served_model(url: str, http: aiohttp.ClientSession, ready_s: float) -> str:
    """The served model's id, once /health says ready."""
    deadline = time.monotonic() + ready_s
    while True:
        try:
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return (await r.json())["model"]
        except aiohttp.ClientConnectionError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} not ready after {ready_s:g} s")
        await asyncio.sleep(1.0)


def load_sample(path: str) -> np.ndarray:
    audio, rate = soundfile.read(path, dtype="int16")
    if rate != SAMPLING_RATE or audio.ndim != 1:
        sys.exit(f"{path}: need 16 kHz mono")
    return audio.astype(np.float32) / 32768  # what PCM16 on the wire carries, exactly


async def run_each(url: str, names, seed: int = 0, timeout: float = 120.0, audio: str = str(SAMPLE),
                   ready_s: float = 300.0) -> dict[str, str | None]:
    """Runs the behaviours `names` once each, one after the other: {name: None when ok, else why not}."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        c = Chaos(url.rstrip("/"), http, await served_model(url.rstrip("/"), http, ready_s), load_sample(audio))
        rng = random.Random(seed)
        return {name: await run_one(c, name, random.Random(rng.getrandbits(64)), timeout) for name in names}


class Tally:
    def __init__(self):
        self.runs, self.bad = collections.Counter(), collections.Counter()
        self.reasons: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, name: str, reason: str | None) -> None:
        self.runs[name] += 1
        if reason is not None:
            self.bad[name] += 1
            if len(self.reasons[name]) < 3:
                self.reasons[name].append(reason)


async def worker(c: Chaos, rng: random.Random, until: float, tally: Tally, timeout: float) -> None:
    while time.monotonic() < until:
        name = rng.choice(sorted(BEHAVIOURS))
        tally.add(name, await run_one(c, name, random.Random(rng.getrandbits(64)), timeout))


async def baseline(c: Chaos) -> str | None:
    """None once the engine holds no session or KV page and no socket is open (from /metrics), else what is
    still held BASELINE_S later."""
    deadline = time.monotonic() + BASELINE_S
    while True:
        held = collections.Counter()
        for name, value in HELD.findall((await c.call("GET", "/metrics", 200)).decode()):
            held[name] += float(value)
        if not any(held.values()):
            return None
        if time.monotonic() > deadline:
            return f"{BASELINE_S:g} s after the round: {dict(held)}"
        await asyncio.sleep(0.5)


def log_counts(path: str | None) -> dict | None:
    if path is None:
        return None
    lines = Path(path).read_text(errors="replace").splitlines()
    errors = [line for line in lines if " ERROR " in line]
    return {"tracebacks": sum(line.startswith("Traceback") for line in lines), "errors": len(errors),
            "first": errors[:3]}


def report(tally: Tally, log: dict | None) -> None:
    print(f"\n{'behaviour':32} {'runs':>6} {'ok':>6} {'not ok':>6}")
    for name in [*sorted(BEHAVIOURS), "all"]:
        runs, bad = (tally.runs[name], tally.bad[name]) if name != "all" else (tally.runs.total(), tally.bad.total())
        print(f"{name:32} {runs:6} {runs - bad:6} {bad:6}")
        for reason in tally.reasons.get(name, ()):
            print(f"    {reason}")
    for line in log["first"] if log else ():
        print(f"log: {line[:300]}")


async def soak(args) -> int:
    url = args.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        c = Chaos(url, http, await served_model(url, http, args.ready_s), load_sample(args.audio))
        tally, leaks, seeds = Tally(), [], random.Random(args.seed)
        for n in range(1, args.rounds + 1):
            runs, bad = tally.runs.total(), tally.bad.total()
            until = time.monotonic() + args.round_s
            await asyncio.gather(*(worker(c, random.Random(seeds.getrandbits(64)), until, tally, args.timeout)
                                   for _ in range(args.workers)))
            leaks.append(leak := await baseline(c))
            rss, log = rss_bytes(args.pid) if args.pid else None, log_counts(args.log)
            print(f"round {n}: {tally.runs.total() - runs} runs, {tally.bad.total() - bad} not ok"
                  + (f", server RSS {rss / 2**30:.2f} GiB" if rss else "")
                  + (f", log: {log['tracebacks']} tracebacks, {log['errors']} ERROR lines" if log else "")
                  + (f", still held {leak}" if leak else ""), flush=True)
    log = log_counts(args.log)
    report(tally, log)
    return int(bool(tally.bad.total() or any(leaks) or (log and log["tracebacks"])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the behaviours' choices (default 0)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--round-s", type=float, default=45.0, help="seconds each round starts runs (default 45)")
    parser.add_argument("--workers", type=int, default=12, help="concurrent clients (default 12)")
    parser.add_argument("--timeout", type=float, default=120.0, help="a run not over after this hangs (default 120)")
    parser.add_argument("--pid", type=int, help="the server's pid, for its RSS after each round")
    parser.add_argument("--log", help="the server's log, for its tracebacks and ERROR lines")
    parser.add_argument("--audio", default=str(SAMPLE), help="16 kHz mono speech (default: the bundled sample)")
    parser.add_argument("--ready-s", type=float, default=300.0, help="wait this long for /health (default 300)")
    parser.add_argument("--once", nargs="*", metavar="BEHAVIOUR", help="no rounds: run each behaviour (default: "
                        f"all of {', '.join(sorted(BEHAVIOURS))}) once, one after the other")
    args = parser.parse_args(argv)
    if args.once is None:
        return asyncio.run(soak(args))
    if unknown := set(args.once) - set(BEHAVIOURS):
        parser.error(f"unknown behaviour(s): {', '.join(sorted(unknown))}")
    results = asyncio.run(run_each(args.url, args.once or sorted(BEHAVIOURS), args.seed, args.timeout, args.audio,
                                   args.ready_s))
    for name, reason in results.items():
        print(f"{name:32} {reason or 'ok'}")
    return int(any(results.values()))


if __name__ == "__main__":
    sys.exit(main())
