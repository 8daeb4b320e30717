"""Robustness soak of a running `jaxstream serve`: concurrent clients that each pick, at random (seeded), a
behaviour, well-behaved or hostile, on every protocol and route the server speaks, for rounds of a given length.
It reports per behaviour how many runs ended as the protocol says they should ("ok"), the first reasons of the
others and its slowest run, and after each round the server's RSS, whether the engine is back at zero sessions, KV
pages and open sockets, and (--log) the tracebacks and ERROR lines in the server's log.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 jaxstream serve --port 8123 \\
        --api-key chaos-key --config benchmarks/serve_chaos.toml > LOG 2>&1 &
    python benchmarks/serve_chaos.py --url http://127.0.0.1:8123 --api-key chaos-key \\
        --server-config benchmarks/serve_chaos.toml --seed 1 --rounds 3 --round-s 45 --workers 12 --pid $! --log LOG

The behaviours are functions, one per client behaviour: the WebSocket ones in serve_chaos_clients.py, the HTTP ones
in serve_chaos_http.py, server VAD in serve_chaos_vad.py, in serve_chaos_limits.py the server's limits, API keys and
routing refusals, and in serve_chaos_text.py and serve_chaos_guided.py (structured outputs, allowed ids, bad words)
those of a server over a text LM (which runs them instead of the others: serve_chaos_text.py's docstring says how to
serve one). "As expected" is what specs/realtime_protocols.md and the
serving modules have the server answer in its default (strict) mode: a transcript whose deltas add up to it and that
equals every other transcript of the same audio at the same rate, whatever the route or the load (so cross-talk
between streams shows), or the structured error or HTTP 4xx documented for that input or limit, the socket kept or
closed as documented. Not ok: no answer within --timeout, a 5xx, another error, a connection dropped without a close
frame that the client did not drop itself. Exit status 1 when a run was not ok, a round ended with engine sessions,
KV pages or sockets still held, or the log has a traceback. `--once [BEHAVIOUR ...]` runs each behaviour (or the
named ones) once instead, one after the other, to replay what a soak found.

The soak assumes the server's default limits unless told the TOML it was started with (--server-config; its
[limits]): only then do the behaviours that wait for the idle timeout, the maximum duration or the send timeout
run (benchmarks/serve_chaos.toml makes each a matter of seconds; every other behaviour stays within them). With
--api-key every request presents the key, and the key behaviour checks refusals without it; without, that
behaviour does not run. --api-key-file gives the server's key file instead: its first key is --api-key's, the others
are other clients' (the text flood's: one key floods the request queue, another's request must still be served).
Each round's report names the behaviours that did not run and why.
"""
import argparse
import asyncio
import collections
import contextlib
import random
import re
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import soundfile

import serve_chaos_guided
import serve_chaos_http
import serve_chaos_limits
import serve_chaos_text
import serve_chaos_vad
from jaxstream.errors import UserError
from jaxstream.models.audio import SAMPLING_RATE
from jaxstream.serving.auth import load_api_keys
from jaxstream.serving.config import load_server_file
from jaxstream.serving.limits import Limits
from serve_chaos_clients import BEHAVIOURS, Chaos, auth_headers, of_kind, run_one, unavailable
from serve_load import SAMPLE, rss_bytes

# Imported for what they register.
BEHAVIOUR_MODULES = (serve_chaos_guided, serve_chaos_http, serve_chaos_limits, serve_chaos_text, serve_chaos_vad)
BASELINE_S = 30.0  # after a round, for the server to free what its clients held
# What a round's clients held and must have given back: the samples of these gauges, summed over their labels.
HELD = re.compile(r"^(jaxstream_(?:engine_sessions|kv_pages_used|ws_connections))(?:\{.*\})? (\S+)$", re.M)


# -- the soak ---------------------------------------------------------------------------------------------------------
async def served_model(url: str, http: aiohttp.ClientSession, ready_s: float) -> tuple[str, str]:
    """The served model's id and kind ("text" when /v1/models gives its context length, else "speech"), once
    /health says ready."""
    deadline = time.monotonic() + ready_s
    while True:
        try:
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    async with http.get(url + "/v1/models") as models:
                        model = (await models.json())["data"][0]
                    return model["id"], "speech" if model["max_model_len"] is None else "text"
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


@contextlib.asynccontextmanager
async def connect(url: str, timeout: float, audio: str, ready_s: float, key: str | None = None,
                  limits: Limits | None = None, other_keys: tuple[str, ...] = ()):
    """The Chaos of the server at `url`, once it is ready; its HTTP session presents `key` on every request, and
    `other_keys` are the server's others (`c.other_keys`: other clients')."""
    url = url.rstrip("/")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(key),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        model, kind = await served_model(url, http, ready_s)
        chaos = Chaos(url, http, model, load_sample(audio), key, limits, kind)
        chaos.other_keys = other_keys
        yield chaos


