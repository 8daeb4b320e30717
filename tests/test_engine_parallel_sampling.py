"""`generate` with n > 1 (vLLM's parallel sampling, jaxstream/engine/parallel_sampling.py) on the tiny Mistral. The
oracle is the engine's own one-completion requests: child i of a seeded request is the request with seed + i, a
greedy one's children are the greedy completion; what vLLM's output layout promises (indices, the parent finished
with its last child, FINAL_ONLY's one output) and its abort rules are checked on top."""
import asyncio

import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.requests import RequestOutputKind, SamplingParams, StreamingInput
from jaxstream.errors import InvalidRequestError
from jaxstream.serving.testing import wait_engine_baseline
from test_engine_sampling import ENGINE_CFG, tiny_mistral

PROMPT = [1, 5, 17, 40]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(tiny_mistral(), config=ENGINE_CFG)
    yield engine
    engine.close()


async def completions(engine, params, request_id="parent") -> tuple[dict[int, list[int]], list]:
    """{index: token ids} of a request, and its outputs."""
    outputs = [out async for out in engine.generate(PROMPT, params, request_id=request_id)]
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        for completion in out.outputs:
            tokens.setdefault(completion.index, []).extend(completion.token_ids)
    return tokens, outputs


async def one(engine, params) -> list[int]:
    tokens, _ = await completions(engine, params, request_id=f"one-{params.seed}")
    return tokens[0]


async def test_seeded_children_are_the_requests_with_seed_plus_their_index(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=41, max_tokens=6, ignore_eos=True)
    tokens, outputs = await completions(engine, params)
    expected = [await one(engine, SamplingParams(temperature=1.0, seed=41 + i, max_tokens=6, ignore_eos=True))
                for i in range(3)]
    assert [tokens[i] for i in range(3)] == expected and len(set(map(tuple, expected))) > 1
    # vLLM's layout: each output carries the child that moved; the parent finishes with the last child's last one.
    assert all(len(out.outputs) == 1 and out.request_id == "parent" for out in outputs)
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
    assert sum(out.outputs[0].finish_reason is not None for out in outputs) == 3
    await wait_engine_baseline(engine)


async def test_greedy_children_agree_and_final_only_holds_all_n_in_order(engine):
    greedy = await one(engine, SamplingParams(temperature=0.0, max_tokens=5))
    params = SamplingParams(n=2, temperature=0.0, max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY)
    tokens, outputs = await completions(engine, params)
    assert len(outputs) == 1 and outputs[0].finished and [c.index for c in outputs[0].outputs] == [0, 1]
    assert tokens == {0: greedy, 1: greedy} and outputs[0].prompt_token_ids == PROMPT


async def test_aborting_the_parent_aborts_every_child(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, ignore_eos=True)
    stream = engine.generate(PROMPT, params, request_id="aborted")
    first = await anext(stream)
    await engine.abort("aborted")
    rest = [out async for out in stream]
    reasons = [c.finish_reason for out in [first, *rest] for c in out.outputs if c.finish_reason is not None]
    assert reasons == ["abort"] * 3 and rest[-1].finished
    await wait_engine_baseline(engine)
    # A consumer that stops early aborts them too.
    stream = engine.generate(PROMPT, params, request_id="left")
    await anext(stream)
    await stream.aclose()
    await wait_engine_baseline(engine)


async def test_n_is_bounded_and_one_shot_only(engine):
    with pytest.raises(InvalidRequestError, match=r"n must be in \[1, 128\]"):
        SamplingParams(n=129)

    async def chunks():
        yield StreamingInput(PROMPT)

    with pytest.raises(InvalidRequestError, match="n > 1 is not supported with streaming input"):
        await anext(engine.generate(chunks(), SamplingParams(n=2, max_tokens=2)))
    await asyncio.sleep(0)
