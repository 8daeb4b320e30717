"""vLLM's presence, frequency and repetition penalties, min_p and logit_bias in the engine.

Oracles: transformers (tests/make_penalty_fixtures.py: greedy generate with repetition_penalty and with
sequence_bias over the tiny Mistral and Llama, MinPLogitsWarper on logits), and a float64 numpy statement of vLLM's
and OpenAI's formulas over the logits of an offline forward of the tiny Mistral (no paging, no engine): logit_bias
added, the repetition penalty over the chunk's context (the cumulative prompt and its outputs), then
`logit - count * frequency - (count > 0) * presence` over the chunk's outputs. Streaming input folds every output
but the last sampled one of a chunk into the next chunk's prompt (specs/streaming_semantics.md §1.2): the
discarded token leaves the penalties too. Preemption, eviction to host memory and recompute give the same tokens.
"""
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.engine import builders, sampling, steps
from jaxstream.engine.builders import build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import MAX_LOGIT_BIAS, SamplingParams
from jaxstream.errors import InvalidRequestError
from jaxstream.models import loading
from test_engine_sampling import offline_logits
from test_engine_scheduler import Collector, add, leave_at_baseline, run
from test_engine_text_model import FIXTURE, LLAMA, tiny_lm

REFERENCE = Path(__file__).parent / "fixtures" / "penalties_reference.npz"
ENGINE_CFG = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=64)
MAX_CONTEXT = 64  # the offline forward's one compiled length
MIN_MARGIN = 1e-3  # the oracle's top-1/top-2 gap: float32 and float64 pick the same token


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


@pytest.fixture(scope="module")
def mistral():
    return build_text_core(tiny_lm(FIXTURE), ENGINE_CFG)


@pytest.fixture(scope="module")
def llama():
    return build_text_core(tiny_lm(LLAMA), ENGINE_CFG)


@pytest.fixture(autouse=True)
def back_to_baseline(request):
    yield
    for name in ("mistral", "llama"):
        if name in request.fixturenames:
            leave_at_baseline(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def logits_of():
    """context -> [len, V] float64 logits of one offline forward of the tiny Mistral over the whole context."""
    forward = offline_logits(tiny_lm(FIXTURE), MAX_CONTEXT)
    return lambda context: forward(context).astype(np.float64)


def penalized(logits, context, outputs, params: SamplingParams):
    """vLLM's processed logits (float64): logit_bias, repetition over `context` (the chunk's prompt and outputs),
    then OpenAI's frequency and presence over `outputs` (the chunk's)."""
    logits = logits.copy()
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    seen = np.unique(np.asarray(context, np.int64))
    penalty = params.repetition_penalty
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    count = np.bincount(np.asarray(outputs, np.int64), minlength=logits.size)
    return logits - count * params.frequency_penalty - (count > 0) * params.presence_penalty


def greedy_oracle(logits_of, chunks, params, *, keep_discarded=False, carry_counts=False):
    """The greedy tokens of each chunk [(prompt, max_tokens)] of a streamed session under vLLM's rules. The
    flags state the mistakes the engine must not make (for checking that a case can tell them apart): the
    discarded last token of a chunk left in the context the penalties read, or the outputs folded into the
    prompt still counted as outputs."""
    context, per_chunk, earlier = [], [], []
    for prompt, max_tokens in chunks:
        context = context + list(prompt)
        out = []
        for _ in range(max_tokens):
            logits = logits_of(context + out)[-1]
            seen = context + out + (per_chunk[-1][-1:] if keep_discarded and per_chunk else [])
            counted = (earlier if carry_counts else []) + out
            processed = penalized(logits, seen, counted, params)
            top2 = np.sort(processed)[-2:]
            assert top2[1] - top2[0] > MIN_MARGIN, "an ambiguous oracle: pick other inputs"
            out.append(int(np.argmax(processed)))
        per_chunk.append(out)
        earlier += out[:-1]
        context = context + out[:-1]
    return per_chunk


def greedy(max_tokens, **penalties):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **penalties)


def one_shot(core, prompt, params, request_id="r"):
    sink = Collector()
    add(core, request_id, prompt, params, sink, first=True, resumable=False)
    run(core)
    [tokens] = sink.chunks()
    return tokens


