"""vLLM's `allowed_token_ids` and `bad_words` through `AsyncEngine.generate`: a random-weight Llama of 320 ids with a
byte-level BPE tokenizer.json (tests/fixtures/byte_bpe), whose greedy text repeats "llo" and writes "dog".

Oracles: greedy tokens equal the argmax of an offline forward's logits masked by numpy (the allowed ids; the last
token of each bad word's tokenization where the outputs end with its other tokens: vLLM's tokenization and rule,
written out here), and the logprobs and most likely ids are the unmasked logits' (vLLM's raw logprobs, taken before
either applies), or a grammar's masked ones beside structured outputs (llguidance's bitmask, which applies before).
Sampled children, streamed chunks and requests preempted beside free ones are checked against the allowed set, the
banned sequences and what each request gets alone."""
import asyncio

import jax
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from engine_fixtures import BYTE_BPE as TOKENIZER, BYTE_BPE_EOS as EOS, byte_bpe_engine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StreamingInput
from jaxstream.errors import InvalidRequestError
from jaxstream.models.tokenizers import load_tokenizer
from test_engine_scheduler import leave_at_baseline
from test_engine_structured_outputs import BASE, VOCAB, oracle_logits

LLO, DOG = 288, 307  # "llo", "dog"
ALLOWED = [67, 88, 129, 165, 222, 262, 266, DOG, LLO]  # "a", "v", "\ufffd", ..., " n", "tr", "dog", "llo"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = byte_bpe_engine(EngineConfig(**BASE), tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return [*tokenizer.prompt_prefix, *tokenizer.encode("the weather is")]


@pytest.fixture(autouse=True)
def at_baseline(request):
    yield
    if "engine" in request.fixturenames:
        asyncio.run(request.getfixturevalue("engine").wait_until_idle())
        leave_at_baseline(request.getfixturevalue("engine").core)


async def run(engine, prompt, params):
    """(token ids, logprobs, most likely ids a step, text) of a one-shot request."""
    tokens, logprobs, tops, text = [], [], [], ""
    async for out in engine.generate(prompt, params):
        completion = out.outputs[0]
        tokens += completion.token_ids
        logprobs += completion.logprobs or []
        tops += completion.top_logprobs or []
        text += completion.text
    return tokens, logprobs, tops, text


def bad_sequences(tokenizer, words) -> list[list[int]]:
    """vLLM's `update_from_tokenizer`: each word's tokens, and those after a space where that gives another first token
    and as many tokens."""
    sequences = []
    for word in words:
        plain, spaced = tokenizer.encode(word.lstrip()), tokenizer.encode(" " + word.lstrip())
        sequences.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def banned(sequences, outputs) -> list[int]:
    """vLLM's `apply_bad_words`: the last token of each sequence whose other tokens end the outputs."""
    return [ids[-1] for ids in sequences
            if len(ids) - 1 <= len(outputs) and outputs[len(outputs) - len(ids) + 1:] == ids[:-1]]


def occurs(ids, tokens) -> bool:
    return any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))


def check_greedy(engine, prompt, got, *, allowed=None, sequences=(), top=0, grammar=None):
    """Each greedy token is the argmax of the masked logits; its logprob and the `top` most likely ids are those of the
    raw logits (or of the grammar's masked ones: `grammar`, an llguidance matcher at the start)."""
    tokens, logprobs, tops, _ = got
    logits = oracle_logits(engine, [*prompt, *tokens[:-1]])[len(prompt) - 1:]
    bitmask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    for step, token in enumerate(tokens):
        raw = logits[step:step + 1].copy()
        if grammar is not None:
            llguidance.numpy.fill_next_token_bitmask(grammar, bitmask)
            llguidance.numpy.apply_token_bitmask_inplace(raw, bitmask)
        masked = raw[0].copy()
        if allowed is not None:
            masked[np.setdiff1d(np.arange(VOCAB), allowed)] = -np.inf
        masked[banned(sequences, tokens[:step])] = -np.inf
        assert int(np.argmax(masked)) == token, step
        expected = np.asarray(jax.nn.log_softmax(raw[0]))
        assert logprobs[step] == pytest.approx(float(expected[token]), abs=1e-4), step
        if top:  # ids the grammar leaves out tie at -inf, in any order
            likeliest = [token for token in np.argsort(-expected)[:top].tolist() if expected[token] > -np.inf]
            assert list(tops[step])[:len(likeliest)] == likeliest
            assert list(tops[step].values())[:len(likeliest)] == pytest.approx(expected[likeliest].tolist(), abs=1e-4)
        assert grammar is None or token == EOS or grammar.consume_token(token)


