"""The text-model behaviours of serve_chaos.py: a server over a text LM (its /v1/models gives a `max_model_len`) runs
these instead of the speech ones. Completions and chat, plain and streamed, logprobs, stop strings, seeded sampling,
/tokenize and /detokenize, Mode A and Mode B text streaming input, the documented refusals, clients that go away
mid-stream, and one client key's flood of the request queue; serve_chaos_guided.py adds structured outputs,
`allowed_token_ids` and `bad_words`. A greedy answer must equal every earlier answer to the same request on any route
(`Chaos.same`): the engine's output does not depend on the batch, so a difference is another stream's tokens.

The soak's text model: a random tiny Llama (tests/fixtures/llama_tiny's shape, seed 0: the tests' `byte_bpe_llama`)
with the byte-level BPE tokenizer.json of tests/fixtures/byte_bpe, which llguidance reads (grammars compile), and a
ChatML template, as a jaxstream checkpoint; the server's three keys and its queue's size are the flood's:

    python benchmarks/serve_chaos_text.py /tmp/chaos-llama
    printf 'chaos-key\\nflood-key\\nlone-key\\n' > KEYS
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 jaxstream serve /tmp/chaos-llama --port 8124 \\
        --api-key-file KEYS --config benchmarks/serve_chaos_text.toml > LOG 2>&1 &
    python benchmarks/serve_chaos.py --url http://127.0.0.1:8124 --api-key-file KEYS \\
        --server-config benchmarks/serve_chaos_text.toml --pid $! --log LOG
"""
import argparse
import asyncio
import base64
import json
import math
import shutil
import tempfile
from pathlib import Path

from flax import nnx

from jaxstream.models import TextLM, config_from_hf
from jaxstream.models.loading import LoadedModel
from jaxstream.models.orbax_writer import save_checkpoint
from jaxstream.serving.streaming_input import WAITING_PER_CONNECTION
from serve_chaos_clients import Bad, Chaos, auth_headers, behaviour
from serve_chaos_http import SESSIONS, sse_events

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
VOCAB_SIZE = 320  # tests/fixtures/byte_bpe's
BOS, EOS = 1, 2  # its <s> and </s>
# Few prompts, so that the same request recurs and its answers are compared.
PROMPTS = ("Hello w60 w61 ?", "Who are you ?", "w70 w71 w72 w73 w74 w75", "Hi there . Be brief !")
MAX_TOKENS = (1, 6, 24)
STOPS = ("w60", "w181", "?", "w2")


def make_model(directory: Path) -> Path:
    """The soak's text model (the module docstring) written as a jaxstream checkpoint in `directory`."""
    cfg = config_from_hf({**json.loads((FIXTURES / "llama_tiny" / "config.json").read_text()),
                          "vocab_size": VOCAB_SIZE})
    with tempfile.TemporaryDirectory() as staging:  # save_checkpoint takes the tokenizer's neighbours along
        staging = Path(staging)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(FIXTURES / "byte_bpe" / name, staging / name)
        shutil.copy(FIXTURES / "chat" / "templates" / "chatml.jinja", staging / "chat_template.jinja")
        return save_checkpoint(LoadedModel(TextLM(cfg, rngs=nnx.Rngs(0)), cfg, staging / "tokenizer.json"),
                               directory, declared_ids=(BOS, (EOS,)))


def text_behaviour(fn):
    return behaviour(fn, kind="text")


