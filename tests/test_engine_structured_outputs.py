"""Structured outputs through `AsyncEngine.generate`: a random-weight Llama of 320 ids with a byte-level BPE
tokenizer.json (tests/fixtures/byte_bpe).

Oracles: greedy tokens and their logprobs equal an offline forward over the final context whose logits at each
step are masked by llguidance's own bitmask and numpy masking (a matcher of the test's, fed the same tokens);
sampled texts are checked by `re.fullmatch`, `jsonschema` and the choice list; under preemption and alongside
unconstrained requests every request gets what it gets alone on a roomy engine; `check_sampling_params` compiles a
grammar once for the request that follows it (compiles counted where the grammar text is made)."""
import asyncio
import json
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from engine_fixtures import BYTE_BPE as TOKENIZER, BYTE_BPE_EOS as EOS, FIXTURES, byte_bpe_engine, byte_bpe_llama
from jaxstream.engine import structured_outputs
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StreamingInput, StructuredOutputsParams
from jaxstream.errors import InvalidRequestError
from jaxstream.models import contiguous_page_table, init_kv_cache
from jaxstream.models.tokenizers import load_tokenizer
from test_engine_scheduler import leave_at_baseline

VOCAB = 320
BASE = dict(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),), max_num_batched_tokens=20,
            max_model_len=64)
