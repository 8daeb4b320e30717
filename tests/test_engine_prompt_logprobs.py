"""vLLM's prompt logprobs (`SamplingParams.prompt_logprobs`) of text LMs, on the engine core. The oracle is
transformers: the committed tiny Llama / Mistral / Qwen3 fixtures hold every position's logits for `input_ids` (40
tokens), whose float64 log-softmax gives each prompt token's logprob, rank and most likely ids. Prefill chunks of 8
positions, so a prompt spans five chunks; pages of 4 positions, so a few sessions fill the pool and preempt one
another."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxstream import Logprob, RequestOutputKind, SamplingParams  # the public names
from jaxstream.engine import steps
from jaxstream.engine.builders import build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.prompt_logprobs import FlatPromptLogprobs
from jaxstream.errors import InvalidRequestError
from test_engine_scheduler import leave_at_baseline
from test_engine_text_model import FIXTURE, LLAMA, tiny_lm

CFG = EngineConfig(max_sessions=4, page_size=4, num_pages=33, max_model_len=96, batch_buckets=(4,),
                   prefill_buckets=((2, 8),), max_num_batched_tokens=64)
QWEN3 = FIXTURE.parent / "qwen3_tiny"


def reference(directory):
    """(input ids, float64 log-softmax of transformers' logits at each position) of a fixture."""
    data = np.load(directory.parent / f"{directory.name}_reference.npz")
    logits = data["logits"][0].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return data["input_ids"][0].tolist(), shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def llama():
    return build_text_core(tiny_lm(LLAMA), CFG)


@pytest.fixture(autouse=True)
def back_to_baseline(request):
    yield
    if "llama" in request.fixturenames:
        leave_at_baseline(request.getfixturevalue("llama"))


def run(core, requests) -> dict:
    """Adds `requests` [(request id, prompt, params)] at once, runs the core until they end; their outputs."""
    outputs = {}
    for request_id, prompt, params in requests:
        outputs[request_id] = []
        core.add_chunk(request_id, prompt, params, first=True, resumable=False, sink=outputs[request_id].append)
    while core.has_work():
        core.step()
    for items in outputs.values():
        assert not any(isinstance(item, Exception) for item in items), items
    return outputs


def asked(num, max_tokens=3, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=num, **kw)


def check_oracle(prompt_logprobs, ids, oracle, num):
    """Every prompt token after the first has its transformers logprob and rank, then the `num` likeliest ids."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entries, expected, token = prompt_logprobs[position], oracle[position - 1], ids[position]
        assert next(iter(entries)) == token  # vLLM's order: the prompt token first
        top = np.argsort(-expected, kind="stable")[:num]
        assert len(entries) == num + (token not in top)
        value = expected[token]
        assert abs(entries[token].logprob - value) < 1e-4, position
        if token not in top:  # its rank: the ids at least as likely (ties within float32 rounding either way)
            assert (expected > value + 1e-4).sum() < entries[token].rank <= (expected >= value - 1e-4).sum()
        ranked = [(token_id, entry) for token_id, entry in entries.items() if token_id != token or token in top]
        assert sorted(entry.rank for _, entry in ranked) == list(range(1, num + 1))
        for token_id, entry in ranked:
            assert abs(entry.logprob - expected[token_id]) < 1e-4 and entry.logprob >= expected[top[-1]] - 1e-4
        by_rank = [entry.logprob for _, entry in sorted(ranked, key=lambda item: item[1].rank)]
        assert by_rank == sorted(by_rank, reverse=True)


@pytest.mark.parametrize("directory", [LLAMA, FIXTURE, QWEN3], ids=["llama", "mistral-window-8", "qwen3-untied"])
def test_prompt_logprobs_are_transformers_across_prefill_chunks(llama, directory):
    """Was: no prompt logprobs at all. Each prompt token's logprob, rank and the N likeliest ids at its position, as
    transformers' logits give them, for a prompt over five prefill chunks (a tied head, Mistral's 8-position window
    over a ring shorter than the prompt, Qwen3's untied head); the completion is the one a request without them
    gets, and they come once, with the first token (vLLM's DELTA)."""
    core = llama if directory == LLAMA else build_text_core(tiny_lm(directory), CFG)
    ids, oracle = reference(directory)
    outputs = run(core, [("asks", ids, asked(5)), ("plain", ids, asked(None))])
    first, *later = outputs["asks"]
    check_oracle(first.prompt_logprobs, ids, oracle, 5)
    assert [out.prompt_logprobs for out in later] == [[]] * len(later)
    assert all(out.prompt_logprobs is None for out in outputs["plain"])
    tokens = {rid: [t for out in items for t in out.outputs[0].token_ids] for rid, items in outputs.items()}
    assert tokens["asks"] == tokens["plain"] and len(tokens["asks"]) == 3


def test_preempted_mid_prompt_every_position_comes_once(llama):
    """Two 40-token prompts over 12 free pages: the later is preempted in its prefill (some positions computed), then
    computes its prompt again from position 0: each position's logprobs once, transformers' (none lost, none twice).
    No request compiles a program."""
    ids, oracle = reference(LLAMA)
    pool = llama.cache.pools["text"]
    held = pool.allocate(pool.num_free - 12)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = llama.preemptions
        outputs = run(llama, [("a", ids, asked(2)), ("b", ids, asked(3))])
        assert llama.preemptions > before
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        pool.release(held)
    assert compiles == []
    check_oracle(outputs["a"][0].prompt_logprobs, ids, oracle, 2)
    check_oracle(outputs["b"][0].prompt_logprobs, ids, oracle, 3)


def test_a_cached_prompt_is_computed_again_for_its_prompt_logprobs(llama):
    """With the prefix cache on, a request asking prompt logprobs looks nothing up (a cached prefix has no logits: vLLM
    skips reading the cache for it) and gets all of them; its blocks are cached for the others (a request without them
    then hits)."""
    ids, oracle = reference(LLAMA)
    prompt = ids[::-1]  # not cached by the other tests
    queries, hits = llama.prefix_cache_counts
    run(llama, [("warm", prompt, asked(None))])
    assert llama.prefix_cache_counts[1] == hits
    again = run(llama, [("again", ids, asked(4))])["again"]  # `ids` may be cached too: either way, looked up never
    assert llama.prefix_cache_counts == (queries + len(prompt), hits)
    check_oracle(again[0].prompt_logprobs, ids, oracle, 4)
    outputs = run(llama, [("repeat", prompt, asked(1))])
    assert llama.prefix_cache_counts == (queries + len(prompt), hits)
    assert len(outputs["repeat"][0].prompt_logprobs) == len(prompt)
    run(llama, [("hit", ids, asked(None))])
    assert llama.prefix_cache_counts[1] == hits + (len(ids) - 1) // CFG.page_size * CFG.page_size


def test_output_kinds_carry_them_as_vllm(llama):
    """CUMULATIVE outputs each carry the whole list; a DELTA request's later outputs an empty one; a one-token prompt
    has only the first entry (None); batches that ask none fetch no prompt logprobs from the device."""
    ids, _ = reference(LLAMA)
    fetched = []
    fetch = llama.fetch
    llama.fetch = lambda outputs: (fetched.extend(sorted(out) for out in outputs), fetch(outputs))[1]
    try:
        outputs = run(llama, [("cumulative", ids[:20], asked(2, output_kind=RequestOutputKind.CUMULATIVE)),
                              ("one", ids[:1], asked(2))])
        asks = len(fetched)
        run(llama, [("plain", ids[:20], asked(None))])
    finally:
        del llama.fetch
    cumulative = [out.prompt_logprobs for out in outputs["cumulative"]]
    assert len(cumulative) == 3 and all(value is cumulative[0] for value in cumulative) and len(cumulative[0]) == 20
    assert list(outputs["one"][0].prompt_logprobs) == [None]
    assert any("prompt_logprob" in keys for keys in fetched[:asks])
    assert not any("prompt_logprob" in keys for keys in fetched[asks:])


def test_blocks_of_positions_give_the_whole_chunks_logprobs(monkeypatch):
    """The device computes prompt logprobs a block of positions at a time (here blocks of 2 of a chunk of 8): the same
    as numpy over the whole chunk, padding rows and positions without a target included."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 8, 50)).astype(np.float32)
    targets = rng.integers(0, 50, (3, 8)).astype(np.int32)
    targets[2] = -1
    monkeypatch.setattr(steps, "PROMPT_BLOCK_ELEMENTS", 3 * 2 * 50)
    got = jax.jit(lambda x, t: steps.prompt_logprobs(lambda f: f, x, t, 50))(logits, targets)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    chosen = np.take_along_axis(expected, np.maximum(targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got["prompt_logprob"], chosen, atol=1e-5)
    np.testing.assert_array_equal(got["prompt_rank"], (expected >= chosen[..., None] - 1e-6).sum(-1))
    np.testing.assert_array_equal(got["prompt_top_ids"], np.argsort(-expected, -1, kind="stable")[..., :20])
    nothing = jax.jit(lambda x, t: steps.prompt_logprobs(lambda f: f, x, t, 50))(logits, np.full_like(targets, -1))
    assert not np.asarray(nothing["prompt_top_ids"]).any()


@pytest.mark.parametrize("value, message", [
    (21, "prompt_logprobs must be in [0, 20], got 21"),
    (-1, "prompt_logprobs must be in [0, 20], got -1"),  # vLLM's -1 (the whole vocabulary) is over max_logprobs
    (True, "prompt_logprobs must be an integer, got True"),
])
def test_bad_values_are_refused(value, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(prompt_logprobs=value)


def test_streaming_input_refuses_them(llama):
    """vLLM computes prompt logprobs over a request's first prompt only: a session's later chunks would get none."""
    with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported with streaming input"):
        SamplingParams(prompt_logprobs=0).check_supported(streaming=True)
    items = []
    llama.add_chunk("s", [5, 6], asked(1), first=True, resumable=True, sink=items.append)
    assert isinstance(items[-1], InvalidRequestError) and "s" not in llama.sessions


def test_flat_prompt_logprobs_read_as_vllms_list():
    """The engine's arrays read as vLLM's list: None, then {token: Logprob} with the prompt token first and the
    likeliest ids by rank (one among them takes its rank there); slices, negative indices and equality with a list."""

    class Names:
        @staticmethod
        def token_string(token_id):
            return f"t{token_id}"

    flat = FlatPromptLogprobs([7, 8, 9], 2)
    fetched = {"prompt_logprob": np.array([[-1.0, -0.5]]), "prompt_rank": np.array([[3, 1]]),
               "prompt_top_ids": np.array([[[4, 5, 6], [9, 4, 5]]]),
               "prompt_top_logprobs": np.array([[[-0.25, -0.75, -0.875], [-0.5, -2.0, -3.0]]])}
    flat.record(0, 3, fetched, 0)  # position 2 (the last prompt token) has no target: ignored
    expected = [None, {8: Logprob(-1.0, 3), 4: Logprob(-0.25, 1), 5: Logprob(-0.75, 2)},
                {9: Logprob(-0.5, 1), 4: Logprob(-2.0, 2)}]
    assert flat == expected and flat[-1] == expected[2] and flat[1:] == expected[1:]
    assert list(flat[2]) == [9, 4]
    flat.tokenizer = Names()
    assert flat[1][8] == dataclasses.replace(expected[1][8], decoded_token="t8")
    with pytest.raises(IndexError):
        flat[3]