async def answer(c: Chaos, path: str, body: dict, stream: bool, key: str | None = None) -> dict:
    """A completion or chat completion, its streamed chunks joined: {text, finish_reason, token_ids, logprobs (the
    choice's, chunks' concatenated), usage, tool_calls (a chat's [{name, arguments}], its deltas joined)}. A stream
    must end with `[DONE]`, its usage chunk (asked for) last. `key`: another key than c's presented."""
    chat = path.endswith("chat/completions")
    body = {"model": c.model, **body, "stream": stream, "return_token_ids": True}
    headers = auth_headers(key) if key else None
    if not stream:
        choice_and_usage = json.loads(await c.call("POST", path, 200, json=body, headers=headers))
        choice = choice_and_usage["choices"][0]
        calls = [call["function"] for call in (choice["message"].get("tool_calls") or [])] if chat else []
        return {"text": choice["message"]["content"] if chat else choice["text"], "token_ids": choice["token_ids"],
                "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
                "logprobs": choice["logprobs"], "usage": choice_and_usage["usage"],
                "tool_calls": [{"name": call["name"], "arguments": call["arguments"]} for call in calls]}
    async with c.http.post(c.url + path, json={**body, "stream_options": {"include_usage": True}},
                           headers=headers) as r:
        events = [data for _, data in await sse_events(r)]
    if events[-1:] != ["[DONE]"] or not events[-2]["usage"] or events[-2]["choices"]:
        raise Bad(f"{path}: the stream did not end with its usage chunk and [DONE]: {events[-2:]}")
    choices = [event["choices"][0] for event in events[:-2]]
    if any(event.get("error") for event in events[:-1]):
        raise Bad(f"{path}: an error event: {events}")
    finished = [choice["finish_reason"] for choice in choices if choice["finish_reason"]]
    if len(finished) != 1 or choices[-1]["finish_reason"] is None:
        raise Bad(f"{path}: finish reasons {finished}, last chunk's {choices[-1]['finish_reason']}")
    text = "".join((choice["delta"].get("content") or "") if chat else choice["text"] for choice in choices)
    logprobs = None
    if any(choice.get("logprobs") is not None for choice in choices):  # (not a chat's first chunk, its role's)
        key = "content" if chat else "tokens"
        logprobs = {key: [item for choice in choices for item in (choice["logprobs"] or {}).get(key) or []]}
    return {"text": text, "token_ids": [t for choice in choices for t in choice.get("token_ids") or []],
            "finish_reason": finished[0], "stop_reason": choices[-1]["stop_reason"], "logprobs": logprobs,
            "usage": events[-2]["usage"], "tool_calls": streamed_calls(choices) if chat else []}


def streamed_calls(choices: list[dict]) -> list[dict]:
    """A chat stream's tool calls, [{name, arguments}]: each call's first delta names it (with its index and id), the
    next ones add to its arguments."""
    calls = {}
    for choice in choices:
        for delta in choice["delta"].get("tool_calls") or []:
            function = delta.get("function") or {}
            if "id" in delta:
                if delta["index"] in calls:
                    raise Bad(f"tool call {delta['index']} opened twice: {delta}")
                calls[delta["index"]] = {"name": function["name"], "arguments": ""}
            elif delta["index"] not in calls:
                raise Bad(f"arguments of tool call {delta['index']} before its first delta: {delta}")
            calls[delta["index"]]["arguments"] += function.get("arguments") or ""
    return [calls[index] for index in sorted(calls)]


def check_counts(path: str, result: dict, max_tokens: int) -> None:
    ids, usage = result["token_ids"], result["usage"]
    if usage["completion_tokens"] != len(ids) or usage["total_tokens"] != usage["prompt_tokens"] + len(ids):
        raise Bad(f"{path}: usage {usage} for {len(ids)} tokens")
    if (result["finish_reason"] == "length") != (len(ids) == max_tokens) or not 1 <= len(ids) <= max_tokens:
        raise Bad(f"{path}: {len(ids)} tokens of {max_tokens}, finish_reason {result['finish_reason']}")


