"""AsyncEngine.generate: vLLM's streaming-input API end to end (specs/streaming_semantics.md §1, §3) on the
deterministic toy model; the oracle is `toy_next_token` applied under vLLM's context rules."""
import asyncio
import dataclasses
import logging
import re

import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import RequestOutputKind, SamplingParams, StreamingInput
from jaxstream.engine.testing import ToyLM, toy_config, toy_next_token
from jaxstream.errors import EngineError

CFG = toy_config(vocab_size=97, window=16)


# Every test must leave the module's engine idle with no pages, slots or host memory held.
pytestmark = pytest.mark.usefixtures("engine_returns_to_baseline")


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(ToyLM(CFG), config=EngineConfig(
        max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),), max_num_batched_tokens=64))
    yield engine
    engine.close()


def greedy(max_tokens, stop=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop)


def continue_greedy(context, count, stop=None):
    out = []
    while len(out) < count:
        out.append(toy_next_token(context + out, CFG))
        if stop and out[-1] in stop:
            break
    return out


async def test_worked_example(engine):
    """§1.8: x1 | y1 y2 y3 | z1 S | w1 w2, then the generator closes while parked."""
    a, b, c, d, e, f, g = 11, 12, 13, 14, 15, 16, 17
    x = continue_greedy([a, b, c], 1)
    y = continue_greedy([a, b, c, d, e], 3)
    z_probe = continue_greedy([a, b, c, d, e] + y[:2] + [f], 2)
    stop = z_probe[1]
    assert stop != z_probe[0]
    z = continue_greedy([a, b, c, d, e] + y[:2] + [f], 4, stop=[stop])
    w = continue_greedy([a, b, c, d, e] + y[:2] + [f] + z[:1] + [g], 2)
    chunk_ended = asyncio.Queue()

    async def inputs():
        yield StreamingInput([a, b, c], greedy(1))
        await chunk_ended.get()  # 2 arrives while parked
        yield StreamingInput([d, e], greedy(3))
        yield StreamingInput([f], greedy(4, stop=[stop]))  # queued while 2 runs
        await chunk_ended.get()
        await chunk_ended.get()
        yield StreamingInput([g], greedy(2))
        await chunk_ended.get()  # closes while parked

    groups, current, finals = [], [], []
    async for out in engine.generate(inputs(), request_id="worked"):
        current += out.outputs[0].token_ids
        if out.outputs[0].finish_reason:
            groups.append(current)
            current = []
            finals.append((out.outputs[0].finish_reason, out.finished))
            chunk_ended.put_nowait(None)
    assert groups == [x, y, z, w] and z[-1] == stop
    assert finals == [("length", False), ("length", False), ("stop", False), ("length", False)]


async def test_zero_chunks_make_no_request(engine):
    async def nothing():
        return
        yield  # noqa: unreachable - makes this an async generator

    outputs = [out async for out in engine.generate(nothing(), request_id="empty")]
    assert outputs == [] and "empty" not in engine.core.sessions


async def test_close_while_parked_strict_mode_emits_a_final_output(engine):
    engine.core.cfg = dataclasses.replace(engine.core.cfg, compat="strict")
    try:
        parked = asyncio.Event()

        async def inputs():
            yield StreamingInput([1, 2], greedy(2))
            await parked.wait()

        outputs = []
        async for out in engine.generate(inputs(), request_id="strict"):
            outputs.append(out)
            if out.outputs[0].finish_reason:
                parked.set()
    finally:
        engine.core.cfg = dataclasses.replace(engine.core.cfg, compat="vllm")
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == []
    assert [t for o in outputs for t in o.outputs[0].token_ids] == continue_greedy([1, 2], 2)


async def test_abort_drops_queued_chunks_and_ends_the_stream(engine):
    sent = []
    gate = asyncio.Event()

    async def inputs():
        for prompt in ([5, 6], [7], [8]):
            sent.append(prompt)
            yield StreamingInput(prompt, greedy(40))
        await gate.wait()
        sent.append("late")
        yield StreamingInput([9], greedy(1))

    outputs = []
    async for out in engine.generate(inputs(), request_id="ab"):
        outputs.append(out)
        if len(outputs) == 3:
            await engine.abort("ab")
    gate.set()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outputs) < 40  # the first chunk was cut, the rest dropped
    assert "ab" not in engine.core.sessions


async def test_input_generator_error_reaches_the_caller(engine):
    class Broken(Exception):
        pass

    async def inputs():
        yield StreamingInput([3, 4], greedy(1))
        raise Broken("input failed")

    with pytest.raises(Broken):
        async for _ in engine.generate(inputs(), request_id="broken"):
            pass


