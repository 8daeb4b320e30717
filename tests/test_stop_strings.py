"""vLLM's stop strings (`stop`, `include_stop_str_in_output`) on one-shot text generation, through
`AsyncEngine.generate` and `POST /v1/completions` (the openai SDK), and their refusal with streaming input.

The oracle is the same request without stop strings (greedy and ignoring EOS: the same tokens) and Python's
`str.find` on its text, under vLLM's rules (vllm/v1/engine/detokenizer.py): a request ends at the first token
whose text completes one of its stop strings (one that ends in the text of a token after the first
`min_tokens`); among strings that token completes, the first in the request's list wins; the text is cut at
that string's first such occurrence (after it with `include_stop_str_in_output`) and the tokens are all those
sampled, up to that one. Streamed, vLLM holds back the last (longest stop string - 1) characters until the end.

The model is the tiny Llama with a word-level tokenizer: token id i reads " w<i>" (ids 0-2, special: nothing),
so "5 w1" is a stop string spanning two tokens.
"""
import asyncio
import json

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstream.engine.requests import RequestOutputKind, SamplingParams, StreamingInput
from jaxstream.errors import InvalidRequestError
from jaxstream.serving.testing import ServerThread
from serve_fixtures import engine_returns_to_baseline, model, server  # noqa: F401 - pytest fixtures
from test_serve_http import call
from test_serve_http_completions import b64, text_engine_with_tokenizer, tokenizerless_engine  # noqa: F401

pytestmark = pytest.mark.slow

PROMPTS = ["w5 w17", "w9 w33 w4", [40, 12]]
MAX_TOKENS = 14
SESSIONS = "/v1/streaming_input/sessions"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = text_engine_with_tokenizer(tmp_path_factory)
    yield engine
    engine.close()


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **fields})


async def unstopped(engine, prompt, min_tokens=0) -> tuple[list[int], list[str]]:
    """The tokens of the request without stop strings, and the text each adds (the tokenizer's own stream
    decoder, primed with the prompt as vLLM's detokenizer is)."""
    outputs = [out async for out in engine.generate(prompt, params(min_tokens=min_tokens))]
    tokens = [t for out in outputs for t in out.outputs[0].token_ids]
    decoder = engine.tokenizer.stream_decoder()
    decoder.prime(outputs[-1].prompt_token_ids)
    pieces = [decoder.push(t) for t in tokens]
    assert "".join(pieces) == "".join(out.outputs[0].text for out in outputs) and len(tokens) == MAX_TOKENS
    return tokens, pieces


def oracle(tokens, pieces, stops, include=False, min_tokens=0) -> tuple[str, list[int], str | None]:
    """(text, tokens, matched stop string) that vLLM's rules leave of the unstopped run."""
    ends = [len("".join(pieces[:n + 1])) for n in range(len(pieces))]  # the text's length after each token
    text = "".join(pieces)
    floor = ends[min_tokens - 1] if min_tokens else 0  # a match must end after the first min_tokens' text
    best = None
    for order, stop in enumerate(stops):
        index = text.find(stop, max(0, floor - len(stop) + 1))
        if index >= 0:
            step = next(n for n, end in enumerate(ends) if end >= index + len(stop))  # the token completing it
            best = min(best or (step, order, index, stop), (step, order, index, stop))
    if best is None:
        return text, tokens, None
    step, _, index, stop = best
    return text[:index + len(stop) if include else index], tokens[:step + 1], stop


def held_back(stops, include) -> int:
    return 0 if include else max(map(len, stops)) - 1


async def check_against_oracle(engine, prompt, stops, include=False, min_tokens=0, kinds=tuple(RequestOutputKind)):
    """Runs the request with `stops` under each output kind and checks it against the oracle: the text, the
    tokens, finish and stop reasons, and what a client saw before the end (never past the cut)."""
    tokens, pieces = await unstopped(engine, prompt, min_tokens)
    text, kept, matched = oracle(tokens, pieces, stops, include, min_tokens)
    ends = [len("".join(pieces[:n + 1])) for n in range(len(pieces))]
    hold = held_back(stops, include)
    for kind in kinds:
        request = params(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, output_kind=kind)
        outputs = [out async for out in engine.generate(prompt, request)]
        seen, ids = "", []
        for out in outputs:
            completion = out.outputs[0]
            if kind is RequestOutputKind.DELTA:
                seen, ids = seen + completion.text, ids + completion.token_ids
            else:
                seen, ids = completion.text, completion.token_ids
            assert text.startswith(seen), (kind, seen, text)  # nothing a later cut removes
            if not out.finished:  # vLLM's buffer: all but the last `hold` characters of the text so far
                assert seen == "".join(pieces)[:max(0, ends[len(ids) - 1] - hold)], (kind, seen)
        final = outputs[-1].outputs[0]
        assert outputs[-1].finished and (seen, ids) == (text, kept), (kind, stops, seen, text)
        assert (final.finish_reason, final.stop_reason) == (("stop", matched) if matched else ("length", None))
        assert kind is not RequestOutputKind.FINAL_ONLY or len(outputs) == 1
    return text, matched