@text_behaviour
async def text_completion(c, rng):
    """A greedy completion, plain or streamed, of a prompt given as text or as /tokenize's ids: the same tokens as
    every earlier run of that prompt."""
    prompt, max_tokens, echo = rng.choice(PROMPTS), rng.choice(MAX_TOKENS), rng.random() < 0.3
    ids = json.loads(await c.call("POST", "/tokenize", 200, json={"model": c.model, "prompt": prompt}))["tokens"]
    by_ids = rng.random() < 0.3
    result = await answer(c, "/v1/completions", {"prompt": ids if by_ids else prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "echo": echo}, rng.random() < 0.5)
    check_counts("/v1/completions", result, max_tokens)
    if result["usage"]["prompt_tokens"] != len(ids):
        raise Bad(f"prompt_tokens {result['usage']['prompt_tokens']}, /tokenize's count {len(ids)}")
    c.same(("ids", tuple(ids), max_tokens), json.dumps(result["token_ids"]))
    text = result["text"]
    if echo:  # the prompt's text first (ids decoded, BOS skipped: the byte-level tokenizer gives the prompt back)
        if not text.startswith(prompt):
            raise Bad(f"echo: {text!r} does not start with {prompt!r}")
        text = text[len(prompt):]
    c.same(("completion text", prompt, max_tokens), text)


@text_behaviour
async def text_chat(c, rng):
    """A greedy chat, plain or streamed: the same tokens as /v1/completions over /tokenize's ids of the messages
    (the template rendered once, for both)."""
    messages = [{"role": "system", "content": "Be brief ."}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": rng.choice(PROMPTS)})
    max_tokens = rng.choice(MAX_TOKENS)
    ids = json.loads(await c.call("POST", "/tokenize", 200, json={"model": c.model, "messages": messages}))["tokens"]
    result = await answer(c, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": max_tokens,
                                                      "temperature": 0}, rng.random() < 0.5)
    check_counts("/v1/chat/completions", result, max_tokens)
    c.same(("ids", tuple(ids), max_tokens), json.dumps(result["token_ids"]))


def check_top(step: list[tuple[float, dict]], n: int, where: str, distinct: bool = True) -> None:
    """Each step: (the sampled token's logprob, its top tokens' {token: logprob}): n of them (or n + 1 with the
    sampled one, when it is not among them), none above the greedy pick. Not `distinct`: tokens named by their text
    (OpenAI's legacy dict), where two may share a key (byte-level tokens of partial characters all read "\ufffd"), so
    one to n + 1 of them."""
    for logprob, top in step:
        if (not (n if distinct else min(n, 1)) <= len(top) <= n + 1
                or any(not (v <= 0 or math.isclose(v, 0, abs_tol=1e-6)) for v in top.values())):
            raise Bad(f"{where}: {n} top logprobs asked, got {top}")
        if top and max(top.values()) > logprob + 1e-4:
            raise Bad(f"{where}: a greedy pick's logprob {logprob} below its top {top}")