def streamed(core, chunks, params, request_id="s"):
    """Chunks [(prompt, max_tokens)] of one session, each applied once the previous one parked."""
    sink = Collector()
    for i, (prompt, max_tokens) in enumerate(chunks):
        add(core, request_id, prompt, dataclasses.replace(params, max_tokens=max_tokens), sink,
            first=i == 0)
        run(core)
    core.end_input(request_id)
    return sink.chunks()


# -- transformers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mistral", "llama"])
def test_repetition_penalty_and_logit_bias_equal_transformers_generate(request, reference, name):
    core = request.getfixturevalue(name)
    prompt = reference[f"{name}_tiny_prompt"].tolist()
    assert one_shot(core, prompt, greedy(24)) == reference[f"{name}_tiny_plain"].tolist()
    assert one_shot(core, prompt, greedy(24, repetition_penalty=1.3)) == reference[f"{name}_tiny_repetition"].tolist()
    bias = dict(zip(reference[f"{name}_tiny_bias_ids"].tolist(), reference[f"{name}_tiny_bias_values"].tolist()))
    # JSON's keys are strings: the engine takes them too.
    assert one_shot(core, prompt, greedy(24, logit_bias={str(k): v for k, v in bias.items()})) == reference[
        f"{name}_tiny_bias"].tolist()


def test_min_p_keeps_what_transformers_min_p_warper_keeps(reference):
    logits = reference["minp_logits"]
    rows = logits.shape[0]
    for min_p, kept in zip(reference["minp_values"], reference["minp_kept"]):
        got = sampling.filtered_logits(logits, np.ones(rows, np.float32), np.zeros(rows, np.int32),
                                       np.ones(rows, np.float32), np.full(rows, min_p, np.float32))
        np.testing.assert_array_equal(np.isfinite(np.asarray(got)), kept, err_msg=f"min_p {min_p}")
        assert 1 <= kept.sum(-1).min() and (min_p < 1 or kept.sum() == rows)


# -- the on-device pieces ----------------------------------------------------------------------------------------
def test_penalties_and_logit_bias_follow_the_formulas_and_keep_the_raw_logprobs():
    rng = np.random.default_rng(0)
    rows, vocab = 6, 40
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    counts = np.zeros((rows + 2, vocab), np.int32)  # two extra slots no row reads
    slot = np.array([3, 0, 5, 1, 2, 4], np.int32)
    context, outputs = [], []
    for row in range(rows):
        context.append(rng.integers(0, vocab, 12))
        outputs.append(rng.integers(0, vocab, int(rng.integers(0, 6))))
        counts[slot[row], np.unique(context[-1])] |= 1
        np.add.at(counts[slot[row]], outputs[-1], 2)
        counts[slot[row], outputs[-1]] |= 1
    presence = np.array([0, 1.5, -2, 0, 0.3, 0], np.float32)
    frequency = np.array([0, 0.5, 0, 2, -1, 0], np.float32)
    repetition = np.array([1, 1.3, 0.7, 1, 2, 1], np.float32)
    bias_ids = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    bias_ids[2, :3], bias_values[2, :3] = [7, 8, 9], [5, -100, 0.5]
    bias_ids[5, :1], bias_values[5, :1] = [int(np.argsort(logits[5])[-4])], [100]
    tokens, logprobs = sampling.sample(
        logits, np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
        np.zeros(rows, np.uint32), np.zeros(rows, np.int32), logit_bias=(bias_ids, bias_values),
        penalties=sampling.Penalties(counts, slot, presence, frequency, repetition))
    for row in range(rows):
        params = SamplingParams(presence_penalty=float(presence[row]), frequency_penalty=float(frequency[row]),
                                repetition_penalty=float(repetition[row]),
                                logit_bias=dict(zip(bias_ids[row][bias_ids[row] >= 0].tolist(),
                                                    bias_values[row][bias_ids[row] >= 0].tolist())))
        expected = penalized(logits[row].astype(np.float64), np.r_[context[row], outputs[row]], outputs[row], params)
        assert int(tokens[row]) == int(np.argmax(expected)), row
    assert int(tokens[0]) == int(np.argmax(logits[0])) and int(tokens[5]) == bias_ids[5, 0]
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(logprobs), raw[np.arange(rows), np.asarray(tokens)], rtol=1e-5)


