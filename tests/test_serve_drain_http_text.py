"""A draining server (app.drain) that ends the input of a text completion streamed over HTTP (Mode A's NDJSON body
on /v1/completions, a Mode B text session) says so as it does for a transcript (test_serve_drain_notice.py): after the
last text, an `error` `server_draining` naming the bytes of text received, then the final chunk (the one with the
finish reason), which carries `truncated` and `truncation`; a Mode B session's result carries them too. Before, the
notice went out when the drain ended the input, and no chunk said the completion was cut short.

The oracle of the text is the engine's own for the chunks the server says it received, streamed in as
StreamingInputs (test_serve_http_completions.py's tiny Llama with a word-level tokenizer)."""
import asyncio
import itertools
import json
import types

import aiohttp
import pytest

from jaxstream.engine.requests import CompletionOutput, RequestOutput, SamplingParams
from jaxstream.serving import sse
from jaxstream.serving.http_completions import TextInput
from jaxstream.serving.metrics import ServerMetrics
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine_returns_to_baseline  # noqa: F401 - pytest fixture
from test_serve_http import call, parse_sse
from test_serve_http_completions import CHUNKS, MAX_TOKENS, SESSIONS, b64, engine_tokens
from test_serve_http_completions import engine  # noqa: F401 - pytest fixture: the text LM

pytestmark = pytest.mark.slow

DRAIN_S = 2.0  # the drain ends the inputs still open after half of it
PARAMS = {"max_tokens": MAX_TOKENS, "temperature": 0}


def covered(text_bytes: int) -> list[str]:
    """The first CHUNKS, whose bytes add up to `text_bytes` (the chunks are applied whole)."""
    sizes = list(itertools.accumulate(len(chunk.encode()) for chunk in CHUNKS))
    assert text_bytes in sizes, (text_bytes, sizes)
    return CHUNKS[:sizes.index(text_bytes) + 1]


async def check_drained(engine, events: list, *, usage: bool) -> dict:
    """Checks a drained completion stream (its text chunks, the notice, the final chunk, the usage chunk when
    `usage`, [DONE]) against the engine's text for the input received; returns the final chunk."""
    kinds = [event if event == "[DONE]" else event.get("type", event.get("object")) for event in events]
    tail = ["error", "text_completion", *(["text_completion"] if usage else []), "[DONE]"]
    assert kinds[-len(tail):] == tail and kinds.count("error") == 1, kinds
    notice, final = events[-len(tail)]["error"], events[1 - len(tail)]
    assert final.get("truncated") is True, final
    text_bytes = final["truncation"]["text_bytes"]
    assert (notice["code"], notice["type"]) == ("server_draining", "server_error"), notice
    assert f"the first {text_bytes} bytes of text received" in notice["message"], notice
    assert final["truncation"] == {"code": "server_draining", "message": notice["message"], "text_bytes": text_bytes}
    chunks = events[:-len(tail)]
    assert final["choices"][0]["finish_reason"] is not None and final["choices"][0]["text"] == "", final
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks), chunks
    if usage:
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0, events[-2]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text and text == (await engine_tokens(engine, covered(text_bytes), chunks=True))[1]
    return final


async def test_drained_text_streams_end_with_the_notice_then_a_truncated_final_chunk(engine):
    """A Mode A request and a Mode B session whose inputs never end by themselves, drained together: each stream
    ends with the notice right before its final chunk, which says the completion was cut short, as does the session's
    result."""
    server = ServerThread(engine)
    model = server.state.model_id
    lines = [{"model": model, **PARAMS, "stream_options": {"include_usage": True}},
             *({"payload": b64(chunk)} for chunk in CHUNKS)]

    async def body():
        yield "".join(json.dumps(line) + "\n" for line in lines).encode()
        await asyncio.sleep(60)  # the input stays open

    try:
        async with aiohttp.ClientSession() as http:
            status, created = await call(http, server, "POST", SESSIONS, json={
                "model": model, "modality": "text", "stream": True, "params": PARAMS})
            assert status == 201, created
            base = f"{SESSIONS}/{created['session_id']}"
            for seq, chunk in enumerate(CHUNKS):
                assert (await call(http, server, "POST", base + "/chunks",
                                   json={"sequence_id": seq, "payload": b64(chunk)}))[0] == 202
            draining, raw = None, ""
            async with http.post(server.url("/v1/completions", "http"), data=body(),
                                 headers={"X-Streaming-Input": "true"}) as response:
                async for line in response.content:
                    raw += line.decode()
                    if draining is None and "text_completion" in raw:
                        draining = server.start_drain(DRAIN_S)
            status, result = await call(http, server, "GET", base + "/result")
            async with http.get(server.url(base + "/events", "http")) as response:
                session_raw = await response.text()
            assert await draining is True  # nothing was cut off
    finally:
        server.close()
    await check_drained(engine, [data for _, data in parse_sse(raw)], usage=True)
    final = await check_drained(engine, [data for _, data in parse_sse(session_raw)], usage=False)
    assert final["truncation"]["text_bytes"] == len("".join(CHUNKS).encode())  # every chunk was acknowledged
    assert status == 200 and result["truncated"] is True and result["truncation"] == final["truncation"], result
    assert result["text"] == (await engine_tokens(engine, CHUNKS, chunks=True))[1]


async def test_text_that_comes_with_the_finish_goes_out_before_the_notice():
    """When the drain ends the input while the last chunk still generates, the engine's final output carries text as
    well as the finish reason: that text goes out in a chunk of its own, then the notice, then the final chunk, so that
    the notice still follows the last text."""
    class Engine:
        async def generate(self, prompt, params, request_id):
            async for _ in prompt:  # the input, to the end the drain gives it
                pass
            yield RequestOutput(request_id, [1, 5], [CompletionOutput(0, " w9", [9], None, None, "length")], True)

    state = types.SimpleNamespace(metrics=ServerMetrics(), engine=Engine(), model_id="tiny")
    stream = TextInput(state, SamplingParams(max_tokens=MAX_TOKENS), sse.EventLog())
    await stream.start()
    await stream.append(b"w5")
    stream.mark_drained(2)
    notice = stream.drained
    await stream.finish()
    await stream.wait(10)
    events = [data for _, data in stream.log.after(0)]
    assert [event if event == sse.DONE else event.get("type", event.get("object")) for event in events] == [
        "text_completion", "error", "text_completion", sse.DONE], events
    assert [(event["choices"][0]["text"], event["choices"][0]["finish_reason"]) for event in (events[0], events[2])] \
        == [(" w9", None), ("", "length")], events
    assert events[1]["error"] == {"message": notice, "type": "server_error", "code": "server_draining"}
    assert events[2]["truncation"] == {"code": "server_draining", "message": notice, "text_bytes": 2}
    assert stream.result()["text"] == " w9" and stream.result()["truncation"] == events[2]["truncation"]