@text_behaviour
async def text_logprobs(c, rng):
    """Greedy logprobs, N most likely each step (0..5), on either route (completions' tokens named by their text or,
    vLLM's return_tokens_as_token_ids, by their ids): one entry per token, the pick the most likely."""
    prompt, max_tokens, n, stream = rng.choice(PROMPTS), rng.choice(MAX_TOKENS), rng.randint(0, 5), rng.random() < 0.5
    if rng.random() < 0.5:
        as_ids = rng.random() < 0.5
        result = await answer(c, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "logprobs": n, "return_tokens_as_token_ids": as_ids}, stream)
        logprobs = result["logprobs"]
        if not stream:
            if not (len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
                    == len(result["token_ids"])):
                raise Bad(f"completion logprobs of {len(result['token_ids'])} tokens: {logprobs}")
            check_top(list(zip(logprobs["token_logprobs"], logprobs["top_logprobs"])), n, "completion", as_ids)
        elif len(logprobs["tokens"]) != len(result["token_ids"]):
            raise Bad(f"streamed completion logprobs of {len(result['token_ids'])} tokens: {logprobs}")
    else:
        result = await answer(c, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": n}, stream)
        content = result["logprobs"]["content"]
        if len(content) != len(result["token_ids"]):
            raise Bad(f"chat logprobs of {len(result['token_ids'])} tokens: {content}")
        check_top([(item["logprob"], {f"{k}:{t['token']}": t["logprob"] for k, t in enumerate(item["top_logprobs"])})
                   for item in content], n, "chat")
        c.same(("chat logprobs", prompt, max_tokens), json.dumps(result["token_ids"]))


@text_behaviour
async def text_stop(c, rng):
    """Stop strings on a greedy completion: the text never holds one (unless asked to keep it, at its end), and a
    "stop" finish names the string or token that ended it."""
    prompt, stop, keep = rng.choice(PROMPTS), rng.sample(STOPS, rng.randint(1, 2)), rng.random() < 0.3
    result = await answer(c, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": stop,
                                                 "include_stop_str_in_output": keep}, rng.random() < 0.5)
    text, reason = result["text"], result["stop_reason"]
    if result["finish_reason"] == "stop" and reason not in (*stop, None) and not isinstance(reason, int):
        raise Bad(f"stop {stop}: finish stop with stop_reason {reason!r}")
    kept = keep and isinstance(reason, str) and text.endswith(reason)
    if any(s in (text[:-len(reason)] if kept else text) for s in stop) or (keep and isinstance(reason, str)
                                                                          and not kept):
        raise Bad(f"stop {stop} (keep {keep}): {text!r}, stop_reason {reason!r}")
    c.same(("stop", prompt, tuple(stop), keep), text)


@text_behaviour
async def text_seeded(c, rng):
    """Seeded sampling: a seed gives the same tokens whatever runs beside it."""
    prompt, seed, max_tokens = rng.choice(PROMPTS), rng.randint(0, 3), rng.choice(MAX_TOKENS)
    result = await answer(c, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                                                 "top_p": 0.9, "seed": seed}, rng.random() < 0.5)
    c.same(("seeded", prompt, seed, max_tokens), json.dumps(result["token_ids"]))


@text_behaviour
async def text_tokenize(c, rng):
    """/tokenize then /detokenize gives the prompt back (byte-level: exactly), and /detokenize refuses an id outside
    the vocabulary."""
    prompt = rng.choice(PROMPTS)
    tokens = json.loads(await c.call("POST", "/tokenize", 200, json={"model": c.model, "prompt": prompt,
                                                                      "add_special_tokens": False}))["tokens"]
    back = json.loads(await c.call("POST", "/detokenize", 200, json={"model": c.model, "tokens": tokens}))["prompt"]
    if back != prompt:
        raise Bad(f"/detokenize gave {back!r} for {prompt!r}")
    await c.call("POST", "/detokenize", 400, "invalid_request", json={"model": c.model, "tokens": [10**6]})


def text_chunks(prompt: str, rng) -> list[str]:
    words = prompt.split()
    cut = sorted(rng.sample(range(1, len(words)), rng.randint(0, min(2, len(words) - 1))))
    return [" ".join(words[a:b]) + " " for a, b in zip([0, *cut], [*cut, len(words)])]


def chunk_objects(pieces: list[str]) -> list[dict]:
    return [{"sequence_id": n, "modality": "text", "payload": base64.b64encode(piece.encode()).decode(),
             "end_of_input": n == len(pieces) - 1} for n, piece in enumerate(pieces)]


async def refused_at_capacity(r) -> bool:
    """Whether a streaming-input request was refused for the server's connection limit, as documented: it cannot
    wait its turn as a one-shot request does (a soak with more workers than the limit meets it)."""
    if r.status != 429:
        return False
    code = (await r.json()).get("error", {}).get("code")
    if code != "capacity":
        raise Bad(f"HTTP 429 {code}")
    return True


def streamed_text(events: list) -> str:
    data = [event for _, event in events]
    if data[-1:] != ["[DONE]"] or any("error" in event for event in data[:-1]):
        raise Bad(f"the stream did not end with [DONE] alone: {data[-2:]}")
    return "".join(event["choices"][0]["text"] for event in data[:-1] if event.get("choices"))