def test_fed_tokens_are_counted_per_chunk_and_start_over_at_position_zero():
    vocab, slots = 11, 3
    counts, start = np.zeros((slots, vocab), np.int32), np.zeros(slots, np.int32)

    def feed(slot, lengths, tokens, output_start):
        nonlocal counts, start
        batch = steps.text_batch(2, 4, 1)  # row 1 is padding (slot -1): it writes nothing
        batch.update(slot=np.array([slot, -1], np.int32), lengths=np.array([lengths, 0], np.int32),
                     num_new=np.array([len(tokens), 4], np.int32), output_start=np.array([output_start, 0], np.int32))
        batch["token_ids"][0, :len(tokens)] = tokens
        batch["token_ids"][1] = 9
        counts, start = (np.asarray(a) for a in sampling.count_fed_tokens(jnp.asarray(counts), jnp.asarray(start),
                                                                           batch))
        return counts[slot] >> 1, counts[slot] & 1

    # A prompt [4, 4, 5], then outputs 6, 6 fed back (the chunk's outputs start at position 3).
    feed(1, 0, [4, 4, 5], 3)
    count, seen = feed(1, 3, [6, 6], 3)
    assert np.flatnonzero(seen).tolist() == [4, 5, 6] and count.tolist() == [0] * 6 + [2] + [0] * 4
    # A new chunk: the folded outputs are prompt now, so they are seen but counted no more.
    count, seen = feed(1, 5, [7], 6)
    assert np.flatnonzero(seen).tolist() == [4, 5, 6, 7] and not count.any()
    count, seen = feed(1, 6, [5, 8, 8], 6)
    assert count[[5, 8]].tolist() == [1, 2] and count.sum() == 3
    # Position 0 again (a new session in the slot, or a recompute): nothing of before is left.
    count, seen = feed(1, 0, [3], 1)
    assert np.flatnonzero(seen).tolist() == [3] and not count.any()
    assert not counts[[0, 2]].any() and start.tolist() == [0, 1, 0]


# -- the engine against the float64 oracle ---------------------------------------------------------------------
PENALTIES = [dict(repetition_penalty=3.0), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=0.8,
                  logit_bias={40: 3.0, 41: -2.0})]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["repetition", "frequency", "presence", "all"])
def test_a_streamed_session_takes_penalties_over_its_cumulative_prompt(mistral, logits_of, penalties):
    chunks = [([104, 187, 77], 5), ([206, 34, 248, 188, 179], 3), ([102, 241, 61, 26, 215], 5)]
    params = greedy(1, **penalties)
    expected = greedy_oracle(logits_of, chunks, params)
    assert streamed(mistral, chunks, params) == expected
    if penalties == PENALTIES[0]:  # this case tells the discarded last token apart
        assert greedy_oracle(logits_of, chunks, params, keep_discarded=True) != expected
    if penalties == PENALTIES[1]:  # and this one the outputs of earlier chunks
        assert greedy_oracle(logits_of, chunks, params, carry_counts=True) != expected


def test_preempted_and_evicted_sessions_recompute_the_same_tokens(mistral, logits_of):
    """Sessions preempted for pages (their KV freed and recomputed) and a parked one evicted to host memory or
    dropped, each resumed: the greedy tokens are the oracle's, the seeded ones those of a run alone."""
    greedy_params = greedy(12, repetition_penalty=3.0, frequency_penalty=0.5)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=12, presence_penalty=1.0, min_p=0.05,
                            logit_bias={7: 4.0})
    prompts = {"g": [30, 31, 32, 33, 34], "s": [60, 61, 62]}
    alone = one_shot(mistral, prompts["s"], seeded)
    pool = mistral.cache.pools["text"]
    held = pool.allocate(pool.num_free - 3)  # one session's full window (2 pages) and one more page
    try:
        sinks = {rid: Collector() for rid in prompts}
        for rid, params in (("g", greedy_params), ("s", seeded)):
            add(mistral, rid, prompts[rid], params, sinks[rid], first=True, resumable=False)
        preempted = mistral.preemptions
        run(mistral)
        assert mistral.preemptions > preempted
    finally:
        pool.release(held)
    assert sinks["g"].chunks() == greedy_oracle(logits_of, [(prompts["g"], 12)], greedy_params)
    assert sinks["s"].chunks() == [alone]

    chunks = [([5, 6, 5, 6], 4), ([9, 9], 6)]
    params = greedy(1, repetition_penalty=3.0, presence_penalty=1.0)
    for host_bytes in (1 << 30, 0):  # evicted to host memory, then dropped (recomputed)
        held = [mistral.cache.take_slot() for _ in range(2)]  # 2 of 4 slots left
        mistral.host_offload_bytes = host_bytes
        try:
            sinks = {rid: Collector() for rid in "abc"}
            for rid in "ab":
                add(mistral, rid, chunks[0][0], dataclasses.replace(params, max_tokens=4), sinks[rid],
                    first=True)
                run(mistral)
            add(mistral, "c", [70, 71], params, sinks["c"], first=True, resumable=False)
            run(mistral)
            assert not mistral.sessions["a"].resident
            add(mistral, "a", chunks[1][0], dataclasses.replace(params, max_tokens=6), sinks["a"])
            run(mistral)
            for rid in "ab":
                mistral.end_input(rid)
        finally:
            for slot in held:
                mistral.cache.release_slot(slot)
            mistral.host_offload_bytes = 8 << 30
        assert sinks["a"].chunks() == greedy_oracle(logits_of, chunks, params), host_bytes


