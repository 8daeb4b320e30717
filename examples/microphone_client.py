"""Live transcription of the microphone through a realtime server; Ctrl-C ends the utterance.

    python examples/microphone_client.py [--url ws://localhost:8000/v1/realtime] [--api-key K] [--model ID]
                                         [--delay-ms MS]

Speaks vLLM's realtime protocol (works against `jaxstream serve` and `vllm serve`): it records 16 kHz mono,
sends every 80 ms of audio as it is captured, prints the text as it streams back, and on Ctrl-C sends the
final commit and prints the final transcript (a second Ctrl-C stops waiting for it). A server that ends the
utterance itself (shutting down) sends its final transcript all the same: it is printed, then a line saying
that it stops there, and the exit code is 1. Needs `websockets`, `numpy` and `sounddevice` (`pip install
sounddevice`; on Linux also the PortAudio library, e.g. `apt install libportaudio2`): without them, or without
an input device, it says so in one line before it connects."""
import argparse
import asyncio
import base64
import json
import os
import signal
import sys

import numpy as np

from realtime_client import (SAMPLE_RATE, Failed, checked_url, open_session, read_transcript, run_client,
                             served_model)

CHUNK = 1280  # 80 ms: one model step


def open_microphone(loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue):
    """An input stream (opened, not started: `with` starts it) whose 80 ms blocks go to `chunks` as PCM16.

    Called before the client connects: a missing sounddevice, PortAudio or input device is a Failed line
    then, not an exit from inside the session with the server's reader running (a traceback, and a 1011
    close on the server)."""
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: the module is there, PortAudio is not
        raise Failed(f"microphone_client.py needs sounddevice and PortAudio: pip install sounddevice "
                     f"(and e.g. apt install libportaudio2): {exc}") from None

    def captured(data, frames, time_info, status):
        if status:
            print(f"[microphone: {status}]", file=sys.stderr)
        pcm16 = (np.clip(data[:, 0], -1.0, 1.0) * 32767).astype("<i2").tobytes()
        loop.call_soon_threadsafe(chunks.put_nowait, pcm16)  # the callback runs on PortAudio's thread

    try:
        return sounddevice.InputStream(samplerate=SAMPLE_RATE, channels=1, dtype="float32", blocksize=CHUNK,
                                       callback=captured)
    except sounddevice.PortAudioError as exc:  # e.g. no input device
        raise Failed(f"cannot open the microphone: {exc}") from None


async def run(args) -> int:
    import websockets

    checked_url(args.url)
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue = asyncio.Queue()
    microphone = open_microphone(loop, chunks)
    model = args.model or served_model(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with websockets.connect(args.url, additional_headers=headers) as ws:
        await open_session(ws, model, args.delay_ms)
        appends = 0
        final_sent = asyncio.Event()

        async def send(pcm16: bytes) -> None:
            nonlocal appends
            appends += 1
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm16).decode("ascii")}))

        async def send_audio():
            while True:
                await send(await chunks.get())

        stop = asyncio.Event()

        def interrupted():
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C stops waiting for the transcript
            stop.set()

        loop.add_signal_handler(signal.SIGINT, interrupted)
        receiver = asyncio.create_task(read_transcript(ws, final_sent))
        with microphone:
            print("listening; Ctrl-C to stop", file=sys.stderr)
            sender = asyncio.create_task(send_audio())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({receiver, stopped}, return_when=asyncio.FIRST_COMPLETED)
        sender.cancel()
        stopped.cancel()
        await asyncio.gather(sender, stopped, return_exceptions=True)
        if not receiver.done():  # Ctrl-C: the utterance ends here
            while not chunks.empty():  # captured before the microphone closed
                await send(chunks.get_nowait())
            if appends == 0:  # Ctrl-C within the first 80 ms: the server would refuse an empty utterance
                receiver.cancel()
                await asyncio.gather(receiver, return_exceptions=True)
                raise Failed("no audio was captured")
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            final_sent.set()
            print("finishing the transcript; Ctrl-C again to stop waiting", file=sys.stderr)
        done, notice = await receiver
        print(f"\nfinal: {done['text']}")
        if notice is not None:  # the server ended the utterance itself (shutting down): the text stops there
            raise Failed(f"incomplete transcript: {notice}")
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://localhost:8000/v1/realtime")
    parser.add_argument("--api-key", default=os.environ.get("JAXSTREAM_API_KEY"))
    parser.add_argument("--model", default=None, help="model id (default: the server's first, from /v1/models)")
    parser.add_argument("--delay-ms", type=int, default=None, help="transcription delay (jaxstream servers)")
    args = parser.parse_args()
    return run_client(run(args), args.url)


if __name__ == "__main__":
    sys.exit(main())