@text_behaviour
async def text_mode_a(c, rng):
    """Mode A: the prompt in text chunks of an NDJSON body, answered by SSE: the same text as every run that split
    it the same way (each chunk is a StreamingInput, so the split is part of the request)."""
    prompt, max_tokens = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
    pieces = text_chunks(prompt, rng)

    async def body():
        for line in [{"model": c.model, "max_tokens": max_tokens, "temperature": 0}, *chunk_objects(pieces)]:
            yield json.dumps(line).encode() + b"\n"
            await asyncio.sleep(rng.choice((0, 0.02)))

    async with c.http.post(c.url + "/v1/completions", data=body(), headers={"X-Streaming-Input": "true"}) as r:
        if not await refused_at_capacity(r):
            c.same(("streamed", tuple(pieces), max_tokens), streamed_text(await sse_events(r)))


@text_behaviour
async def text_mode_b(c, rng):
    """Mode B: a text session's chunks (out of order, one twice), then its result: the same text as Mode A's for
    the same chunks."""
    prompt, max_tokens = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
    pieces = text_chunks(prompt, rng)
    async with c.http.post(c.url + SESSIONS, json={
            "model": c.model, "modality": "text", "params": {"max_tokens": max_tokens, "temperature": 0}}) as r:
        if await refused_at_capacity(r):
            return
        if r.status != 201:
            raise Bad(f"POST {SESSIONS}: HTTP {r.status}: {(await r.read())[:200]!r}")
        created = await r.json()
    base = f"{SESSIONS}/{created['session_id']}"
    chunks = chunk_objects(pieces)
    order = chunks[1:2] + chunks[:1] + chunks[1:] if len(chunks) > 1 else chunks + chunks
    for chunk in order:
        async with c.http.post(c.url + base + "/chunks", json=chunk) as r:
            if r.status not in (200, 202):
                raise Bad(f"chunk {chunk['sequence_id']}: HTTP {r.status}: {(await r.read())[:200]!r}")
    c.same(("streamed", tuple(pieces), max_tokens), json.loads(await c.call("GET", base + "/result", 200))["text"])


# (route, body, status, code): what the server documents for each; `model` is added.
REFUSALS = (
    ("/v1/completions", {"prompt": "w60", "n": 129}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60", "logprobs": 21}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60", "temperature": -1}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60", "max_tokens": 0}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": [3, VOCAB_SIZE]}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60 " * 300}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "w60", "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "w60", "stream_options": {"include_usage": True}}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60", "seed": "x"}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60", "best_of": 2}, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "w60", "model": "nope"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w60"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "invalid_request"),  # "auto" needs a tool parser
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w60"}], "chat_template": "{{ 1 }}"},
     400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "invalid_request"),
    ("/tokenize", {"prompt": 5}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "w60 \ud800"}, 400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w60 \udfff"}]}, 400, "invalid_request"),
)


@text_behaviour
async def text_refusals(c, rng):
    """Requests the server refuses with a documented 4xx, one to three at a time (streamed or not), and a body that
    is not JSON."""
    for path, body, status, code in rng.sample(REFUSALS, rng.randint(1, 3)):
        stream = {"stream": True} if path != "/tokenize" and "stream_options" not in body and rng.random() < 0.5 else {}
        await c.call("POST", path, status, code, json={"model": c.model, **body, **stream})
    await c.call("POST", rng.choice(("/v1/completions", "/v1/chat/completions", "/tokenize")), 400, "invalid_json",
                 data=b'{"model": ', headers={"Content-Type": "application/json"})


