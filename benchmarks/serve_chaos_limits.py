"""Behaviours of serve_chaos.py that meet what the server refuses or cuts short: a client that stops reading
(send_timeout_s), one that goes quiet (idle_timeout_s), one that stays too long (max_session_seconds), API keys
(good, wrong, missing, on every kind of route), and requests no route takes (404, 405, 426, a malformed WebSocket
handshake's 400). Each checks the exact answer serving/limits.py, serving/auth.py and serving/http_errors.py
document: the error event or HTTP error code, then the close code.

The ones that wait for a limit run only when the soak knows the server's limits (--server-config, the TOML the
server was started with) and the limit is at most MAX_LIMIT_S; the key behaviour only against a keyed server
(--api-key). benchmarks/serve_chaos.toml holds limits short enough for a soak.
"""
import asyncio
import base64
import contextlib
import json
import random
import socket
import time
import urllib.parse

import aiohttp
import numpy as np
import websockets

from jaxstream.models.audio import SAMPLING_RATE
from serve_chaos_clients import (RATE_24K, WAIT_S, Bad, Chaos, Socket, append, auth_headers, behaviour, code_of, env,
                                 env_append, kyutai_audio, openai_socket, openai_update, pieces)
from serve_chaos_http import SESSIONS, chunk_lines, mode_a, sse_events, upload

MAX_LIMIT_S = 60.0  # a behaviour waits for a limit only up to this long
SLACK_S = 2.0  # after a limit's time, for the server to act on it
CLOSE_IDLE, CLOSE_MAX_DURATION, CLOSE_UNAUTHORIZED, CLOSE_POLICY = 4000, 4003, 4001, 1008
# Prompt text echoed by each of the slow reader's session.updated: 3 of them overfill loopback's socket buffers (the
# server's send buffer grows to 4 MiB), where deltas alone (~60 bytes every 80 ms) would take hours.
BALLAST_BYTES, BALLAST_UPDATES = 5 << 19, 3
KYUTAI_SAYS = {"idle_timeout": "idle", "max_duration_exceeded": "maximum duration"}  # in its Error's message


def waits_for(limit: str):
    """`needs` of a behaviour that waits for the server's `limit` (a Limits field)."""
    def needs(c: Chaos) -> str | None:
        if not c.known_limits:
            return "the server's limits (--server-config)"
        value = getattr(c.limits, limit)
        return None if value <= MAX_LIMIT_S else f"{limit} <= {MAX_LIMIT_S:g} s (the server's is {value:g} s)"

    return needs


def keyed(c: Chaos) -> str | None:
    return None if c.key else "a keyed server (--api-key)"


async def counter(c: Chaos, name: str, **labels) -> float:
    """The sum of /metrics samples `name` whose labels include `labels`."""
    total = 0.0
    for line in (await c.call("GET", "/metrics", 200)).decode().splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


async def until_error(ws: Socket) -> dict:
    """The next error event (`error`, Kyutai's `Error`), skipping every other event (deltas, Steps, ...)."""
    while (event := await ws.recv())["type"] not in ("error", "Error"):
        pass
    return event


def check_error(event: dict, code: str, route: str) -> None:
    """`event` is the error `code` in the route's shape (/ws: `code` and `reason_code`; Kyutai: an Error, which carries
    only the message, limits.py's)."""
    if route == "kyutai":
        if event["type"] != "Error" or KYUTAI_SAYS[code] not in event["message"]:
            raise Bad(f"expected an Error about {KYUTAI_SAYS[code]!r}, got {event}")
        return
    wanted = {"idle_timeout": ("idle_timeout", "idle_timeout"),
              "max_duration_exceeded": ("max_duration", "max_duration_exceeded")}[code] if route == "envelope" else None
    got = (event["payload"].get("code"), event["payload"].get("reason_code")) if route == "envelope" else code_of(event)
    if got != (wanted or code):
        raise Bad(f"expected error {code}: {json.dumps(event)[:300]}")