@pytest.mark.parametrize("chunks_before", [0, 1])
async def test_an_input_cancelled_by_another_task_ends_the_stream(engine, chunks_before):
    """The input's own CancelledError (a future it waits for was cancelled elsewhere, such as a client
    connection's next message) is an input error: the session ends and generate() raises it as an EngineError (a
    CancelledError would read as the caller's own cancellation). It was taken for the feeder's own cancel: the
    feeder died quietly and generate() waited for good on a parked session that held its slot and pages."""
    elsewhere = asyncio.get_running_loop().create_future()

    async def inputs():
        for _ in range(chunks_before):
            yield StreamingInput([3, 4], greedy(1))
        await elsewhere
        yield StreamingInput([5], greedy(1))

    async def consume():
        async for _ in engine.generate(inputs(), request_id=f"cancelled{chunks_before}"):
            elsewhere.cancel()

    if not chunks_before:
        asyncio.get_running_loop().call_later(0.1, elsewhere.cancel)
    with pytest.raises(EngineError, match="the streaming input was cancelled") as raised:
        async with asyncio.timeout(30):  # a hang fails as a TimeoutError
            await consume()
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    assert f"cancelled{chunks_before}" not in engine.core.sessions


async def test_abort_before_the_first_chunk_ends_the_stream_and_nothing_reaches_the_engine(engine):
    """abort() while a streaming request waits for its first chunk ends the stream at once with the final `abort`
    output, and the input is not asked for that chunk (the abort found no session in the engine: it was lost, and
    the first chunk then started a session that ran to the end)."""
    gate, asked = asyncio.Event(), []

    async def inputs():
        await gate.wait()
        asked.append("first")
        yield StreamingInput([5, 6], greedy(3))

    async def consume():
        return [out async for out in engine.generate(inputs(), request_id="early")]

    stream = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # generate() is waiting for the first chunk
    await engine.abort("early")
    outputs = await asyncio.wait_for(stream, 30)
    gate.set()
    assert [(o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outputs] == [(True, "abort", [])]
    await asyncio.sleep(0.05)
    assert not asked and "early" not in engine.core.sessions


async def test_an_id_taken_again_at_once_after_an_early_abort_belongs_to_the_new_request(engine):
    """A streaming request aborted before its first chunk, and its id taken by a new request before the first has
    read its abort output: the first's end must leave the new request's state alone (it removed the new request's
    mark, and the new request's own early abort was then lost: it waited for good)."""
    gates = [asyncio.Event(), asyncio.Event()]

    async def consume(gate):
        async def inputs():
            await gate.wait()
            yield StreamingInput([5, 6], greedy(3))

        return [(o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids)
                async for o in engine.generate(inputs(), request_id="again")]

    first = asyncio.create_task(consume(gates[0]))
    await asyncio.sleep(0.05)
    await engine.abort("again")
    second = asyncio.create_task(consume(gates[1]))  # registers before the first reads its abort output
    await asyncio.sleep(0.05)
    await engine.abort("again")  # the second's, before its first chunk
    ended = await asyncio.wait_for(asyncio.gather(first, second), 30)
    for gate in gates:
        gate.set()
    assert ended == [[(True, "abort", [])]] * 2
    await asyncio.sleep(0.05)
    assert "again" not in engine.core.sessions


@pytest.mark.parametrize("params, chunk", [
    (SamplingParams(n=2), None),
    (SamplingParams(stop=["x"]), None),
    (SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), None),
    (SamplingParams(), StreamingInput({"prompt_embeds": [0.0]})),
    # `generate` merges a slow consumer's outputs by the session's kind: a chunk of another kind would lose or
    # repeat tokens.
    (SamplingParams(output_kind=RequestOutputKind.CUMULATIVE), StreamingInput([1], SamplingParams(max_tokens=2))),
])
async def test_rejections(engine, params, chunk):
    async def inputs():
        yield chunk or StreamingInput([1])

    with pytest.raises(ValueError):
        async for _ in engine.generate(inputs(), params, request_id="rejected"):
            pass


async def test_consumer_cancel_frees_the_session(engine):
    async def inputs():
        yield StreamingInput([1, 2, 3], greedy(50))
        await asyncio.Event().wait()  # never closes on its own

    stream = engine.generate(inputs(), request_id="cancelled")
    async for _ in stream:
        break
    await stream.aclose()


async def test_slow_consumer_merges_within_chunks_only(engine):
    async def inputs():
        yield StreamingInput([2, 3], greedy(6))
        yield StreamingInput([4], greedy(5))

    stream = engine.generate(inputs(), request_id="slow")
    await asyncio.sleep(0)
    outputs = []
    async for out in stream:
        outputs.append(out)
        await asyncio.sleep(0.05)
    boundaries = [o for o in outputs if o.outputs[0].finish_reason]
    assert len(boundaries) == 2 and boundaries[-1].finished
    expected_first = continue_greedy([2, 3], 6)
    expected_second = continue_greedy([2, 3] + expected_first[:-1] + [4], 5)
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    assert tokens == expected_first + expected_second
    split = outputs.index(boundaries[0]) + 1
    assert [t for o in outputs[:split] for t in o.outputs[0].token_ids] == expected_first