@text_behaviour
async def text_drops(c, rng):
    """A client that goes away mid-stream (a long completion, chat or Mode A stream, its connection dropped after
    its first event): the server frees what it held (each round's end checks)."""
    route = rng.choice(("completion", "chat", "mode_a"))
    if route == "mode_a":
        async def body():
            yield json.dumps({"model": c.model, "max_tokens": 200, "temperature": 0}).encode() + b"\n"
            for chunk in chunk_objects(["w60 w61 ", "w62 "])[:1]:
                yield json.dumps(chunk).encode() + b"\n"
            await asyncio.sleep(3600)  # the rest never comes
        request = c.http.post(c.url + "/v1/completions", data=body(), headers={"X-Streaming-Input": "true"})
    else:
        body = ({"prompt": "w60"} if route == "completion" else {"messages": [{"role": "user", "content": "w60"}]})
        path = "/v1/completions" if route == "completion" else "/v1/chat/completions"
        request = c.http.post(c.url + path, json={"model": c.model, **body, "max_tokens": 200, "temperature": 0,
                                                   "stream": True})
    async with request as r:
        if route == "mode_a" and await refused_at_capacity(r):
            return
        await sse_events(r, 1)
        r.close()  # drops the connection mid-stream


def flood_needs(c: Chaos) -> str | None:
    """The flood needs two keys besides c's (--api-key-file) and the size of the server's request queue."""
    if len(c.other_keys) < 2:
        return "two more of the server's keys (--api-key-file with three keys)"
    if c.limits.max_connections is None:
        return "the server's max_connections (--server-config with [limits] max_connections)"
    return None


@behaviour(kind="text", needs=flood_needs)
async def text_key_flood(c, rng):
    """One key floods the server with one-shot completions, more than its connections and waiting room hold at once
    (serving/request_queue.py); once the room is full (a flood request answered 429) another key's single request
    is still served, with the tokens of every other run of it. Each flood request is served, or refused with 429
    `rate_limit_exceeded` (its key holds its share of the full room, or gave its place up to the other key's) or
    `capacity` (the room is full and no key holds more than its own), Retry-After given."""
    flood_key, lone_key = c.other_keys[:2]
    places = c.limits.max_connections * (1 + WAITING_PER_CONNECTION)
    flood_body = {"model": c.model, "prompt": rng.choice(PROMPTS), "max_tokens": 48, "ignore_eos": True,
                  "temperature": 0}

    async def flooding() -> tuple[int, dict, str | None]:
        async with c.http.post(c.url + "/v1/completions", json=flood_body, headers=auth_headers(flood_key)) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    prompt, max_tokens = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
    ids = json.loads(await c.call("POST", "/tokenize", 200, json={"model": c.model, "prompt": prompt}))["tokens"]
    async with asyncio.TaskGroup() as group:  # a failure cancels the flood
        flood = [group.create_task(flooding()) for _ in range(places + c.limits.max_connections)]
        for answered in asyncio.as_completed(flood):
            if (await answered)[0] == 429:
                break
        else:
            raise Bad(f"none of {len(flood)} flood requests was refused: the queue of {places} places never filled")
        result = await answer(c, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                              rng.random() < 0.5, key=lone_key)
    check_counts("the lone key's completion", result, max_tokens)
    c.same(("ids", tuple(ids), max_tokens), json.dumps(result["token_ids"]))
    for status, body, retry_after in (task.result() for task in flood):
        code = body.get("error", {}).get("code") if status != 200 else None
        if status == 200 and body["usage"]["completion_tokens"] != flood_body["max_tokens"]:
            raise Bad(f"a flood completion of {body['usage']['completion_tokens']} tokens (ignore_eos)")
        if status != 200 and (status, code) not in ((429, "rate_limit_exceeded"), (429, "capacity")):
            raise Bad(f"a flood request answered HTTP {status} {code}: {body}")
        if status == 429 and not retry_after:
            raise Bad(f"a flood request's 429 {code} without Retry-After")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="a new directory: the soak's text model is written there")
    directory = parser.parse_args().directory
    if directory.exists():
        parser.error(f"{directory} exists: give a new directory")
    print(make_model(directory))