# -- the engine API ------------------------------------------------------------------------------------------
def spanning(pieces, n, before=2, after=3) -> str:
    """The last `before` characters of token n's text and the first `after` of the next one's."""
    text, end = "".join(pieces), len("".join(pieces[:n + 1]))
    return text[end - before:end + after]


CASES = {  # name: (stop strings from the unstopped run's token texts, include_stop_str_in_output, min_tokens)
    "one token's word": (lambda p: [p[5].strip()], False, 0),
    "spans two tokens": (lambda p: [spanning(p, 3)], False, 0),
    "spans two tokens, kept": (lambda p: [spanning(p, 3)], True, 0),
    "a single character, kept": (lambda p: [p[6][-1]], True, 0),
    "never occurs": (lambda p: ["w999", "\n"], False, 0),
    # vLLM's stop string wins over the max_tokens end the same token reaches.
    "completed by the last token": (lambda p: [spanning(p, len(p) - 2, 2, len(p[-1]))], False, 0),
    "several: the earliest completed wins": (lambda p: ["zz", p[9].strip(), spanning(p, 4, 1, 1), "w999"], False, 0),
    # The first token's text completes both (nothing before it could): the first listed wins.
    "several ending in one token: list order": (lambda p: [p[0][-1:], p[0].strip()], False, 0),
    "several ending in one token, kept": (lambda p: [p[0].strip(), p[0][-1:]], True, 0),
    "min_tokens skips earlier matches": (lambda p: [" w"], False, 4),
    "min_tokens lets one start before them": (lambda p: [spanning(p, 2, 3, 2)], False, 3),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", PROMPTS[:2])
async def test_stop_strings_end_the_request_as_vllm(engine, prompt, case):
    make, include, min_tokens = CASES[case]
    _, pieces = await unstopped(engine, prompt, min_tokens)
    stops = make(pieces)
    _, matched = await check_against_oracle(engine, prompt, stops, include, min_tokens)
    assert (matched is None) == (case == "never occurs")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_substrings_stop_as_the_oracle_says(engine, data):
    prompt = data.draw(st.sampled_from(PROMPTS))
    min_tokens = data.draw(st.integers(0, 4))
    include = data.draw(st.booleans())
    _, pieces = asyncio.run(unstopped(engine, prompt, min_tokens))
    text = "".join(pieces)
    substring = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 8)).map(lambda s: text[s[0]:s[0] + s[1]])
    stops = data.draw(st.lists(substring | st.text("w0123456789 x", min_size=1, max_size=5), min_size=1,
                               max_size=3))
    asyncio.run(check_against_oracle(engine, prompt, stops, include, min_tokens,
                                     kinds=(RequestOutputKind.DELTA,)))


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_token_leaves_its_text_out_as_vllm(engine, include):
    """vLLM's detokenizer leaves out the text of the token that stops a request (a stop id, EOS) unless
    `include_stop_str_in_output`; its id stays in token_ids and is the stop_reason."""
    tokens, pieces = await unstopped(engine, PROMPTS[0])
    n = next(n for n in range(1, len(tokens)) if pieces[n] and tokens.index(tokens[n]) == n)
    outputs = [out async for out in engine.generate(
        PROMPTS[0], params(stop_token_ids=[tokens[n]], include_stop_str_in_output=include))]
    text = "".join(out.outputs[0].text for out in outputs)
    assert [t for out in outputs for t in out.outputs[0].token_ids] == tokens[:n + 1]
    assert text == "".join(pieces[:n + 1 if include else n])
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", tokens[n])


async def test_streaming_input_still_refuses_stop_strings(engine):
    """vLLM rejects stop strings for streaming input (specs/streaming_semantics.md §1.1): as the session's
    parameters, or a chunk's."""
    async def chunks(chunk_params=None):
        yield StreamingInput("w5 w17", chunk_params)

    for session_params, chunk_params in ((params(stop=["w1"]), None), (params(), params(stop=["w1"]))):
        with pytest.raises(InvalidRequestError, match="stop strings are not supported with streaming input"):
            async for _ in engine.generate(chunks(chunk_params), session_params):
                pass


async def test_stop_strings_need_a_tokenizer(tokenizerless_engine):
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        async for _ in tokenizerless_engine.generate([5, 17], params(stop=["w1"])):
            pass


