"""Load test of `jaxstream serve`: N WebSocket clients, each sending speech at real time, for a while.

    python benchmarks/serve_load.py --spawn [--streams 16,64] [--seconds 30] [--chunk-ms 80]
    python benchmarks/serve_load.py --url ws://HOST:PORT/v1/realtime [--pid PID] [--api-key K]

Each client repeats utterances of the bundled sample (4.4 s; or --audio FILE): commit, 80 ms appends each
sent when its last sample would have been spoken, final commit, wait for transcription.done; the clients'
starts are spread over one utterance so they do not move in lockstep. Per utterance it measures

- first-delta latency: arrival of the first delta - the moment the audio of the first word had been sent
  (the word's start in a warm-up run's `words`). The first delta is a word's text, which may follow the
  word's start marker by a slot, so this errs high by up to 80 ms; it includes the model's delay.
- finalisation latency: final commit -> transcription.done.

A stream count is *sustained at real time* when every utterance ended within delay + 1 s of its final
commit (conformance test 44) and no client failed. Server RSS (psutil if installed, else /proc) is sampled
every second (--spawn, or --pid for a server you started). Clients and server share the machine, so the
server's CPU time over each level is printed too (Linux /proc; its event-loop thread and all the others),
with its CPU milliseconds per second of audio sent: on a busy machine that compares better across runs
than latencies do.

Soak: `--streams 64 --seconds 600 --report-every 60` prints the utterances so far and the server's RSS
every minute. Before the first level and after each one (once its sessions ended), the engine's KV pages
in use and sessions held are read from `/metrics`: after a level they should be back at the baseline.
"""
import argparse
import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
SAMPLE = Path(__file__).resolve().parents[1] / "models" / "assets" / "samples" / "sample.wav"


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_pcm16(path: Path) -> bytes:
    import soundfile

    samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    if rate != SAMPLE_RATE:
        sys.exit(f"{path}: {rate} Hz; give a 16 kHz file")
    return (np.clip(samples.mean(axis=1), -1, 1) * 32767).astype("<i2").tobytes()


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the process so far: all of it, and its main (event-loop) thread.
    Linux only. (CPython 3.11 does not name its threads for the OS, so the others cannot be told apart.)"""
    def seconds(stat_file: Path) -> float:
        stat = stat_file.read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return {"total": seconds(Path(f"/proc/{pid}/stat")), "event loop": seconds(Path(f"/proc/{pid}/task/{pid}/stat"))}


class Spawned:
    """`jaxstream serve` in a subprocess on a free port."""

    def __init__(self, max_sessions: int, extra: list[str]):
        command = [sys.executable, "-m", "jaxstream", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--max-sessions", str(max_sessions), "--log-level", "warning", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = None
        started = time.monotonic()
        for line in self.process.stdout:
            print(f"  server: {line.rstrip()}", file=sys.stderr)
            found = re.search(r"listening on http://([^;\s]+)", line)
            if found:
                self.url = f"ws://{found.group(1)}/v1/realtime"
            if "ready:" in line:
                print(f"  server ready after {time.monotonic() - started:.1f} s", file=sys.stderr)
                return
        raise SystemExit("the server exited before it was ready")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Results:
    def __init__(self):
        self.first_delta: list[float] = []
        self.finalize: list[float] = []
        self.utterances = 0
        self.failures: list[str] = []
        self.rss: list[int] = []
        self.cpu: dict[str, float] = {}  # server CPU seconds during the level: "total", "event loop"
        self.audio_sent = 0.0  # seconds of audio the clients sent


async def one_client(url, headers, model, pcm16: bytes, chunk_bytes: int, first_word_s: float, until: float,
                     offset: float, results: Results) -> None:
    import websockets

    await asyncio.sleep(offset)
    loop = asyncio.get_running_loop()
    try:
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "session.update", "model": model}))
            while loop.time() < until:
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                start = loop.time()
                first_delta = None

                async def send():
                    for begin in range(0, len(pcm16), chunk_bytes):
                        piece = pcm16[begin:begin + chunk_bytes]
                        await asyncio.sleep(max(0.0, start + (begin + len(piece)) / 2 / SAMPLE_RATE - loop.time()))
                        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": base64.b64encode(piece).decode("ascii")}))
                        results.audio_sent += len(piece) / 2 / SAMPLE_RATE
                    await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
                    return loop.time()

                sender = asyncio.create_task(send())
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if event["type"] == "transcription.delta" and first_delta is None:
                        first_delta = loop.time() - start - first_word_s
                    elif event["type"] == "transcription.done":
                        break
                    elif event["type"] == "error":
                        raise RuntimeError(f"{event.get('code')}: {event.get('error')}")
                final_at = await sender
                results.finalize.append(loop.time() - final_at)
                if first_delta is not None:
                    results.first_delta.append(first_delta)
                results.utterances += 1
    except Exception as exc:  # noqa: BLE001 - counted and reported; the other clients go on
        results.failures.append(f"{type(exc).__name__}: {exc}")


async def warm_up(url, headers, pcm16: bytes) -> tuple[str, float, int]:
    """The model id, the sample's first word start (from a fast run's word timings) and the delay."""
    import websockets

    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.recv()
        http = url.replace("ws://", "http://").split("/v1/realtime")[0]
        model = await asyncio.to_thread(_first_model, http, headers)
        await ws.send(json.dumps({"type": "session.update", "model": model}))
        updated = json.loads(await ws.recv())
        delay = updated["session"]["transcription_delay_ms"]
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "transcription.done":
                if not event.get("words"):
                    raise SystemExit("the warm-up transcript has no words (a strict-mode jaxstream server is needed)")
                return model, event["words"][0]["start"], delay


def _first_model(http: str, headers: dict) -> str:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(http + "/v1/models", headers=headers), timeout=10) as r:
        return json.load(r)["data"][0]["id"]


async def run_level(url, headers, model, pcm16, args, streams: int, first_word_s: float, pid: int | None) -> Results:
    results = Results()
    loop = asyncio.get_running_loop()
    utterance_s = len(pcm16) / 2 / SAMPLE_RATE
    until = loop.time() + args.seconds
    chunk_bytes = 2 * int(SAMPLE_RATE * args.chunk_ms / 1000)

    async def sample_rss():
        while True:
            if pid is not None and (rss := rss_bytes(pid)) is not None:
                results.rss.append(rss)
            await asyncio.sleep(1.0)

    async def report():
        started = loop.time()
        while True:
            await asyncio.sleep(args.report_every)
            rss = f"{results.rss[-1] / 2**20:.0f} MiB" if results.rss else "n/a"
            print(f"        {loop.time() - started:6.0f} s: {results.utterances} utterances, "
                  f"{len(results.failures)} failures, server RSS {rss}", flush=True)

    cpu_before = cpu_seconds(pid) if pid is not None and sys.platform == "linux" else None
    started = loop.time()
    sampler = asyncio.create_task(sample_rss())
    reporter = asyncio.create_task(report()) if args.report_every else None
    await asyncio.gather(*(one_client(url, headers, model, pcm16, chunk_bytes, first_word_s, until,
                                      utterance_s * i / streams, results) for i in range(streams)))
    sampler.cancel()
    if reporter is not None:
        reporter.cancel()
    if cpu_before is not None:
        results.cpu = {part: seconds - cpu_before[part] for part, seconds in cpu_seconds(pid).items()}
        results.cpu["elapsed"] = loop.time() - started
    return results


def engine_holdings(http: str, headers: dict) -> dict[str, float]:
    """The engine's sessions and KV pages in use per pool, from the server's Prometheus metrics."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(http + "/metrics", headers=headers), timeout=10) as r:
        text = r.read().decode()
    holdings = {}
    for line in text.splitlines():
        found = re.match(r'(jaxstream_engine_sessions|jaxstream_kv_pages_used)(?:\{pool="(\w+)"\})? (\S+)', line)
        if found:
            name, pool, value = found.groups()
            holdings["sessions" if pool is None else f"{pool} pages"] = float(value)
    return holdings