PERSON = {"type": "object", "properties": {"name": {"enum": ["alice", "bob", "carol"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = {
    "choice": dict(choice=["positive", "negative", "neutral"]),
    "regex": dict(regex=r"[a-z]{2,5}-[0-9]{2}"),
    "json": dict(json=PERSON, disable_any_whitespace=True),
    "grammar": dict(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]/'),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = byte_bpe_engine(EngineConfig(**BASE), tokenizer)
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def at_baseline(request):
    yield
    if "engine" in request.fixturenames:
        asyncio.run(request.getfixturevalue("engine").wait_until_idle())
        leave_at_baseline(request.getfixturevalue("engine").core)


def satisfies(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CONSTRAINTS["choice"]["choice"]
    if kind == "regex":
        return re.fullmatch(CONSTRAINTS["regex"]["regex"], text) is not None
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
        return " " not in text  # disable_any_whitespace
    return re.fullmatch(r"\([0-9](,[0-9])*\)", text) is not None


async def run(engine, prompt, params):
    """(token ids, logprobs, text, finish reason) of a one-shot request."""
    tokens, logprobs, text, reason = [], [], "", None
    async for out in engine.generate(prompt, params):
        completion = out.outputs[0]
        tokens += completion.token_ids
        logprobs += completion.logprobs or []
        text += completion.text
        reason = completion.finish_reason
    return tokens, logprobs, text, reason


def oracle_logits(engine, context) -> np.ndarray:
    """Log-softmax logits [len(context), V] of one offline forward over `context`."""
    lm, cfg = byte_bpe_llama(), engine.model_config
    window = cfg.attention_window
    table, num_pages = contiguous_page_table(1, window, window)
    cache = init_kv_cache(cfg.num_layers, num_pages, cfg.num_kv_heads, window, cfg.head_dim)
    logits, _ = lm(jnp.asarray([context], jnp.int32), cache, jnp.asarray(table), jnp.zeros(1, jnp.int32),
                   jnp.asarray([len(context)], jnp.int32))
    return np.asarray(logits[0], np.float32)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
async def test_greedy_tokens_are_the_argmax_of_the_grammars_masked_logits(engine, tokenizer, kind):
    prompt = tokenizer.prompt_prefix + tuple(tokenizer.encode("the weather is"))
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, structured_outputs=CONSTRAINTS[kind])
    tokens, logprobs, text, reason = await run(engine, list(prompt), params)
    assert reason == "stop" and tokens[-1] == EOS and satisfies(kind, text)

    ll_tokenizer = llguidance.LLTokenizer(TOKENIZER.joinpath("tokenizer.json").read_text(), n_vocab=VOCAB,
                                          eos_token=EOS)
    spec = StructuredOutputsParams(**CONSTRAINTS[kind])
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})
               if kind == "json" else llguidance.grammar_from(kind, spec.choice or getattr(spec, kind)))
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    logits = oracle_logits(engine, [*prompt, *tokens[:-1]])[len(prompt) - 1:]
    mask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    for step, token in enumerate(tokens):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        masked = logits[step:step + 1].copy()
        llguidance.numpy.apply_token_bitmask_inplace(masked, mask)
        assert int(np.argmax(masked)) == token, step
        # vLLM masks before its sampler: the logprob is the masked distribution's.
        assert logprobs[step] == pytest.approx(float(jax.nn.log_softmax(masked[0])[token]), abs=1e-4)
        assert token == EOS or matcher.consume_token(token)


async def test_sampled_outputs_and_every_child_satisfy_the_grammar(engine):
    async def one(kind, seed):
        params = SamplingParams(temperature=1.2, seed=seed, n=2, max_tokens=60, structured_outputs=CONSTRAINTS[kind])
        texts, reasons = {}, {}
        async for out in engine.generate("hello", params):
            for completion in out.outputs:
                texts[completion.index] = texts.get(completion.index, "") + completion.text
                reasons[completion.index] = completion.finish_reason
        return kind, texts, reasons

    results = await asyncio.gather(*(one(kind, seed) for kind in CONSTRAINTS for seed in (1, 2)))
    for kind, texts, reasons in results:
        assert len(texts) == 2
        for index, text in texts.items():
            assert reasons[index] == "stop" and satisfies(kind, text), (kind, text)


async def test_guided_and_free_requests_under_preemption_get_what_they_get_alone(tokenizer):
    requests = [(f"prompt {i}", SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=24,
                                               structured_outputs=CONSTRAINTS[kind] if kind else None))
                for i, kind in enumerate([*CONSTRAINTS, None, None, "json", None])]
    alone = byte_bpe_engine(EngineConfig(**BASE), tokenizer)
    try:
        expected = [await run(alone, prompt, params) for prompt, params in requests]
    finally:
        alone.close()
    # Pages for about two sessions: running ones are preempted and recompute, slots are reused.
    short = byte_bpe_engine(EngineConfig(**BASE, num_pages=1 + 16), tokenizer)
    try:
        got = await asyncio.gather(*(run(short, prompt, params) for prompt, params in requests))
        assert short.core.preemptions > 0
        await short.wait_until_idle()
        assert short.core.at_baseline()
    finally:
        short.close()
    for (tokens, logprobs, text, reason), (want_tokens, _, want_text, want_reason) in zip(got, expected):
        assert (tokens, text, reason) == (want_tokens, want_text, want_reason)


async def test_a_schema_is_compiled_for_its_own_property_order(engine):
    """The compiled-grammar cache must not take a schema for another with the same properties in another order."""
    def ordered(*names):
        properties = {name: {"type": "integer", "minimum": 0, "maximum": 9} for name in names}
        return dict(json={"type": "object", "properties": properties, "required": ["x", "y"],
                          "additionalProperties": False}, disable_any_whitespace=True)

    for names in (("x", "y"), ("y", "x")):
        _, _, text, _ = await run(engine, "hello", SamplingParams(temperature=0.0, max_tokens=30,
                                                                  structured_outputs=ordered(*names)))
        assert list(json.loads(text)) == list(names)


async def test_a_grammar_after_the_reasoning_end_leaves_the_thinking_free(engine, tokenizer):
    """vLLM's reasoning-parser rule: the model thinks freely until the end-of-reasoning id; the grammar applies after
    it, or from the start when the prompt holds it."""
    prompt = list(tokenizer.prompt_prefix) + tokenizer.encode("the weather is")
    free, _, _, _ = await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    end = next(token for i, token in enumerate(free) if i >= 2 and token not in free[:i])  # first seen at i >= 2
    thinks = free.index(end) + 1
    after = dict(CONSTRAINTS["regex"], reasoning_end_token_id=end)
    tokens, _, _, reason = await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                                    structured_outputs=after))
    assert tokens[:thinks] == free[:thinks] and reason == "stop"
    assert satisfies("regex", tokenizer.decode(tokens[thinks:]))
    # Ended in the prompt: the grammar applies from the first token, as without a reasoning end.
    ended, _, _, _ = await run(engine, prompt + [end], SamplingParams(temperature=0.0, max_tokens=40,
                                                                      structured_outputs=after))
    plain, _, _, _ = await run(engine, prompt + [end], SamplingParams(temperature=0.0, max_tokens=40,
                                                                      structured_outputs=CONSTRAINTS["regex"]))
    assert ended == plain and satisfies("regex", tokenizer.decode(ended))


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="(unclosed"), "invalid structured outputs regex"),
    (dict(json={"type": "no-such-type"}), "invalid structured outputs json"),
    (dict(grammar="start: undefined_rule"), "invalid structured outputs grammar"),
])
async def test_an_invalid_constraint_is_refused_before_any_output(engine, constraint, message):
    """By `generate`, and the same by `check_sampling_params` without running it."""
    params = SamplingParams(structured_outputs=constraint)
    with pytest.raises(InvalidRequestError, match=message) as checked:
        await engine.check_sampling_params(params)
    with pytest.raises(InvalidRequestError, match=message) as generated:
        await run(engine, "hello", params)
    assert str(checked.value) == str(generated.value)