async def test_one_failing_session_does_not_affect_another(engine):
    async def good():
        yield StreamingInput([6, 6, 6], greedy(12))

    async def bad():
        yield StreamingInput([6, 6, 6], greedy(12))
        raise KeyError("bad input")

    async def collect(stream):
        return [t async for out in stream for t in out.outputs[0].token_ids]

    results = await asyncio.gather(collect(engine.generate(good(), request_id="g")),
                                   collect(engine.generate(bad(), request_id="b")), return_exceptions=True)
    assert results[0] == continue_greedy([6, 6, 6], 12)
    assert isinstance(results[1], KeyError)


async def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy(engine):
    async def run(params, rid):
        return [t async for out in engine.generate([9, 8, 7], params, request_id=rid)
                for t in out.outputs[0].token_ids]

    seeded = SamplingParams(temperature=1.5, top_p=0.9, seed=123, max_tokens=12)
    first, second = await asyncio.gather(run(seeded, "s1"), run(seeded, "s2"))
    assert first == second
    top1 = await run(SamplingParams(temperature=2.0, top_k=1, max_tokens=12), "k1")
    assert top1 == continue_greedy([9, 8, 7], 12)


# -- logging (quiet by default; `jaxstream -v` shows these) and failures that must reach the caller --------

async def test_a_command_failing_before_its_session_exists_reaches_the_caller(engine, monkeypatch, caplog):
    """The engine thread runs `add_chunk`; when it raises before creating the session, nothing in the core
    can answer the request, so the caller used to wait forever with nothing logged."""
    class Broken(Exception):
        pass

    def add_chunk(*args, **kwargs):
        raise Broken("no pages")

    monkeypatch.setattr(engine.core, "add_chunk", add_chunk)
    with caplog.at_level(logging.ERROR, logger="jaxstream"), pytest.raises(Broken, match="no pages"):
        await asyncio.wait_for(_drain(engine.generate([1, 2], greedy(3), request_id="orphan")), timeout=30)
    (record,) = [r for r in caplog.records if "before its session existed" in r.getMessage()]
    assert "orphan" in record.getMessage() and isinstance(record.exc_info[1], Broken)


async def test_a_failed_dispatch_is_logged_with_its_exception(engine, monkeypatch, caplog):
    def run(key, batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.core.programs, "run", run)
    with caplog.at_level(logging.ERROR, logger="jaxstream"), pytest.raises(RuntimeError, match="device lost"):
        await asyncio.wait_for(_drain(engine.generate([1, 2], greedy(3), request_id="dispatch")), timeout=30)
    (record,) = [r for r in caplog.records if "dispatch failed" in r.getMessage()]
    assert str(record.exc_info[1]) == "device lost"


async def test_rejected_requests_and_evictions_are_logged(engine, caplog):
    caplog.set_level(logging.INFO, logger="jaxstream")
    async def one_chunk():
        yield StreamingInput([1])

    with pytest.raises(ValueError):
        await _drain(engine.generate(one_chunk(), SamplingParams(n=2), request_id="two"))
    assert any("request rejected (invalid_request): n > 1" in r.getMessage() for r in caplog.records)
    # The detokenizers always skip special tokens: asking to keep them is refused (it was taken and ignored).
    with pytest.raises(ValueError, match="skip_special_tokens=False is not supported"):
        await _drain(engine.generate([1], SamplingParams(skip_special_tokens=False), request_id="specials"))

    # Five sessions parked with their KV on an engine of four slots: admitting the fifth evicts one.
    release, parked = asyncio.Event(), asyncio.Queue()

    async def session(index):
        async def inputs():
            yield StreamingInput([index + 1, 2], greedy(1))
            await release.wait()

        async for out in engine.generate(inputs(), request_id=f"parked{index}"):
            if out.outputs[0].finish_reason:
                parked.put_nowait(index)

    tasks = []
    for index in range(5):
        tasks.append(asyncio.create_task(session(index)))
        await asyncio.wait_for(parked.get(), timeout=30)
    release.set()
    await asyncio.gather(*tasks)
    assert any(r.getMessage().startswith("evicted parked session parked0 to host memory") for r in caplog.records)


def test_start_up_logs_what_it_compiled(caplog):
    with caplog.at_level(logging.DEBUG, logger="jaxstream"):
        AsyncEngine(ToyLM(CFG), config=EngineConfig(max_sessions=1, prefill_buckets=((1, 4),))).close()
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(r"compiled program \('text', 1, 4\) in \d+\.\d\d s \(GB: arguments \d+\.\d{3}, aliased "
                            r"\d+\.\d{3}, temporaries \d+\.\d{3}\)", m) for m in messages), messages
    # Its decode and prefill programs and the one that writes structured outputs' bitmasks.
    assert any(m.startswith("compiled and warmed 3 step programs in ") for m in messages)


def test_event_times_are_milliseconds():
    """35 slots of 80 ms are 2.8 s, which float arithmetic makes 2.8000000000000003."""
    from jaxstream.engine.transcription_session import to_ms, token_time

    assert 35 * 0.08 != 2.8 and token_time(34) == 2.8 and repr(token_time(34)) == "2.8"
    assert to_ms(1.23456) == 1.235


async def _drain(stream) -> list:
    return [out async for out in stream]