def test_a_batch_mixing_rows_with_and_without_penalties_gives_each_its_own_tokens(mistral, logits_of):
    requests = {
        "plain": ([7, 7, 100], greedy(10)),
        "repetition": ([5, 9, 30, 41], greedy(10, repetition_penalty=2.0)),
        "sampled": ([250, 3, 3, 3, 8], SamplingParams(temperature=1.0, seed=3, max_tokens=10, frequency_penalty=1.0,
                                                      min_p=0.1, top_k=20)),
        "bias": ([60, 61], greedy(10, logit_bias={i: -100.0 for i in range(6, 256)})),  # all but ids 0-5
    }
    alone = {rid: one_shot(mistral, prompt, params, rid) for rid, (prompt, params) in requests.items()}
    sinks = {rid: Collector() for rid in requests}
    for rid, (prompt, params) in requests.items():
        add(mistral, rid, prompt, params, sinks[rid], first=True, resumable=False)
    run(mistral)
    assert {rid: sink.chunks()[0] for rid, sink in sinks.items()} == alone
    assert all(t < 6 for t in alone["bias"])
    for rid in ("plain", "repetition"):
        prompt, params = requests[rid]
        assert [alone[rid]] == greedy_oracle(logits_of, [(prompt, 10)], params)
    assert alone["repetition"] != one_shot(mistral, [5, 9, 30, 41], greedy(10))


# -- validation and defaults -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-2.01), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty="1"), "presence_penalty must be a number"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids to biases"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={"-3": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={2**31: 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={True: 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: 100.5}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={5: "1"}), "logit_bias value must be a number"),
    (dict(logit_bias={5: float("nan")}), "logit_bias value must be finite"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias takes at most 300 token ids"),
])
def test_invalid_values_raise_naming_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_keys_are_normalised_and_an_empty_one_is_none():
    assert SamplingParams(logit_bias={"5": 1, 7: -100}).logit_bias == {5: 1.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_an_id_outside_the_vocabulary_fails_the_request_alone(mistral):
    sink = Collector()
    add(mistral, "bad", [5, 6], greedy(3, logit_bias={256: 1.0}), sink, first=True, resumable=False)
    [error] = sink.items
    assert isinstance(error, InvalidRequestError) and "outside the vocabulary [0, 256): [256]" in str(error)
    assert one_shot(mistral, [5, 6], greedy(3, logit_bias={255: 1.0})) and "bad" not in mistral.sessions


def test_the_checkpoint_declares_min_p_and_repetition_penalty_defaults(tmp_path):
    directory = tmp_path / "llama"
    shutil.copytree(LLAMA, directory)
    config = directory / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "repetition_penalty": 1.1, "min_p": 0.05,
                                  "temperature": 0.6}))
    model = loading.load_model(directory).model
    assert builders.checkpoint_sampling_params(model, directory) == SamplingParams(
        temperature=0.6, repetition_penalty=1.1, min_p=0.05)
    assert builders.checkpoint_sampling_params(model, directory, "vllm") == SamplingParams()