async def test_streaming_input_refuses_structured_outputs(engine):
    async def chunks():
        yield StreamingInput("hello", SamplingParams(structured_outputs=dict(regex="a+")))

    with pytest.raises(InvalidRequestError, match="not supported with streaming input"):
        async for _ in engine.generate(chunks(), SamplingParams(structured_outputs=dict(regex="a+"))):
            pass
    with pytest.raises(InvalidRequestError, match="not supported with streaming input"):
        await engine.check_sampling_params(SamplingParams(structured_outputs=dict(regex="a+")), streaming=True)


@pytest.fixture
def compiles(monkeypatch):
    """The grammars the engines compile, as (kind, the thread that compiled it): counted where their text is made."""
    made, text = [], structured_outputs.grammar_text

    def counted(params):
        made.append((params.kind, threading.current_thread()))
        return text(params)

    monkeypatch.setattr(structured_outputs, "grammar_text", counted)
    return made


async def test_a_checked_grammar_is_compiled_once_off_the_event_loop(engine, compiles):
    """`check_sampling_params` compiles the grammar on a worker thread, into the cache `generate` takes it from: the
    request that follows is not compiled again, and its text follows the grammar."""
    constraint = dict(regex=r"[a-z]{3}_[0-9]{3}")  # this test's own: the module's engine has compiled none like it
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=constraint)
    assert await engine.check_sampling_params(params) is None
    assert [kind for kind, _ in compiles] == ["regex"] and compiles[0][1] is not threading.current_thread()
    _, _, text, reason = await run(engine, "hello", params)
    assert reason == "stop" and re.fullmatch(constraint["regex"], text), text
    assert len(compiles) == 1
    # Without a check, `generate` compiles it itself, once; a check after it finds it compiled.
    fresh = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=dict(regex=r"[0-9]{2}_[a-z]{2}"))
    _, _, text, reason = await run(engine, "hello", fresh)
    await engine.check_sampling_params(fresh)
    assert reason == "stop" and re.fullmatch(r"[0-9]{2}_[a-z]{2}", text), text
    assert len(compiles) == 2


@pytest.mark.parametrize("source", ["none", "sentencepiece", "word-level"])
def test_a_model_without_a_tokenizer_llguidance_reads_refuses_structured_outputs(source):
    from jaxstream.engine.structured_outputs import Grammars

    tokenizer = {"none": None, "sentencepiece": Path(__file__).parents[1] / "models" / "assets" / "tiny",
                 "word-level": FIXTURES / "chat" / "tokenizer.json"}[source]
    tokenizer = tokenizer and load_tokenizer(tokenizer)
    with pytest.raises(InvalidRequestError, match="need|cannot use"):
        Grammars(tokenizer, VOCAB, {EOS}).guide(StructuredOutputsParams(regex="a+"))


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice="ab"), "non-empty list of strings"),
    (dict(json="{not json"), "not a JSON schema"),
    (dict(json=[1, 2]), "must be a JSON schema"),
    (dict(json_object=False), "must be true"),
    (dict(regex="a", disable_any_whitespace="yes"), "must be a bool"),
    (dict(regex="a", reasoning_end_token_id="</think>"), "must be an integer"),
])
def test_malformed_structured_outputs_params_are_refused(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**fields)
