"""A bare WebSocket client, to replay step by step what a serve_chaos.py run found: it sends the frames given on its
command line to a WebSocket route of `jaxstream serve` and prints every answer and the close.

    python benchmarks/serve_chaos_replay.py ws://127.0.0.1:8123/v1/realtime \\
        '{"type": "session.update", "model": "tiny"}' '{"type": "input_audio_buffer.commit"}' @frame.bin
"""
import argparse
import asyncio
import json
from pathlib import Path

import msgpack
import websockets


async def bare_client(url: str, frames: list[str], packed: bool, wait_s: float) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        async def show():
            async for frame in ws:
                print("<", msgpack.unpackb(frame) if packed and isinstance(frame, bytes) else frame, flush=True)

        reader = asyncio.create_task(show())
        try:
            for frame in frames:
                data = Path(frame[1:]).read_bytes() if frame.startswith("@") else frame
                print(">", frame[:200], flush=True)
                await ws.send(msgpack.packb(json.loads(data)) if packed else data)
                await asyncio.sleep(0.05)  # so that an answer prints after the frame it answers
            await asyncio.wait([reader], timeout=wait_s)
        except websockets.ConnectionClosed:
            pass
        reader.cancel()
    print("closed:", ws.close_code, ws.close_reason)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a WebSocket route, e.g. ws://127.0.0.1:8123/v1/realtime")
    parser.add_argument("frames", nargs="*", metavar="FRAME", help="sent in order as text frames; @FILE: the "
                        "file's bytes as one binary frame")
    parser.add_argument("--msgpack", action="store_true", help="frames are JSON sent packed, answers unpacked "
                        "(Kyutai's route)")
    parser.add_argument("--wait", type=float, default=3.0, help="seconds to read answers after the last frame "
                        "(default 3)")
    args = parser.parse_intermixed_args(argv)
    asyncio.run(bare_client(args.url, args.frames, args.msgpack, args.wait))


if __name__ == "__main__":
    main()
