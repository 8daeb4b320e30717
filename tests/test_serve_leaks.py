"""Rounds of clients on every route leave nothing behind. Each round: every WebSocket dialect's client cut
off mid-audio and while text streams (a closing handshake, a dropped TCP connection), a complete vLLM
utterance, an upload, a Mode A request, a Mode B session read to its result and one abandoned mid-input.
After the first round (what is made once: caches, metrics children), the server and the engine must hold no
more instances of jaxstream's classes, asyncio queues or server-loop tasks than before the second round (a
finished client's session, transcript, event log or task that stays reachable grows with every client:
session 32's Mode B leak kept every later session's result until shutdown), and no engine stream, audio
front end or Mode B session at all. Counted with `gc`: the oracle is what is still reachable, not what the
server reports."""
import asyncio
import collections
import gc

import aiohttp
import pytest

from jaxstream.serving.http_sessions import STREAMING_INPUT
from jaxstream.serving.testing import RealtimeClient, ServerThread, stream_utterance, wait_engine_baseline, wait_until
from serve_fixtures import audio, engine, engine_returns_to_baseline, model  # noqa: F401 - pytest fixtures
from test_serve_disconnects import _DRIVERS
from test_serve_envelope import opened
from test_serve_http import SESSIONS, call, chunks_of, wav  # noqa: F401 - wav: a fixture
from test_serve_http_streaming import ndjson

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(engine):
    server = ServerThread(engine)
    sessions = server.app[STREAMING_INPUT]
    sessions.session_timeout_s = sessions.resume_grace_s = 1.0  # finished and abandoned sessions go at once
    yield server
    server.close()


async def _one_round(server, model, engine, audio, wav) -> None:
    for driver in _DRIVERS.values():
        for point, how in (("mid_audio", "close"), ("output_streaming", "abort")):
            ws = await driver(server, model, engine, audio).reach(point)
            await ws.close() if how == "close" else ws.transport.abort()
    envelope = await opened(server)  # the /ws envelope, cut off while text streams
    await envelope.send("session.update", {"model": model})
    await envelope.send("input_audio_buffer.commit", {"final": False}, request_id="u1")
    await envelope.append(audio, request_id="u1")
    await envelope.until("transcription.delta")
    envelope.ws.transport.abort()
    client = await RealtimeClient.connect(server.url())
    await client.update(model)
    await client.until("session.updated")
    assert (await stream_utterance(client, audio))["done"]["text"]
    await client.close()
    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData({"model": model})
        form.add_field("file", wav, filename="sample.wav")
        status, _ = await call(http, server, "POST", "/v1/audio/transcriptions", data=form)
        assert status == 200
        async with http.post(server.url("/v1/audio/transcriptions", "http"), data=b"".join(ndjson(model, audio)),
                             headers={"X-Streaming-Input": "true"}) as response:
            assert response.status == 200 and (await response.text()).endswith("data: [DONE]\n\n")
        chunks = chunks_of(audio)
        for abandoned in (False, True):
            _, created = await call(http, server, "POST", SESSIONS, json={"model": model})
            base = f"{SESSIONS}/{created['session_id']}"
            for chunk in chunks[:2] if abandoned else chunks:
                assert (await call(http, server, "POST", base + "/chunks", json=chunk))[0] in (200, 202)
            if not abandoned:
                status, result = await call(http, server, "GET", base + "/result")
                assert status == 200 and result["text"], result
    registry = server.app[STREAMING_INPUT]
    await wait_until(lambda: not registry.sessions and not server.state.connections, timeout=10,
                     failure=lambda: f"still open: {list(registry.sessions)}, {len(server.state.connections)} "
                                     "connections")
    await wait_engine_baseline(engine)


# The roots of one client's state: an engine stream, its audio front end, a Mode B session.
_ONE_CLIENTS_STATE = ("TranscriptionSession", "StreamFrontEnd", "InputSession")


def _census(server) -> collections.Counter:
    """Live instances of jaxstream's classes (and asyncio queues) by name, and the server loop's tasks."""
    async def tasks():
        return len(asyncio.all_tasks())

    gc.collect()
    counts = collections.Counter()
    for obj in gc.get_objects():
        module = type(obj).__dict__.get("__module__")  # a str, except on some metaclasses
        if isinstance(module, str) and module.startswith(("jaxstream", "asyncio.queues")):
            counts[f"{module}.{type(obj).__qualname__}"] += 1
    counts["server loop tasks"] = server.call(tasks())
    return counts


async def test_rounds_of_clients_on_every_route_leave_no_objects_behind(server, model, engine, audio, wav):
    await _one_round(server, model, engine, audio, wav)
    before = _census(server)
    # One more round: a leak keeps at least one object per client of it (two rounds were CI time for nothing).
    await _one_round(server, model, engine, audio, wav)
    after = _census(server)
    grown = {name: (before[name], count) for name, count in after.items() if count > before[name]}
    assert not grown, f"instances that outlived their clients (after one round, after one more): {grown}"
    # Not even the last client's: its audio, transcript and result would stay while the server idles.
    survivors = {name: count for name, count in after.items() if name.rpartition(".")[2] in _ONE_CLIENTS_STATE}
    assert not survivors, f"a finished client's state is still reachable: {survivors}"
