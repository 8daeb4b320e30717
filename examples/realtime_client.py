"""Transcribe an audio file through a realtime server, sending it at the pace it would be spoken.

    python examples/realtime_client.py FILE [--url ws://localhost:8000/v1/realtime] [--api-key K]
                                            [--model ID] [--delay-ms MS] [--chunk-ms 80] [--fast]

Speaks vLLM's realtime protocol, so it works against `jaxstream serve` and `vllm serve` alike: session.update,
input_audio_buffer.commit, base64 PCM16 16 kHz appends, commit with final=true, then transcription.delta
events (printed as they arrive) and one transcription.done. Needs only `websockets`, `numpy` and
`soundfile`. Files not at 16 kHz are resampled by linear interpolation (convert them with sox or ffmpeg
for the best quality).

Any failure (an unreadable file, a URL that is not ws:// or wss:// or names no realtime route, an error
event, a refused or closed connection) ends the run with one line on stderr and exit code 1. So does a
transcript the server ended before the end of the file (a jaxstream server shutting down ends the utterance
itself and says so with an `error` `server_draining` before its transcription.done): the text is printed, and
the line says how much of the file's audio the server transcribed. microphone_client.py imports the protocol
helpers below.
"""
import argparse
import asyncio
import base64
import json
import math
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


def chunk_ms(text: str) -> float:
    """--chunk-ms: milliseconds of audio per append, at least one sample (0 sent one sample per append)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not (math.isfinite(value) and value * SAMPLE_RATE / 1000 >= 1):
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds (at least one sample, "
                                         f"{1000 / SAMPLE_RATE:g} ms), got {text}")
    return value


def models_url(url: str) -> str:
    """Where the server behind the WebSocket `url` lists its models: beside the realtime route, so a server
    behind a path prefix is asked under it (`wss://host/prefix/v1/realtime` -> `https://host/prefix/v1/models`);
    at the root for any other path (SageMaker's route, or a wrong one, which the WebSocket then reports)."""
    parts = urllib.parse.urlsplit(url)
    prefix = parts.path.removesuffix("/v1/realtime") if parts.path.endswith("/v1/realtime") else ""
    return f"{'https' if parts.scheme.lower() == 'wss' else 'http'}://{parts.netloc}{prefix}/v1/models"


def served_model(url: str, api_key: str | None) -> str:
    """The first model id of the server's GET /v1/models."""
    models = models_url(url)
    request = urllib.request.Request(models, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)["data"][0]["id"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # vLLM and jaxstream list them there: the server is another kind, or a proxy hides it
            raise Failed(f"GET {models}: HTTP 404: the server lists no models there; name one with --model") from None
        raise Failed(f"the server refused GET {urllib.parse.urlsplit(models).path}: HTTP {exc.code} "
                     f"{exc.reason}") from None
    except (ValueError, LookupError, TypeError):  # not JSON, or no model listed: not a realtime server
        raise Failed(f"GET {models} listed no model; name one with --model") from None


def error_words(event: dict) -> str:
    """An `error` event as words: its message, then its code (vLLM's flat shape, or OpenAI's `error` object);
    the event as JSON when it has neither shape."""
    message, code = event.get("error"), event.get("code")
    if isinstance(message, dict):
        message, code = message.get("message"), message.get("code")
    if not isinstance(message, str):
        return json.dumps(event)
    return f"{message} (code {code})" if code else message


async def open_session(ws, model: str, delay_ms: int | None) -> None:
    """session.created, then session.update and the commit that starts the utterance."""
    try:
        created = json.loads(await ws.recv())
    except ValueError:  # a WebSocket of another protocol (Kyutai's msgpack route, say)
        raise Failed("the server's first message is not JSON: is --url a realtime route (/v1/realtime)?") from None
    if created.get("type") == "error":  # e.g. at its connection limit, or shutting down
        raise Failed(f"the server refused the session: {error_words(created)}")
    if created.get("type") != "session.created":
        raise Failed(f"the server's first event is {created.get('type')!r}, not session.created: is --url a "
                     "realtime route (/v1/realtime)?")
    update = {"type": "session.update", "model": model}
    if delay_ms is not None:
        update["transcription_delay_ms"] = delay_ms  # a jaxstream extension; vLLM ignores it
    await ws.send(json.dumps(update))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))


async def read_transcript(ws, final_sent: asyncio.Event) -> tuple[dict, str | None]:
    """Prints the deltas as they arrive and returns (the transcription.done event, the message of the
    `server_draining` error that came before it, or None).

    `server_draining` says the server ended the utterance's audio itself (it is shutting down): its done
    follows, covering only the audio received. Any other error event raises Failed: these clients send only
    valid events, so an error means no transcript is coming (a setup error such as model_not_found, or the
    utterance failed). So does DONE_TIMEOUT_S of silence once `final_sent` is set. A closed connection raises
    websockets.ConnectionClosed."""
    line_open = False
    quiet_s = 0
    notice = None
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
                return event, notice
            elif event["type"] == "error" and event.get("code") == "server_draining":
                notice = str(event.get("error"))
            elif event["type"] == "error":
                raise Failed(f"the server's error: {error_words(event)}")
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
        status = exc.response.status_code
        path = urllib.parse.urlsplit(url).path or "/"
        # No route there, or one that is not a WebSocket (jaxstream's / is the demo page): the path is wrong.
        print(f"the server has no WebSocket route {path} (HTTP {status}): check the path of --url, e.g. "
              f"ws://localhost:8000/v1/realtime" if status in (200, 404, 405) else
              f"the server refused the connection: HTTP {status}", file=sys.stderr)
    except websockets.InvalidURI as exc:  # a ws:// URL websockets cannot parse (checked_url passed the scheme)
        print(f"--url {url}: {exc}", file=sys.stderr)
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
    chunk = int(SAMPLE_RATE * args.chunk_ms / 1000)
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
            done, notice = await read_transcript(ws, final_sent)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)  # a closed socket is the reader's to report
    usage = done.get("usage") or {}
    heard = usage.get("audio_seconds")  # jaxstream's: the audio the transcript covers (vLLM does not say)
    if heard is not None:  # a notice that came once the whole file was sent (before its final) cut nothing short
        incomplete = round(heard * SAMPLE_RATE) < len(pcm)
    else:
        incomplete = notice is not None
    if incomplete:
        covered = f"{heard:.2f} s" if heard is not None else "part"
        raise Failed(f"incomplete transcript: the server transcribed {covered} of the {len(pcm) / SAMPLE_RATE:.2f} s "
                     f"of audio in {args.file}" + (f": {notice}" if notice else ""))
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
    parser.add_argument("--chunk-ms", type=chunk_ms, default=80.0, help="audio per append (default 80 ms)")
    parser.add_argument("--fast", action="store_true", help="send as fast as possible instead of in real time")
    args = parser.parse_args()
    return run_client(transcribe(args), args.url)


if __name__ == "__main__":
    sys.exit(main())