@pytest.mark.parametrize("stop", [[""], ["w1", ""], ""])
def test_an_empty_stop_string_is_refused(stop):
    """vLLM's SamplingParams refuses it ("stop cannot contain an empty string"): it would match at once."""
    with pytest.raises(InvalidRequestError, match="empty string"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("stop", [["w1"] * 65, ["w1", "x" * 1001]])
def test_stop_lists_past_the_bounds_are_refused(stop):
    """Every stop string is looked for in every token's text on the engine thread: one request's 300,000 strings
    slowed every session's tokens from 0.6 to 73 ms apart. At most 64 strings of at most 1,000 characters."""
    with pytest.raises(InvalidRequestError, match="at most 64 strings of at most 1000 characters"):
        SamplingParams(stop=stop)
    SamplingParams(stop=stop[:64] if len(stop) > 2 else [stop[0], stop[1][:1000]])  # at the bounds: taken


# -- /v1/completions with the openai SDK ---------------------------------------------------------------------
def sdk(server):
    return openai.OpenAI(base_url=server.url("/v1", "http"), api_key="unused", max_retries=0, timeout=60)


HTTP_CASES = {  # name: (stop strings from the unstopped run's token texts, include_stop_str_in_output)
    "spans two tokens": (lambda p: [spanning(p, 2)], False),
    "several, kept": (lambda p: ["w999", p[8].strip(), spanning(p, 5, 1, 2)], True),
    "the SDK's usual newline": (lambda p: "\n", False),
}


@pytest.mark.parametrize("case", HTTP_CASES)
def test_sdk_completion_with_stop_strings(engine, server, model, case):
    make, include = HTTP_CASES[case]
    tokens, pieces = asyncio.run(unstopped(engine, PROMPTS[0]))
    stop = make(pieces)
    text, kept, matched = oracle(tokens, pieces, [stop] if isinstance(stop, str) else stop, include)
    request = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop,
               "extra_body": {"ignore_eos": True, "include_stop_str_in_output": include, "return_token_ids": True}}
    reason = "stop" if matched else "length"
    choice = sdk(server).completions.create(**request).choices[0]
    assert (choice.text, choice.token_ids, choice.finish_reason) == (text, kept, reason)
    assert choice.model_extra["stop_reason"] == matched
    chunks = list(sdk(server).completions.create(**request, stream=True))
    seen = ""
    for chunk in chunks:
        seen += chunk.choices[0].text
        assert text.startswith(seen)  # no chunk carries text past the cut
    assert seen == text and [t for c in chunks for t in c.choices[0].token_ids] == kept
    assert [(c.choices[0].finish_reason, c.choices[0].model_extra["stop_reason"]) for c in chunks] == (
        [(None, None)] * (len(chunks) - 1) + [(reason, matched)])


def test_sdk_stop_token_id_is_the_stop_reason(engine, server, model):
    """vLLM's completion choice carries `stop_reason`: the stop token id that ended it (null for EOS or a
    length end); it was missing."""
    tokens, _ = asyncio.run(unstopped(engine, PROMPTS[1]))
    stop_id = tokens[4]
    request = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
               "extra_body": {"stop_token_ids": [stop_id], "return_token_ids": True}}
    choice = sdk(server).completions.create(**request).choices[0]
    assert choice.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_id)
    last = list(sdk(server).completions.create(**request, stream=True))[-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop_id)


async def test_streaming_input_over_http_still_refuses_stop_strings(server, model):
    """Mode A (its parameters line) answers 400 and Mode B (the session's params) 422, before any stream."""
    head = {"model": model, "max_tokens": 3, "stop": ["w1"]}
    body = json.dumps(head) + "\n" + json.dumps({"payload": b64("w5 w17"), "end_of_input": True}) + "\n"
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url("/v1/completions", "http"), headers={"X-Streaming-Input": "true"},
                             data=body.encode()) as response:
            status, answer = response.status, await response.json()
        assert status == 400 and answer["error"]["code"] == "invalid_request", answer
        assert "stop strings are not supported with streaming input" in answer["error"]["message"]
        status, answer = await call(http, server, "POST", SESSIONS, json={
            "model": model, "modality": "text", "params": {"max_tokens": 3, "stop": "w1"}})
        assert status == 422 and "stop strings are not supported with streaming input" in answer["error"]["message"]


def test_sdk_stop_strings_without_a_tokenizer_are_a_400(tokenizerless_engine):
    bare_server = ServerThread(tokenizerless_engine)
    try:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk(bare_server).completions.create(model=bare_server.state.model_id, prompt=[5, 17], max_tokens=3,
                                                stop=["w1"])
        assert raised.value.body["code"] == "invalid_request" and "no tokenizer" in raised.value.body["message"]
        assert raised.value.body["param"] == "stop"
    finally:
        bare_server.close()