async def run_each(url: str, names, seed: int = 0, timeout: float = 120.0, audio: str = str(SAMPLE),
                   ready_s: float = 300.0, key: str | None = None, limits: Limits | None = None,
                   other_keys: tuple[str, ...] = ()) -> tuple[dict[str, str | None], dict[str, str]]:
    """Runs the behaviours `names` (those for the served model's kind) once each, one after the other: ({name: None
    when ok, else why not}, {name: what it needs, for those this server cannot run})."""
    async with connect(url, timeout, audio, ready_s, key, limits, other_keys) as c:
        rng = random.Random(seed)
        names = of_kind(c.kind, names)
        skipped = {name: why for name in names if (why := unavailable(c, name))}
        return {name: await run_one(c, name, random.Random(rng.getrandbits(64)), timeout)
                for name in names if name not in skipped}, skipped


class Tally:
    def __init__(self):
        self.runs, self.bad = collections.Counter(), collections.Counter()
        self.slowest: dict[str, float] = collections.defaultdict(float)
        self.reasons: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, name: str, reason: str | None, seconds: float) -> None:
        self.runs[name] += 1
        self.slowest[name] = max(self.slowest[name], seconds)
        if reason is not None:
            self.bad[name] += 1
            if len(self.reasons[name]) < 3:
                self.reasons[name].append(reason)


async def worker(c: Chaos, names: list[str], rng: random.Random, until: float, tally: Tally, timeout: float) -> None:
    while time.monotonic() < until:
        name, start = rng.choice(names), time.monotonic()
        reason = await run_one(c, name, random.Random(rng.getrandbits(64)), timeout)
        tally.add(name, reason, time.monotonic() - start)


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


def report(tally: Tally, names: list[str], skipped: dict[str, str], log: dict | None) -> None:
    print(f"\n{'behaviour':32} {'runs':>6} {'ok':>6} {'not ok':>6} {'slowest s':>9}")
    for name in [*names, "all"]:
        runs, bad = (tally.runs[name], tally.bad[name]) if name != "all" else (tally.runs.total(), tally.bad.total())
        slowest = tally.slowest[name] if name != "all" else max(tally.slowest.values(), default=0.0)
        print(f"{name:32} {runs:6} {runs - bad:6} {bad:6} {slowest:9.1f}")
        for reason in tally.reasons.get(name, ()):
            print(f"    {reason}")
    for name, why in skipped.items():
        print(f"not run: {name} (needs {why})")
    for line in log["first"] if log else ():
        print(f"log: {line[:300]}")


async def soak(args, limits: Limits | None) -> int:
    async with connect(args.url, args.timeout, args.audio, args.ready_s, args.api_key, limits, args.other_keys) as c:
        skipped = {name: why for name in of_kind(c.kind) if (why := unavailable(c, name))}
        names = [name for name in of_kind(c.kind) if name not in skipped]
        tally, leaks, seeds = Tally(), [], random.Random(args.seed)
        for n in range(1, args.rounds + 1):
            runs, bad = tally.runs.total(), tally.bad.total()
            until = time.monotonic() + args.round_s
            await asyncio.gather(*(worker(c, names, random.Random(seeds.getrandbits(64)), until, tally, args.timeout)
                                   for _ in range(args.workers)))
            leaks.append(leak := await baseline(c))
            rss, log = rss_bytes(args.pid) if args.pid else None, log_counts(args.log)
            print(f"round {n}: {tally.runs.total() - runs} runs, {tally.bad.total() - bad} not ok"
                  + (f", server RSS {rss / 2**30:.2f} GiB" if rss else "")
                  + (f", log: {log['tracebacks']} tracebacks, {log['errors']} ERROR lines" if log else "")
                  + (f", still held {leak}" if leak else ""), flush=True)
    log = log_counts(args.log)
    report(tally, names, skipped, log)
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
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", metavar="K", help="the server's API key: every request presents it, and the key "
                      "behaviour runs")
    keys.add_argument("--api-key-file", metavar="F", help="the server's key file: its first key is --api-key's, the "
                      "others other clients' (the text flood needs three keys)")
    parser.add_argument("--server-config", metavar="TOML", help="the TOML the server was started with (--config): "
                        "its [limits], and the behaviours that wait for them")
    parser.add_argument("--once", nargs="*", metavar="BEHAVIOUR", help="no rounds: run each behaviour (default: "
                        f"all of {', '.join(sorted(BEHAVIOURS))}) once, one after the other")
    args = parser.parse_args(argv)
    try:
        limits = Limits(**load_server_file(args.server_config).limits) if args.server_config else None
    except (UserError, ValueError) as exc:
        parser.error(f"--server-config: {exc}")
    args.other_keys = ()
    if args.api_key_file:
        try:
            keys = load_api_keys(None, args.api_key_file)
        except UserError as exc:
            parser.error(str(exc))
        args.api_key, args.other_keys = keys[0], keys[1:]
    if args.once is None:
        return asyncio.run(soak(args, limits))
    if unknown := set(args.once) - set(BEHAVIOURS):
        parser.error(f"unknown behaviour(s): {', '.join(sorted(unknown))}")
    results, skipped = asyncio.run(run_each(args.url, args.once or sorted(BEHAVIOURS), args.seed, args.timeout,
                                            args.audio, args.ready_s, args.api_key, limits, args.other_keys))
    for name, reason in results.items():
        print(f"{name:32} {reason or 'ok'}")
    for name, why in skipped.items():
        print(f"{name:32} not run: needs {why}")
    return int(any(results.values()))


if __name__ == "__main__":
    sys.exit(main())
