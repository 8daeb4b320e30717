"""Transcribe an audio file through a realtime server, sending it at the pace it would be spoken.

    python examples/realtime_client.py FILE [--url ws://localhost:8000/v1/realtime] [--api-key K]
                                            [--model ID] [--delay-ms MS] [--chunk-ms 80] [--fast]

Speaks vLLM's realtime protocol, so it works against `jaxstream serve` and `vllm serve` alike: session.update,
input_audio_buffer.commit, base64 PCM16 16 kHz appends, commit with final=true, then transcription.delta
events (printed as they arrive) and one transcription.done. Needs only `websockets`, `numpy` and
`soundfile`. Files not at 16 kHz are resampled by linear interpolation (convert them with sox or ffmpeg
for the best quality).
"""
import argparse
import asyncio
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request

import numpy as np

SAMPLE_RATE = 16000


def load_pcm16(path: str) -> np.ndarray:
    """The file as mono int16 samples at 16 kHz."""
    import soundfile

    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
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
        return json.load(response)["data"][0]["id"]


async def transcribe(args) -> int:
    import websockets

    pcm = load_pcm16(args.file)
    model = args.model or served_model(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chunk = max(1, int(SAMPLE_RATE * args.chunk_ms / 1000))
    async with websockets.connect(args.url, additional_headers=headers, max_size=None) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            print(f"refused: {created}", file=sys.stderr)
            return 1
        update = {"type": "session.update", "model": model}
        if args.delay_ms is not None:
            update["transcription_delay_ms"] = args.delay_ms  # a jaxstream extension; vLLM ignores it
        await ws.send(json.dumps(update))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        start = time.monotonic()

        async def send_audio():
            for begin in range(0, len(pcm), chunk):
                piece = pcm[begin:begin + chunk]
                if not args.fast:  # send each chunk once its last sample would have been spoken
                    await asyncio.sleep(max(0.0, start + (begin + len(piece)) / SAMPLE_RATE - time.monotonic()))
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(piece.tobytes()).decode("ascii")}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))

        sender = asyncio.create_task(send_audio())
        try:
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "transcription.delta":
                    print(event["delta"], end="", flush=True)
                elif event["type"] == "transcription.done":
                    print()
                    usage = event.get("usage") or {}
                    print(f"[{time.monotonic() - start:.2f} s, {len(pcm) / SAMPLE_RATE:.2f} s of audio, "
                          f"{usage.get('completion_tokens')} tokens]", file=sys.stderr)
                    return 0
                elif event["type"] == "error":
                    print(f"\nerror {event.get('code')}: {event.get('error')}", file=sys.stderr)
            print("\nthe server closed the connection before transcription.done", file=sys.stderr)
            return 1
        finally:
            sender.cancel()


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
    import websockets

    try:
        return asyncio.run(transcribe(args))
    except KeyboardInterrupt:
        return 130
    except websockets.InvalidStatus as exc:  # e.g. 401: a missing or wrong API key
        print(f"the server refused the connection: HTTP {exc.response.status_code}", file=sys.stderr)
        return 1
    except urllib.error.HTTPError as exc:  # from GET /v1/models
        print(f"the server refused GET /v1/models: HTTP {exc.code} {exc.reason}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
