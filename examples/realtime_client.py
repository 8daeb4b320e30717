"""Transcribe an audio file through a realtime server, sending it at the pace it would be spoken.

    python examples/realtime_client.py FILE [--url ws://localhost:8000/v1/realtime] [--api-key K]
                                            [--model ID] [--delay-ms MS] [--chunk-ms 80] [--fast]

Speaks vLLM's realtime protocol, so it works against `jaxstream serve` and `vllm serve` alike: session.update,
input_audio_buffer.commit, base64 PCM16 16 kHz appends, commit with final=true, then transcription.delta
events (printed as they arrive) and one transcription.done. Needs only `websockets`, `numpy` and
`soundfile`. Files not at 16 kHz are resampled by linear interpolation (convert them with sox or ffmpeg
for the best quality).

Any failure (an unreadable file, a URL that is not ws:// or wss://, an error event, a refused or closed
connection) ends the run with one line on stderr and exit code 1. microphone_client.py imports the protocol
helpers below.
"""
import argparse
import asyncio
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

SAMPLE_RATE = 16000
# Silence from the server for this long after the final commit: its transcription.done is not coming.
DONE_TIMEOUT_S = 60


class Failed(Exception):
    """Ends the run: its message is printed as one line on stderr and the exit code is 1."""


def checked_url(url: str) -> str:
    """`url` if it is a WebSocket URL with a host and a valid port; otherwise Failed, naming the ws:// (wss://)
    form of an http:// (https://) one: the realtime API is a WebSocket, and websockets refuses any other scheme
    with a traceback. The host and port are checked here, before anything parses them: urllib (GET /v1/models)
    and websockets raise ValueError or http.client.InvalidURL tracebacks for a port that is not a number or a
    bracket left open, and a URL without a host failed only once the client tried to connect."""
    scheme, separator, rest = url.partition("://")
    if separator and scheme.lower() in ("http", "https"):
        raise Failed(f"--url {url}: the realtime API is a WebSocket: use --url "
                     f"{scheme.lower().replace('http', 'ws')}://{rest}")
    if not separator or scheme.lower() not in ("ws", "wss"):
        raise Failed(f"--url {url}: expected a ws:// or wss:// URL, e.g. ws://localhost:8000/v1/realtime")
    try:
        parts = urllib.parse.urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise Failed(f"--url {url}: {exc}") from None
    if not host:
        raise Failed(f"--url {url}: no host, e.g. ws://localhost:8000/v1/realtime")
    return url


def load_pcm16(path: str) -> np.ndarray:
    """The file as mono int16 samples at 16 kHz; Failed when it cannot be opened or is not audio."""
    import soundfile

    try:
        with open(path, "rb") as file:  # Python's error names a missing file; libsndfile's says "System error"
            samples, rate = soundfile.read(file, dtype="float32", always_2d=True)
    except OSError as exc:
        raise Failed(f"cannot read {path}: {exc.strerror or exc}") from None
    except soundfile.SoundFileError as exc:  # not a format libsndfile reads (text, or mp3 before libsndfile 1.1)
        raise Failed(f"cannot read {path} as audio: {getattr(exc, 'error_string', exc)}") from None
    mono = samples.mean(axis=1)
    if rate != SAMPLE_RATE:
        positions = np.arange(0, len(mono) * SAMPLE_RATE / rate) * rate / SAMPLE_RATE
        mono = np.interp(positions, np.arange(len(mono)), mono).astype(np.float32)
    return (np.clip(mono, -1.0, 1.0) * 32767).astype("<i2")


def served_model(url: str, api_key: str | None) -> str:
    """The first model id of the server's GET /v1/models."""
    http = url.replace("wss://", "https://").replace("ws://", "http://").split("/v1/realtime")[0]
    request = urllib.request.Request(http + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        try:
            return json.load(response)["data"][0]["id"]
        except (ValueError, LookupError, TypeError):  # not JSON, or no model listed: not a realtime server
            raise Failed(f"GET {http}/v1/models listed no model; name one with --model") from None


async def open_session(ws, model: str, delay_ms: int | None) -> None:
    """session.created, then session.update and the commit that starts the utterance."""
    created = json.loads(await ws.recv())
    if created.get("type") != "session.created":
        raise Failed(f"refused: {created}")
    update = {"type": "session.update", "model": model}
    if delay_ms is not None:
        update["transcription_delay_ms"] = delay_ms  # a jaxstream extension; vLLM ignores it
    await ws.send(json.dumps(update))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))


