"""The server's periodic `malloc_trim` (serving/memory.py) hands freed heap pages back to the system: after a
thread frees most of a fragmented heap, RSS falls by most of it with the trim and stays up without it (the
control, so the check can fail)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, threading
    import numpy as np
    from jaxstream.serving.memory import malloc_trimmer

    def rss_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    kept = []
    def work():  # another thread: its own malloc arena, as the server's threads have
        blocks = [np.ones(512) for _ in range(60_000)]  # 4 KB blocks (arena memory, not mmap): ~240 MiB
        kept.extend(blocks[::64])  # what stays alive pins a page here and there: the heap cannot shrink
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    before = rss_mib()
    if sys.argv[1] == "trim":
        malloc_trimmer()()
    print(before - rss_mib())
""")


def _released_mib(mode: str) -> float:
    # glibc's malloc as it comes: no tuning, and no allocator preloaded in its place (TCMalloc has no trim).
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_") and key != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, env=env, timeout=120,
                            capture_output=True, text=True)
    return float(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_servers_trim_returns_freed_heap_pages():
    assert _released_mib("trim") > 150
    assert _released_mib("keep") < 20  # the control: glibc keeps them by itself


async def test_a_running_server_trims_on_a_worker_thread(monkeypatch):
    import asyncio
    import threading

    from aiohttp.test_utils import TestServer

    from jaxstream.serving import app as server_app

    calls = []
    monkeypatch.setattr(server_app, "TRIM_PERIOD_S", 0.05)
    monkeypatch.setattr(server_app, "malloc_trimmer", lambda: lambda: calls.append(threading.current_thread()))
    def no_engine():
        raise RuntimeError("this test needs no engine")

    server = TestServer(server_app.create_app(engine_factory=no_engine))
    await server.start_server()
    try:
        await asyncio.sleep(0.5)
    finally:
        await server.close()
    assert len(calls) >= 3 and threading.main_thread() not in calls
    count = len(calls)
    await asyncio.sleep(0.2)
    assert len(calls) == count  # stopped with the server