async def settled_holdings(http: str, headers: dict, timeout: float = 30.0) -> str:
    """`engine_holdings` once no session is left (or after `timeout`), as one line."""
    deadline = time.monotonic() + timeout
    while True:
        holdings = await asyncio.to_thread(engine_holdings, http, headers)
        if not holdings.get("sessions") or time.monotonic() > deadline:
            return ", ".join(f"{name} {value:g}" for name, value in sorted(holdings.items()))
        await asyncio.sleep(0.5)


def percentile(values, q) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def main_async(args) -> None:
    pcm16 = load_pcm16(Path(args.audio))
    levels = [int(n) for n in args.streams.split(",")]
    spawned = None
    url, pid = args.url, args.pid
    if args.spawn:
        spawned = Spawned(max(levels), args.server_arg or [])
        url, pid = spawned.url, spawned.process.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = url.replace("ws://", "http://").split("/v1/realtime")[0]
    try:
        model, first_word_s, delay_ms = await warm_up(url, headers, pcm16)
        print(f"engine before the load: {await settled_holdings(http, headers)}")
        print(f"server {url} model {model!r} delay {delay_ms} ms; {args.seconds:g} s per level, "
              f"{args.chunk_ms:g} ms chunks; first word of the sample starts at {first_word_s:.2f} s")
        print(f"{'streams':>7} {'utts':>5} {'fail':>4} {'first p50':>9} {'first p99':>9} {'final p50':>9} "
              f"{'final p99':>9} {'real time':>9} {'RSS MiB':>13}")
        for streams in levels:
            r = await run_level(url, headers, model, pcm16, args, streams, first_word_s, pid)
            bound = delay_ms / 1000 + 1.0
            realtime = not r.failures and r.finalize and max(r.finalize) <= bound
            rss = f"{min(r.rss) / 2**20:.0f}-{max(r.rss) / 2**20:.0f}" if r.rss else "n/a"
            print(f"{streams:>7} {r.utterances:>5} {len(r.failures):>4} {percentile(r.first_delta, 50):>7.0f}ms "
                  f"{percentile(r.first_delta, 99):>7.0f}ms {percentile(r.finalize, 50):>7.0f}ms "
                  f"{percentile(r.finalize, 99):>7.0f}ms {'yes' if realtime else 'NO':>9} {rss:>13}", flush=True)
            for failure in sorted(set(r.failures))[:5]:
                print(f"        failure: {failure}")
            if r.cpu:
                cpu, elapsed = r.cpu, r.cpu["elapsed"]
                print(f"        server CPU {cpu['total'] / elapsed:.2f} cores "
                      f"(event loop {cpu['event loop'] / elapsed:.2f});"
                      f" {1000 * cpu['total'] / max(r.audio_sent, 1e-9):.0f} ms CPU per second of audio"
                      f" ({r.audio_sent:.0f} s sent)")
            if r.rss:
                print(f"        server RSS first/last sample {r.rss[0] / 2**20:.0f}/{r.rss[-1] / 2**20:.0f} MiB")
            print(f"        engine after the level: {await settled_holdings(http, headers)}", flush=True)
    finally:
        if spawned is not None:
            spawned.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server's ws://HOST:PORT/v1/realtime")
    target.add_argument("--spawn", action="store_true", help="start `jaxstream serve` for the run")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    parser.add_argument("--api-key", default=os.environ.get("JAXSTREAM_API_KEY"))
    parser.add_argument("--streams", default="16,64", help="comma-separated stream counts (default 16,64)")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each level (default 30)")
    parser.add_argument("--chunk-ms", type=float, default=80.0, help="audio per append (default 80)")
    parser.add_argument("--audio", default=str(SAMPLE), help="16 kHz speech file (default: the bundled sample)")
    parser.add_argument("--server-arg", action="append", help="extra `jaxstream serve` argument (--spawn)")
    parser.add_argument("--report-every", type=float, default=0.0,
                        help="print progress and server RSS every this many seconds (soak runs; default off)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