async def test_greedy_tokens_are_the_allowed_ids_argmax_and_logprobs_the_raw_ones(engine, prompt):
    free = await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, allowed_token_ids=ALLOWED)
    got = await run(engine, prompt, params)
    assert set(got[0]) <= set(ALLOWED) and free[0][0] not in ALLOWED  # the mask changed the first token
    # vLLM's raw logprobs: the likeliest ids are the model's, outside the allowed ones too.
    assert not set(got[2][0]) <= set(ALLOWED)
    check_greedy(engine, prompt, got, allowed=ALLOWED, top=5)
    # The next request in that slot samples from every id again.
    assert await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) == free


@pytest.mark.parametrize("suffix, words, without, seen", [
    ([], ["llollo"], None, [LLO, LLO]),  # two tokens: "llo" is banned right after "llo"
    ([LLO], ["llollo"], None, [LLO, LLO]),  # its first token in the prompt bans nothing: outputs only, as vLLM
    ([], ["dog", "n"], ["dog"], [262]),  # one token each; " n" is a word of its own, banned with "n"
])
async def test_bad_words_ban_their_last_token_after_the_others(engine, tokenizer, prompt, suffix, words, without,
                                                               seen):
    prompt = prompt + suffix
    before = await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                      bad_words=without))
    assert occurs(seen, before[0])
    sequences = bad_sequences(tokenizer, words)
    got = await run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3,
                                                   bad_words=words))
    assert not any(occurs(ids, got[0]) for ids in sequences)
    check_greedy(engine, prompt, got, sequences=sequences, top=3)
    if words == ["llollo"]:
        assert "llollo" in before[3] and "llollo" not in got[3]


async def test_beside_a_grammar_the_logprobs_are_its_masked_ones_and_the_allowed_ids_apply_after(engine, tokenizer,
                                                                                                 prompt):
    """vLLM masks a grammar before its sampler and the allowed ids inside it, after the raw logprobs."""
    allowed = [*ALLOWED, EOS]
    regex = "[a-z]{3,8}"
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=4, allowed_token_ids=allowed,
                            structured_outputs=dict(regex=regex))
    got = await run(engine, prompt, params)
    assert got[0][-1] == EOS and set(got[0]) <= set(allowed)
    ll_tokenizer = llguidance.LLTokenizer(TOKENIZER.joinpath("tokenizer.json").read_text(), n_vocab=VOCAB,
                                          eos_token=EOS)
    grammar = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("regex", regex))
    check_greedy(engine, prompt, got, allowed=allowed, top=4, grammar=grammar)


async def test_sampled_children_keep_to_the_allowed_ids_and_never_write_a_bad_word(engine, prompt):
    params = SamplingParams(temperature=1.5, seed=7, n=3, max_tokens=40, ignore_eos=True,
                            allowed_token_ids=ALLOWED, bad_words=["llollo", "dog"])
    texts: dict[int, list[int]] = {}
    async for out in engine.generate(prompt, params):
        for completion in out.outputs:
            texts.setdefault(completion.index, []).extend(completion.token_ids)
    assert len(texts) == 3
    for tokens in texts.values():
        assert len(tokens) == 40 and set(tokens) <= set(ALLOWED) - {DOG} and not occurs([LLO, LLO], tokens)
    # Without the bad words the same children write them.
    free = SamplingParams(temperature=1.5, seed=7, n=3, max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED)
    written = []
    async for out in engine.generate(prompt, free):
        written += [token for completion in out.outputs for token in completion.token_ids]
    assert DOG in written