async def limited_socket(c: Chaos, route: str, rng: random.Random, **options) -> Socket:
    """A socket of `route` that is ready for audio (its session created, updated or Ready)."""
    if route == "openai":
        return await openai_socket(c, rng, **options)
    if route in ("realtime", "sagemaker"):
        return await c.realtime("/v1/realtime" if route == "realtime" else "/invocations-bidirectional-stream",
                                **options)
    if route == "kyutai":
        ws = await c.open("/api/asr-streaming", packed=True, **options)
        await ws.until("Ready")
        return ws
    ws = await c.open("/ws", **options)
    await ws.until("session.created")
    return ws


def silence(seconds: float, rate: int = SAMPLING_RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


# -- a client that stops reading (websocket.py: send_timeout_s) ----------------------------------------------------
@behaviour(needs=waits_for("send_timeout_s"))
async def limits_slow_reader(c, rng):
    """A client that stops reading its socket while a turn's deltas stream (OpenAI's dialect: a few session.update
    whose session.updated echo a long prompt fill the socket buffers, BALLAST_*). The server's send waits
    send_timeout_s, then it drops the connection and counts it as `slow_reader` (serving/websocket.py says closed
    with 1008; aiohttp abandons a socket whose send was cancelled, so the client sees no close frame): what the
    client reads once it resumes ends, with no close or a 1008, before the echoes and the turn's transcript."""
    closed = "jaxstream_ws_connections_closed_total"
    before = await counter(c, closed, outcome="slow_reader")
    url = urllib.parse.urlsplit(c.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # before connecting: no receive-window autotuning
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    # max_queue=1: once a frame waits unread, websockets stops reading the socket (as a client busy elsewhere).
    ws = await openai_socket(c, rng, sock=sock, max_queue=1)
    chunks = pieces(c.pcm24["full"], rng, (4800,))
    half = len(chunks) * 2 // 3
    for chunk in chunks[:half]:
        await ws.send(append(chunk))
    await ws.until("conversation.item.input_audio_transcription.delta")  # deltas stream; from here on none is read
    ballast = openai_update(c.model)
    ballast["session"]["audio"]["input"]["transcription"]["prompt"] = "x" * BALLAST_BYTES

    async def send():  # blocks once the server stops reading too; a server that never cuts the client ends the turn
        with contextlib.suppress(Bad):  # the server dropped the connection
            for _ in range(BALLAST_UPDATES):
                await ws.send(ballast)
            for chunk in chunks[half:]:
                await ws.send(append(chunk))
            await ws.send({"type": "input_audio_buffer.commit"})

    sender = asyncio.create_task(send())
    await asyncio.sleep(c.limits.send_timeout_s + SLACK_S)
    # Reading again before the server acted would unblock its send: wait for its count too (with runs side by side,
    # another run's may come first; the wait above makes that rare).
    deadline = time.monotonic() + WAIT_S
    while await counter(c, closed, outcome="slow_reader") <= before and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    try:  # what the client reads once it resumes: the server's sends that were on their way, never the item's end
        while True:
            if json.loads(await asyncio.wait_for(ws.ws.recv(), WAIT_S))["type"] == "conversation.item.done":
                raise Bad("the server waited for a client that did not read: the turn ended")
    except TimeoutError:
        raise Bad(f"no close within {WAIT_S:g} s of resuming") from None
    except websockets.ConnectionClosed as exc:
        if exc.rcvd is not None and exc.rcvd.code != CLOSE_POLICY:
            raise Bad(f"expected no close frame or {CLOSE_POLICY}, got {exc.rcvd.code} {exc.rcvd.reason!r}") from None
    finally:
        sender.cancel()  # done already, unless the run failed
    if await counter(c, closed, outcome="slow_reader") <= before:
        raise Bad("the server did not count a slow_reader close")


# -- idle timeout and maximum duration (limits.py) ------------------------------------------------------------------
@behaviour(needs=waits_for("idle_timeout_s"))
async def limits_idle(c, rng):
    """A client that goes quiet (protocol pings, sent every second, are no activity): a WebSocket gets the error
    idle_timeout (/ws: code and reason_code idle_timeout; Kyutai: an Error) and close 4000, no sooner than
    idle_timeout_s after its last message, an open utterance or not; a Mode A body that stalls ends its SSE stream
    with the error idle_timeout and [DONE]; an upload that stalls before its form is read gets a 408 (idle_timeout,
    or body_too_slow where the body's minimum rate runs out first) that closes the connection."""
    idle, route = c.limits.idle_timeout_s, rng.choice(("realtime", "sagemaker", "openai", "envelope", "kyutai",
                                                       "mode_a", "upload"))
    if route in ("mode_a", "upload"):
        return await stalled_body(c, rng, route)
    ws = await limited_socket(c, route, rng, ping_interval=min(1.0, idle / 4))
    if rng.random() < 0.5:  # an utterance open when the client goes quiet
        if route in ("realtime", "sagemaker"):
            await ws.send({"type": "input_audio_buffer.commit"})
            last = append(c.pcm["head"])
        elif route == "envelope":
            await ws.send(env("input_audio_buffer.commit", "u", final=False))
            last = env_append(c.pcm["head"])
        else:
            last = (kyutai_audio if route == "kyutai" else append)(c.pcm24["head"])
    else:  # a message the server answers (Kyutai's: audio, answered by Steps)
        last = {"realtime": {"type": "session.update", "model": c.model}, "openai": openai_update(c.model),
                "envelope": env("ping", "p"), "kyutai": kyutai_audio(silence(0.08, RATE_24K))}[
            "realtime" if route == "sagemaker" else route]
    quiet = time.monotonic()  # before the server can have received the last message
    await ws.send(last)
    check_error(await until_error(ws), "idle_timeout", route)
    await ws.closed_with(CLOSE_IDLE)
    if time.monotonic() - quiet < idle:
        raise Bad(f"closed {time.monotonic() - quiet:.1f} s after the last message, before the {idle:g} s timeout")


async def stalled_body(c: Chaos, rng: random.Random, route: str) -> None:
    """A Mode A body, or an upload's form, that stops arriving partway."""
    limits = c.limits
    if route == "mode_a":  # the parameters and some chunks
        lines = [json.dumps(line).encode() + b"\n" for line in [{"model": c.model}] + chunk_lines(c, "full")[:-1]]
        sent, headers = lines[:rng.randint(2, len(lines))], {"X-Streaming-Input": "true"}
    else:  # the form's head and part of the file
        boundary, wav = f"chaos{rng.getrandbits(32)}", c.wav["full"]
        sent = [(f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{c.model}\r\n--{boundary}\r\n'
                 'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n').encode(),
                wav[:rng.randrange(100, len(wav))]]
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    quiet = None

    async def body():
        nonlocal quiet
        for n, part in enumerate(sent):
            if n == len(sent) - 1:
                quiet = time.monotonic()  # before the server can have read the last part
            yield part
        await asyncio.sleep(3600)  # the rest never comes

    async with c.http.post(c.url + "/v1/audio/transcriptions", data=body(), headers=headers) as r:
        if route == "mode_a":
            events = await sse_events(r)
            code = code_of(events[-2][1]) if len(events) > 1 and events[-1][1] == "[DONE]" else None
            if code != "idle_timeout":
                raise Bad(f"a stalled Mode A body: the stream ended with {events[-2:]}")
        else:
            answer = await r.read()
            # The body's rate rule (limits.read_at_min_rate) runs out body_grace_s + bytes / body_min_rate after the
            # request began: within a second of the idle timeout, either may answer first.
            rate_due = limits.body_grace_s + sum(map(len, sent)) / (limits.body_min_rate or 1e-9)
            codes = ({"idle_timeout"} if limits.idle_timeout_s < rate_due - 1 else {"body_too_slow"}
                     if limits.idle_timeout_s > rate_due + 1 else {"idle_timeout", "body_too_slow"})
            code = json.loads(answer)["error"]["code"] if r.status == 408 else None
            if code not in codes or r.headers.get("Connection", "").lower() != "close":
                raise Bad(f"a stalled upload: HTTP {r.status} {r.headers.get('Connection')!r} {answer[:200]!r}, "
                          f"expected 408 {' or '.join(sorted(codes))} closing the connection")
    if code == "idle_timeout" and time.monotonic() - quiet < limits.idle_timeout_s:
        raise Bad(f"{code} {time.monotonic() - quiet:.1f} s after the body stalled, before the "
                  f"{limits.idle_timeout_s:g} s timeout")


@behaviour(needs=lambda c: waits_for("max_session_seconds")(c) or waits_for("idle_timeout_s")(c))
async def limits_max_duration(c, rng):
    """A client that stays active (a message at least every second) past max_session_seconds: a WebSocket gets the
    error max_duration_exceeded (/ws: code max_duration, reason_code max_duration_exceeded; Kyutai: an Error) and
    close 4003, no sooner than that age; a Mode A stream ends with the error max_duration_exceeded and [DONE], as does
    a Mode B session's /events stream, and the session's later chunks get 410 session_expired."""
    age, route = c.limits.max_session_seconds, rng.choice(("realtime", "openai", "envelope", "kyutai", "mode_a",
                                                          "mode_b"))
    every, opened = min(1.0, c.limits.idle_timeout_s / 3), time.monotonic()
    if route in ("mode_a", "mode_b"):
        await long_http_stream(c, route, every)
    else:
        ws = await limited_socket(c, route, rng)
        keep_alive = {"realtime": {"type": "session.update", "model": c.model}, "openai": openai_update(c.model),
                      "envelope": env("ping", "p"), "kyutai": kyutai_audio(silence(0.08, RATE_24K))}[route]

        async def active():
            with contextlib.suppress(Bad):  # the server closed
                while True:
                    await ws.send(keep_alive)
                    await asyncio.sleep(every)

        sender = asyncio.create_task(active())
        try:
            check_error(await until_error(ws), "max_duration_exceeded", route)
            await ws.closed_with(CLOSE_MAX_DURATION)
        finally:
            sender.cancel()
    if time.monotonic() - opened < age:
        raise Bad(f"ended {time.monotonic() - opened:.1f} s after it opened, before the {age:g} s maximum")


async def long_http_stream(c: Chaos, route: str, every: float) -> None:
    """A Mode A request or a Mode B session with a chunk of silence every `every` seconds, until the server ends it."""
    def silent(n: int) -> dict:
        return {"sequence_id": n, "modality": "audio", "payload": base64.b64encode(bytes(3200)).decode(),
                "end_of_input": False}

    if route == "mode_a":
        async def body():
            yield json.dumps({"model": c.model}).encode() + b"\n"
            for n in range(10**6):
                yield json.dumps(silent(n)).encode() + b"\n"
                await asyncio.sleep(every)

        async with mode_a(c, body()) as r:
            events = await sse_events(r)
    else:
        created = json.loads(await c.call("POST", SESSIONS, 201, json={"model": c.model, "stream": True}))
        base = f"{SESSIONS}/{created['session_id']}"

        async def send():
            for n in range(10**6):
                async with c.http.post(c.url + base + "/chunks", json=silent(n)) as r:
                    if r.status == 410:
                        return
                    if r.status != 202:
                        raise Bad(f"chunk {n}: HTTP {r.status} {(await r.read())[:200]!r}")
                await asyncio.sleep(every)

        async with asyncio.TaskGroup() as group:
            sender = group.create_task(send())
            async with c.http.get(c.url + base + "/events") as r:
                events = await sse_events(r)
            await asyncio.wait_for(sender, WAIT_S)  # its next chunk finds the session closed: 410
        await c.call("POST", base + "/chunks", 410, "session_expired", json=silent(10**6))
    tail = [code_of(data) if isinstance(data, dict) else data for _, data in events[-2:]]
    if tail != ["max_duration_exceeded", "[DONE]"]:
        raise Bad(f"{route}: the stream ended with {events[-2:]}")


# -- API keys (auth.py) ---------------------------------------------------------------------------------------------
WS_ROUTES = ("/v1/realtime", "/invocations-bidirectional-stream", "/api/asr-streaming")


@behaviour(needs=keyed)
async def auth_keys(c, rng):
    """Against a keyed server: with no key or a wrong one, every HTTP route (an unknown path too: the key is checked
    before routing) answers 401 invalid_api_key with `WWW-Authenticate: Bearer`, and the WebSocket routes refuse the
    handshake with 401, except /ws, which sends the error unauthorized/invalid_api_key and closes with 4001; health
    and metrics need no key. With the key, in any of the forms each route takes (Bearer, X-API-Key, ?api_key=, the
    browser subprotocol openai-insecure-api-key.K, Kyutai's kyutai-api-key and ?auth_id=), each route answers."""
    wrong = {"Authorization": f"Bearer {c.key}x"} if rng.random() < 0.5 else {"X-API-Key": "not-" + c.key}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as bare:  # sends no key itself
        requests = [("GET", "/v1/models", dict), ("POST", "/v1/audio/transcriptions",
                                                  lambda: {"data": upload(c, c.wav["head"])}),
                    ("POST", "/v1/completions", lambda: {"json": {"model": c.model, "prompt": "Hi"}}),
                    ("POST", SESSIONS, lambda: {"json": {"model": c.model}}), ("GET", "/nope", dict),
                    ("GET", WS_ROUTES[0], dict)]
        for method, path, fields in requests:
            for headers in ({}, wrong):
                async with bare.request(method, c.url + path, headers=headers, **fields()) as r:
                    body = await r.read()
                if r.status != 401 or r.headers.get("WWW-Authenticate") != "Bearer" or \
                        json.loads(body)["error"]["code"] != "invalid_api_key":
                    raise Bad(f"{method} {path} with {headers or 'no key'}: HTTP {r.status} {body[:200]!r}")
        for path in ("/health", "/metrics"):
            async with bare.get(c.url + path) as r:
                if r.status != 200:
                    raise Bad(f"{path} without a key: HTTP {r.status}")
        form = rng.choice(("bearer", "header", "query"))
        headers = {"bearer": auth_headers(c.key), "header": {"X-API-Key": c.key}, "query": {}}[form]
        query = f"?api_key={c.key}" if form == "query" else ""
        async with bare.get(c.url + "/v1/models" + query, headers=headers) as r:
            if r.status != 200:
                raise Bad(f"/v1/models with the key as {form}: HTTP {r.status}")
    for path in WS_ROUTES:
        for headers in ({}, wrong):
            try:
                ws = await Socket.open(c.ws_url + path, additional_headers=headers)
            except websockets.InvalidStatus as exc:
                if exc.response.status_code != 401:
                    raise Bad(f"{path} with {headers or 'no key'}: handshake HTTP {exc.response.status_code}") from None
            else:
                raise Bad(f"{path} with {headers or 'no key'}: the handshake succeeded")
        await keyed_socket(c, path, rng)
    for headers in ({}, wrong):
        ws = await Socket.open(c.ws_url + "/ws", additional_headers=headers)
        event = await ws.recv()
        if (event["type"], event["payload"].get("code"), event["payload"].get("reason_code")) != (
                "error", "unauthorized", "invalid_api_key"):
            raise Bad(f"/ws with {headers or 'no key'}: {event}")
        await ws.closed_with(CLOSE_UNAUTHORIZED)
    await keyed_socket(c, "/ws", rng)


async def keyed_socket(c: Chaos, path: str, rng: random.Random) -> None:
    """A socket to `path` that presents the key in one of the forms the route takes: it opens, and closes with 1000."""
    forms = ["bearer", "query", "header"] + (["kyutai", "auth_id"] if path == "/api/asr-streaming" else ["subprotocol"])
    form = rng.choice(forms)
    headers = {"bearer": auth_headers(c.key), "header": {"X-API-Key": c.key},
               "kyutai": {"kyutai-api-key": c.key}}.get(form, {})
    query = {"query": f"?api_key={c.key}", "auth_id": f"?auth_id={c.key}"}.get(form, "")
    # A browser's WebSocket offers the protocol it speaks beside its key; the server selects that, never the key.
    offered = ["realtime" if path == "/v1/realtime" and rng.random() < 0.5 else "vllm-realtime",
               f"openai-insecure-api-key.{c.key}"] if form == "subprotocol" else None
    ws = await Socket.open(c.ws_url + path + query, packed=path == "/api/asr-streaming", additional_headers=headers,
                           subprotocols=offered)
    if offered and ws.ws.subprotocol != offered[0]:
        raise Bad(f"{path}: offered {offered}, the server selected {ws.ws.subprotocol!r}")
    first = await ws.recv()
    if first["type"] not in ("session.created", "Ready"):
        raise Bad(f"{path} with the key as {form}: {first}")
    await ws.close()


# -- requests no route takes (http_errors.routing_errors_middleware) -----------------------------------------------
async def raw_request(c: Chaos, head: bytes) -> tuple[int, dict, dict]:
    """Sends `head` (request line and headers, as given: any bytes) on a connection of its own; (status, headers
    in lower case, JSON body)."""
    url = urllib.parse.urlsplit(c.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(head)
        status = await asyncio.wait_for(reader.readline(), WAIT_S)
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), WAIT_S)).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), WAIT_S)
    finally:
        writer.close()
    return int(status.split()[1]), headers, json.loads(body)