async def read_transcript(ws, final_sent: asyncio.Event) -> dict:
    """Prints the deltas as they arrive and returns the transcription.done event.

    An error event raises Failed: these clients send only valid events, so an error means no transcript is
    coming (a setup error such as model_not_found, or the utterance failed). So does DONE_TIMEOUT_S of
    silence once `final_sent` is set. A closed connection raises websockets.ConnectionClosed."""
    line_open = False
    quiet_s = 0
    try:
        while True:
            try:
                message = await asyncio.wait_for(ws.recv(), 1.0)  # cancelling recv() loses no message
            except TimeoutError:
                quiet_s = quiet_s + 1 if final_sent.is_set() else 0
                if quiet_s >= DONE_TIMEOUT_S:
                    raise Failed(f"no transcription.done {DONE_TIMEOUT_S} s after the final commit") from None
                continue
            quiet_s = 0
            event = json.loads(message)
            if event["type"] == "transcription.delta":
                print(event["delta"], end="", flush=True)
                line_open = True
            elif event["type"] == "transcription.done":
                return event
            elif event["type"] == "error":
                raise Failed(f"error {event.get('code')}: {event.get('error')}")
    finally:
        if line_open:
            print()  # ends the transcript's line before what follows it on the terminal


def run_client(coroutine, url: str) -> int:
    """Runs `coroutine` (it returns the exit code); a failure ends as one line on stderr and exit code 1."""
    import websockets

    try:
        return asyncio.run(coroutine)
    except KeyboardInterrupt:
        return 130
    except Failed as exc:
        print(exc, file=sys.stderr)
    except websockets.ConnectionClosed as exc:  # e.g. 4000 idle_timeout, 4003 max duration, 1001 draining
        print(f"the server closed the connection: {exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd else
              "the connection to the server was lost", file=sys.stderr)
    except websockets.InvalidStatus as exc:  # e.g. 401: a missing or wrong API key
        print(f"the server refused the connection: HTTP {exc.response.status_code}", file=sys.stderr)
    except websockets.InvalidURI as exc:  # a ws:// URL websockets cannot parse (checked_url passed the scheme)
        print(f"--url {url}: {exc}", file=sys.stderr)
    except urllib.error.HTTPError as exc:  # from GET /v1/models
        print(f"the server refused GET /v1/models: HTTP {exc.code} {exc.reason}", file=sys.stderr)
    except OSError as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
    return 1


async def transcribe(args) -> int:
    import websockets

    checked_url(args.url)
    pcm = load_pcm16(args.file)
    if pcm.size == 0:
        raise Failed(f"{args.file} holds no audio")
    model = args.model or served_model(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chunk = max(1, int(SAMPLE_RATE * args.chunk_ms / 1000))
    async with websockets.connect(args.url, additional_headers=headers, max_size=None) as ws:
        await open_session(ws, model, args.delay_ms)
        start = time.monotonic()
        final_sent = asyncio.Event()

        async def send_audio():
            for begin in range(0, len(pcm), chunk):
                piece = pcm[begin:begin + chunk]
                if not args.fast:  # send each chunk once its last sample would have been spoken
                    await asyncio.sleep(max(0.0, start + (begin + len(piece)) / SAMPLE_RATE - time.monotonic()))
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(piece.tobytes()).decode("ascii")}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            final_sent.set()

        sender = asyncio.create_task(send_audio())
        try:
            done = await read_transcript(ws, final_sent)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)  # a closed socket is the reader's to report
    usage = done.get("usage") or {}
    print(f"[{time.monotonic() - start:.2f} s, {len(pcm) / SAMPLE_RATE:.2f} s of audio, "
          f"{usage.get('completion_tokens')} tokens]", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="audio file (wav, flac, ogg, ...)")
    parser.add_argument("--url", default="ws://localhost:8000/v1/realtime")
    parser.add_argument("--api-key", default=os.environ.get("JAXSTREAM_API_KEY"))
    parser.add_argument("--model", default=None, help="model id (default: the server's first, from /v1/models)")
    parser.add_argument("--delay-ms", type=int, default=None, help="transcription delay (jaxstream servers)")
    parser.add_argument("--chunk-ms", type=float, default=80.0, help="audio per append (default 80 ms)")
    parser.add_argument("--fast", action="store_true", help="send as fast as possible instead of in real time")
    args = parser.parse_args()
    return run_client(transcribe(args), args.url)


if __name__ == "__main__":
    sys.exit(main())