async def test_streamed_chunks_take_their_own_ids_and_words_as_one_shot_requests_over_their_context(engine, prompt):
    chunks = [(prompt, SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=ALLOWED)),
              ([LLO], SamplingParams(temperature=0.0, max_tokens=12, bad_words=["llollo", "dog"])),
              ([DOG], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]

    async def session():
        for ids, params in chunks:
            yield StreamingInput(ids, params)

    outputs, current = [], []
    async for out in engine.generate(session(), SamplingParams()):
        current += out.outputs[0].token_ids
        if out.outputs[0].finish_reason is not None:
            outputs.append(current)
            current = []
    assert len(outputs) == 3 and set(outputs[0]) <= set(ALLOWED)
    context = []
    for (ids, params), tokens in zip(chunks, outputs):
        alone = await run(engine, context + ids, params)
        assert tokens == alone[0]
        context = context + ids + tokens[:-1]  # the chunk's last token is left out of the context (vLLM)


async def test_restricted_and_free_requests_under_preemption_get_what_they_get_alone(engine, tokenizer, prompt):
    kinds = [dict(allowed_token_ids=ALLOWED), dict(bad_words=["llollo", "dog"]), {},
             dict(allowed_token_ids=ALLOWED, bad_words=["llollo"]), {}, dict(bad_words=["n", "llollo"])]
    requests = [(prompt + [i], SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=24,
                                              ignore_eos=True, **kind))
                for i, kind in enumerate(kinds)]
    expected = [await run(engine, ids, params) for ids, params in requests]
    # Pages for about two sessions: running ones are preempted and recompute, and slots change hands.
    short = byte_bpe_engine(EngineConfig(**BASE, num_pages=1 + 16), tokenizer)
    try:
        got = await asyncio.gather(*(run(short, ids, params) for ids, params in requests))
        assert short.core.preemptions > 0
        await short.wait_until_idle()
        assert short.core.at_baseline()
    finally:
        short.close()
    for (tokens, _, _, text), (want_tokens, _, _, want_text) in zip(got, expected):
        assert (tokens, text) == (want_tokens, want_text)


@pytest.mark.parametrize("fields, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(allowed_token_ids="12"), "allowed_token_ids must be a list"),
    (dict(allowed_token_ids=[1, 2.0]), "allowed_token_ids must be a list of token ids"),
    (dict(bad_words=["ok", ""]), "bad_words cannot contain an empty string"),
    (dict(bad_words="dog"), "bad_words must be a list of strings"),
    (dict(bad_words=[f"w{i}" for i in range(129)]), r"Too many bad words after tokenization: 129\. The max number "
                                                    r"is 128\."),
])
def test_malformed_fields_are_refused_as_vllm_refuses_them(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields, message", [
    (dict(allowed_token_ids=[5, VOCAB]), "allowed_token_ids contains out-of-vocab token id!"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids contains out-of-vocab token id!"),
    (dict(bad_words=["  "]), r"bad_words entries must tokenize to at least one token\."),
    (dict(bad_words=["\x01" * 600, "\x02" * 600]), r"Too many total bad word tokens: 1200\. The max is 1024\."),
])
async def test_what_the_engine_refuses_fails_the_request(engine, prompt, fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        await run(engine, prompt, SamplingParams(max_tokens=4, **fields))


def test_bad_words_are_kept_once_and_need_a_tokenizer():
    from jaxstream.engine.sample_masks import SampleMasks

    assert SamplingParams(bad_words=["dog", "cat", "dog"]).bad_words == ("dog", "cat")
    assert SamplingParams(bad_words=[]).bad_words is None
    with pytest.raises(InvalidRequestError, match="need a tokenizer"):
        SampleMasks(None, VOCAB).for_params(SamplingParams(bad_words=["dog"]))