def handshake(c: Chaos, path: str, **fields: bytes) -> bytes:
    """A WebSocket handshake for `path` with the server's key; `fields` replace (None: leave out) its headers."""
    key = base64.b64encode(random.randbytes(16))
    headers = {b"Host": b"chaos", b"Upgrade": b"websocket", b"Connection": b"Upgrade", b"Sec-WebSocket-Version": b"13",
               b"Sec-WebSocket-Key": key, **{k.encode(): v.encode() for k, v in auth_headers(c.key).items()},
               **{k.replace("_", "-").encode(): v for k, v in fields.items()}}
    lines = [b"GET " + path.encode() + b" HTTP/1.1"] + [k + b": " + v for k, v in headers.items() if v is not None]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@behaviour
async def http_routing_refusals(c, rng):
    """An unknown path is a 404 unknown_url, a method its route does not take a 405 method_not_allowed whose Allow
    names the route's methods, a plain GET of a WebSocket route a 426 upgrade_required with `Upgrade: websocket`
    (all three counted in jaxstream_http_routing_errors), and a handshake without `Connection: Upgrade`, with a
    bad Sec-WebSocket-Key (not base64, not 16 bytes, not ASCII) or version a 400 invalid_request that names the
    header."""
    before = await counter(c, "jaxstream_http_routing_errors_total")
    path = rng.choice(("/nope", "/v1/audio/translations", "/v1/embeddings", "/v1/realtime/x", "/ws/"))
    await c.call(rng.choice(("GET", "POST")), path, 404, "unknown_url")
    method, path, allow = rng.choice([("GET", "/v1/audio/transcriptions", "POST"), ("DELETE", "/v1/models", "GET,HEAD"),
                                      ("PUT", SESSIONS, "POST"), ("POST", "/health", "GET,HEAD"),
                                      ("GET", SESSIONS + "/x/finish", "POST")])
    async with c.http.request(method, c.url + path) as r:
        body = await r.read()
    if (r.status, r.headers.get("Allow"), json.loads(body)["error"]["code"]) != (405, allow, "method_not_allowed"):
        raise Bad(f"{method} {path}: HTTP {r.status} Allow {r.headers.get('Allow')!r} {body[:200]!r}")
    ws_route = rng.choice(("/v1/realtime", "/invocations-bidirectional-stream", "/ws", "/api/asr-streaming"))
    async with c.http.get(c.url + ws_route) as r:
        body = await r.read()
    answer = (r.status, r.headers.get("Upgrade"), json.loads(body)["error"]["code"])
    if answer != (426, "websocket", "upgrade_required"):
        raise Bad(f"GET {ws_route} without an upgrade: HTTP {r.status} {body[:200]!r}")
    if await counter(c, "jaxstream_http_routing_errors_total") < before + 3:
        raise Bad("the 404, 405 and 426 were not counted in jaxstream_http_routing_errors")
    fault, header = rng.choice([({"Connection": rng.choice((b"keep-alive", None))}, "Connection: Upgrade"),
                                ({"Sec_WebSocket_Key": rng.choice((b"not base64!", b"c2hvcnQ=", b"\xff\xfe", None))},
                                 "Sec-WebSocket-Key"),
                                ({"Sec_WebSocket_Version": rng.choice((b"12", None))}, "Sec-WebSocket-Version")])
    status, _, body = await raw_request(c, handshake(c, ws_route, **fault))
    if status != 400 or body["error"]["code"] != "invalid_request" or header not in body["error"]["message"]:
        raise Bad(f"a handshake with {fault}: HTTP {status} {body}")
