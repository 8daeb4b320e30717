"""Live transcription of the microphone through a realtime server; Ctrl-C ends the utterance.

    python examples/microphone_client.py [--url ws://localhost:8000/v1/realtime] [--api-key K] [--model ID]
                                         [--delay-ms MS]

Speaks vLLM's realtime protocol (works against `jaxstream serve` and `vllm serve`): it records 16 kHz mono,
sends every 80 ms of audio as it is captured, prints the text as it streams back, and on Ctrl-C sends the
final commit and prints the final transcript. Needs `websockets`, `numpy` and `sounddevice`
(`pip install sounddevice`; on Linux also the PortAudio library, e.g. `apt install libportaudio2`).
"""
import argparse
import asyncio
import base64
import json
import os
import signal
import sys

import numpy as np

from realtime_client import SAMPLE_RATE, served_model

CHUNK = 1280  # 80 ms: one model step


def open_microphone(loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue):
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: the module is there, PortAudio is not
        sys.exit(f"microphone_client.py needs sounddevice and PortAudio: pip install sounddevice ({exc})")

    def captured(data, frames, time_info, status):
        if status:
            print(f"[microphone: {status}]", file=sys.stderr)
        pcm16 = (np.clip(data[:, 0], -1.0, 1.0) * 32767).astype("<i2").tobytes()
        loop.call_soon_threadsafe(chunks.put_nowait, pcm16)  # the callback runs on PortAudio's thread

    return sounddevice.InputStream(samplerate=SAMPLE_RATE, channels=1, dtype="float32", blocksize=CHUNK,
                                   callback=captured)


async def run(args) -> int:
    import websockets

    model = args.model or served_model(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue = asyncio.Queue()
    async with websockets.connect(args.url, additional_headers=headers) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            print(f"refused: {created}", file=sys.stderr)
            return 1
        update = {"type": "session.update", "model": model}
        if args.delay_ms is not None:
            update["transcription_delay_ms"] = args.delay_ms
        await ws.send(json.dumps(update))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

        async def send_audio():
            try:
                while True:
                    pcm16 = await chunks.get()
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm16).decode("ascii")}))
            except asyncio.CancelledError:  # Ctrl-C: the utterance ends here
                await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))

        async def receive() -> int:
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "transcription.delta":
                    print(event["delta"], end="", flush=True)
                elif event["type"] == "transcription.done":
                    print(f"\n\nfinal: {event['text']}")
                    return 0
                elif event["type"] == "error":
                    print(f"\nerror {event.get('code')}: {event.get('error')}", file=sys.stderr)
            print("\nthe server closed the connection", file=sys.stderr)
            return 1

        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        with open_microphone(loop, chunks):
            print("listening; Ctrl-C to stop", file=sys.stderr)
            sender = asyncio.create_task(send_audio())
            receiver = asyncio.create_task(receive())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({receiver, stopped}, return_when=asyncio.FIRST_COMPLETED)
        sender.cancel()  # sends the final commit
        await asyncio.gather(sender, return_exceptions=True)
        stopped.cancel()
        return await receiver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://localhost:8000/v1/realtime")
    parser.add_argument("--api-key", default=os.environ.get("JAXSTREAM_API_KEY"))
    parser.add_argument("--model", default=None, help="model id (default: the server's first, from /v1/models)")
    parser.add_argument("--delay-ms", type=int, default=None, help="transcription delay (jaxstream servers)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
