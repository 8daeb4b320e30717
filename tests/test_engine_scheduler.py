"""Scheduler conformance (specs/streaming_semantics.md §3) on a deterministic toy model that stores its
context in the paged KV cache; the oracle is a plain-Python statement of vLLM's streaming-input rules."""
import jax
import numpy as np
import pytest

from jaxstream.engine.config import EngineConfig
from jaxstream.engine.builders import build_text_core
from jaxstream.engine.requests import SamplingParams
from jaxstream.engine.residency import END_OF_STREAM, Status, TickLog, TickStats
from jaxstream.engine.testing import ToyLM, toy_config, toy_next_token
from jaxstream.errors import InvalidRequestError

CFG = toy_config(vocab_size=97, window=16)


@pytest.fixture(scope="module")
def core():
    engine_cfg = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                              max_num_batched_tokens=64)
    return build_text_core(ToyLM(CFG), engine_cfg)


def leave_at_baseline(core) -> None:
    """The check after each test of a module of cores: the core is at its baseline (no session, page, slot or host
    memory held); sessions a failed test left behind are aborted either way, so the next test starts clean instead of
    failing for this one."""
    leftover = list(core.sessions)
    try:
        assert core.at_baseline(), "a session leaked pages, a slot or host memory"
    finally:
        for request_id in leftover:
            core.abort(request_id)


@pytest.fixture(autouse=True)
def back_to_baseline(core):
    yield
    leave_at_baseline(core)


def greedy(max_tokens, stop=None, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop, **kw)


def reference(chunks):
    """vLLM's rules for greedy chunks [(prompt, max_tokens, stop_ids)]: per-chunk outputs and the final
    KV context (every output folded in except the last of each chunk)."""
    context, outputs = [], []
    for prompt, max_tokens, stop in chunks:
        context = context + list(prompt)
        out = []
        while True:
            out.append(toy_next_token(context + out, CFG))
            if len(out) >= max_tokens or (stop and out[-1] in stop):
                break
        outputs.append(out)
        context = context + out[:-1]
    return outputs, context


class Collector:
    def __init__(self):
        self.items = []

    def __call__(self, item):
        self.items.append(item)

    def chunks(self):
        """Token ids per chunk: outputs grouped up to each finish_reason."""
        grouped, current = [], []
        for item in self.items:
            if item is END_OF_STREAM:
                continue
            current += item.outputs[0].token_ids
            if item.outputs[0].finish_reason:
                grouped.append(current)
                current = []
        return grouped


def run(core, limit=500):
    for _ in range(limit):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the scheduler did not go idle")


def add(core, rid, prompt, params, sink, *, first=False, resumable=True):
    core.add_chunk(rid, prompt, params, first=first, resumable=resumable, sink=sink)


def test_single_chunk_equals_plain_request(core):
    sink = Collector()
    add(core, "a", [3, 1, 4, 1, 5], greedy(20), sink, first=True, resumable=False)
    run(core)
    expected, _ = reference([([3, 1, 4, 1, 5], 20, None)])
    assert sink.chunks() == expected
    assert sink.items[-1].finished and sink.items[-1].outputs[0].finish_reason == "length"


def greedy_without(context, banned):
    """The toy model's greedy token with `banned` ids excluded: its logits fall with the circular distance to
    `toy_next_token`, and argmax takes the lowest id of a tie."""
    target, vocab = toy_next_token(context, CFG), CFG.vocab_size
    distance = [min(abs(v - target), vocab - abs(v - target)) for v in range(vocab)]
    return min((v for v in range(vocab) if v not in banned), key=lambda v: (distance[v], v))


def test_min_tokens_bans_stop_ids_until_then(core):
    """vLLM masks the stop ids (and EOS) to -inf before min_tokens outputs: they are never sampled there (the
    scheduler only skipped the stop check, so the stop id was still generated and streamed)."""
    prompt = [3, 1, 4, 1, 5]
    plain, _ = reference([(prompt, 6, None)])
    stop = [plain[0][0], plain[0][1]]
    expected = []
    while len(expected) < 12 and not (len(expected) >= 3 and expected[-1] in stop):
        expected.append(greedy_without(prompt + expected, stop if len(expected) < 3 else ()))
    assert not set(expected[:3]) & set(stop)
    sink = Collector()
    add(core, "a", prompt, greedy(12, stop, min_tokens=3), sink, first=True, resumable=False)
    run(core)
    assert sink.chunks() == [expected]


def test_cumulative_rule_keeps_computed_and_schedules_only_the_chunk(core):
    sink = Collector()
    add(core, "a", [1, 2, 3], greedy(2), sink, first=True)
    run(core)
    session = core.sessions["a"]
    first_outputs = sink.chunks()[0]
    assert session.status is Status.PARKED and session.num_computed == 4
    add(core, "a", [4, 5], greedy(1), sink)
    assert session.prompt_ids == [1, 2, 3, first_outputs[0], 4, 5]
    assert session.outputs == [] and session.num_computed == 4 and session.status is Status.WAITING
    core.step()
    [last] = core.tick_stats.window(core.ticks_recorded - 1, core.ticks_recorded)
    assert last.steps == 2  # only the chunk's two tokens are prefilled
    core.end_input("a")
    assert sink.items[-1] is END_OF_STREAM


def test_max_tokens_one_over_five_chunks_keeps_exactly_the_prompts(core):
    sink = Collector()
    prompts = [[7, 8], [9], [10, 11, 12], [13], [14, 15]]
    add(core, "a", prompts[0], greedy(1), sink, first=True)
    for prompt in prompts[1:]:
        add(core, "a", prompt, greedy(1), sink)
    run(core)
    session = core.sessions["a"]
    assert session.prompt_ids == sum(prompts, [])
    expected, _ = reference([(p, 1, None) for p in prompts])
    assert sink.chunks() == expected
    core.end_input("a")


def test_per_chunk_budget_and_fifo_chunks_never_coalesce(core):
    sink = Collector()
    chunks = [([5, 6, 7], 10, None), ([8], 4, None), ([9, 10], 3, None), ([11], 2, None)]
    add(core, "a", chunks[0][0], greedy(10), sink, first=True)
    core.step()  # chunk 1 is running when the others arrive
    for prompt, budget, _ in chunks[1:]:
        add(core, "a", prompt, greedy(budget), sink)
    core.end_input("a")
    run(core)
    expected, _ = reference(chunks)
    assert sink.chunks() == expected
    assert [len(c) for c in sink.chunks()] == [10, 4, 3, 2]  # the running chunk was not cut short
    # Each output reports the chunk prompts up to its own chunk, as they were then: later chunks do not
    # change what an earlier output holds.
    prompts_then, seen = [], []
    for item in (i for i in sink.items if i is not END_OF_STREAM):
        prompts_then.append(item.prompt_token_ids)
        if item.outputs[0].finish_reason:
            seen.append(prompts_then)
            prompts_then = []
    assert [{tuple(p) for p in group} for group in seen] == [
        {tuple(sum((c[0] for c in chunks[:k + 1]), []))} for k in range(len(chunks))]
    # ... and they share one list a chunk (a copy in every output cost O(prompt) a token).
    assert all(len({id(p) for p in group}) == 1 for group in seen)
    finals = [i for i in sink.items if i.outputs[0].finish_reason]
    assert [f.finished for f in finals] == [False, False, False, True]  # closed while busy: last is final


def test_chunk_for_parked_session_applies_at_once(core):
    sink = Collector()
    add(core, "a", [2, 7, 1], greedy(1), sink, first=True)
    run(core)
    assert core.num_parked == 1 and core.num_unfinished == 0
    add(core, "a", [8, 2], greedy(2), sink)
    session = core.sessions["a"]
    assert session.status is Status.WAITING and core.num_parked == 0 and core.num_unfinished == 1
    core.step()
    assert session.status is Status.RUNNING
    core.abort("a")
    assert sink.items[-1].outputs[0].finish_reason == "abort" and sink.items[-1].finished


def test_stop_id_ends_the_chunk_and_is_dropped_from_context(core):
    probe, _ = reference([([4, 4, 4], 3, None)])
    stop = probe[0][1]  # the chunk's second greedy token
    sink = Collector()
    add(core, "a", [4, 4, 4], greedy(10, stop=[stop]), sink, first=True)
    add(core, "a", [6], greedy(3), sink)
    run(core)
    expected, context = reference([([4, 4, 4], 10, [stop]), ([6], 3, None)])
    assert sink.chunks() == expected and expected[0][-1] == stop
    stopped = next(i for i in sink.items if i.outputs[0].finish_reason)
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason, stopped.finished) == ("stop", stop, False)
    session = core.sessions["a"]
    assert session.prompt_ids + session.outputs[:-1] == context  # the stop token has no place in the context
    core.end_input("a")


def test_previous_chunk_unaffected_by_when_the_next_arrives(core):
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=5, logprobs=1)
    results = []
    for early in (True, False):
        sink = Collector()
        add(core, "a", [1, 5, 9], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1), sink, first=True)
        if early:
            add(core, "a", [3], sampled, sink)
        run(core)
        if not early:
            add(core, "a", [3], sampled, sink)
            run(core)
        core.end_input("a")
        results.append([(i.outputs[0].token_ids, i.outputs[0].logprobs) for i in sink.items if i is not END_OF_STREAM])
    assert results[0] == results[1]
    greedy_part, _ = reference([([1, 5, 9], 4, None)])
    assert [t for ids, _ in results[0][:4] for t in ids] == greedy_part[0]


def test_reaching_max_model_len_ends_the_session(core):
    sink = Collector()
    core.max_model_len, saved = 10, core.max_model_len
    try:
        add(core, "a", [1, 2, 3, 4, 5, 6], greedy(50), sink, first=True)
        run(core)
    finally:
        core.max_model_len = saved
    assert sink.items[-1].finished and sink.items[-1].outputs[0].finish_reason == "length"
    assert sum(len(i.outputs[0].token_ids) for i in sink.items) == 4
    add(core, "a", [1], greedy(1), sink)  # a late chunk does not revive the ended session
    assert "a" not in core.sessions


def test_any_of_several_eos_ids_ends_the_chunk(core):
    """Llama 3 declares several EOS ids: any of them is a stop (finish_reason "stop"; no stop_reason here, where
    none is secondary: test_engine_text_model.py checks vLLM's stop_reason for the secondary ones)."""
    probe, _ = reference([([9, 8, 7], 5, None)])
    saved, core.eos_token_ids = core.eos_token_ids, frozenset({CFG.vocab_size + 1, probe[0][2]})
    sink = Collector()
    try:
        add(core, "a", [9, 8, 7], greedy(5), sink, first=True, resumable=False)
        run(core)
    finally:
        core.eos_token_ids = saved
    assert sink.chunks() == [probe[0][:3]] and probe[0][2] not in probe[0][:2]
    assert (sink.items[-1].outputs[0].finish_reason, sink.items[-1].outputs[0].stop_reason) == ("stop", None)


def test_preempted_session_recomputes_to_the_same_tokens(core):
    """Only one session's window fits: the later one is preempted (pages freed, KV recomputed)."""
    pool = core.cache.pools["text"]
    held = pool.allocate(pool.num_free - 6)  # 6 free pages; a full window is 4
    try:
        sinks = {rid: Collector() for rid in "ab"}
        for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10])):
            add(core, rid, prompt, greedy(20), sinks[rid], first=True, resumable=False)
        preempted = core.preemptions
        run(core)
        assert core.preemptions > preempted
    finally:
        pool.release(held)
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10])):
        assert sinks[rid].chunks() == reference([(prompt, 20, None)])[0]


@pytest.mark.parametrize("host_bytes", [1 << 30, 0], ids=["offload", "recompute"])
def test_lru_parked_session_evicted_for_a_new_request(core, host_bytes):
    """max_sessions=2 with two parked sessions: the least recently active one leaves the device, the new
    request runs, and the evicted session resumes with identical tokens (from host memory or recomputed)."""
    held = [core.cache.take_slot(), core.cache.take_slot()]  # 2 of 4 slots left
    core.host_offload_bytes = host_bytes
    try:
        sinks = {rid: Collector() for rid in "abc"}
        add(core, "a", [1, 2, 3], greedy(3), sinks["a"], first=True)
        run(core)
        add(core, "b", [4, 5, 6], greedy(3), sinks["b"], first=True)
        run(core)
        assert core.num_parked == 2
        add(core, "c", [7, 8], greedy(3), sinks["c"], first=True, resumable=False)
        run(core)
        assert not core.sessions["a"].resident and core.sessions["b"].resident
        assert (core.sessions["a"].offloaded is not None) == (host_bytes > 0)
        add(core, "a", [9], greedy(5), sinks["a"])
        run(core)
        assert core.sessions["a"].resident
        for rid in "ab":
            core.end_input(rid)
    finally:
        for slot in held:
            core.cache.release_slot(slot)
        core.host_offload_bytes = 8 << 30
    assert sinks["a"].chunks() == reference([([1, 2, 3], 3, None), ([9], 5, None)])[0]
    assert sinks["c"].chunks() == reference([([7, 8], 3, None)])[0]


def test_a_failed_restore_gives_back_its_pages_and_slot(core, monkeypatch):
    """The program that brings an evicted session back raises (the device out of memory): the tick's error
    ends the sessions as AsyncEngine does, and nothing stays held (the restore's pages and slot used to
    stay taken for good)."""
    held = [core.cache.take_slot(), core.cache.take_slot()]  # 2 of 4 slots left
    try:
        add(core, "a", [1, 2, 3], greedy(3), Collector(), first=True)
        run(core)
        add(core, "b", [4, 5, 6], greedy(3), Collector(), first=True)
        run(core)
        add(core, "c", [7, 8], greedy(3), Collector(), first=True)
        run(core)
        assert core.sessions["a"].offloaded is not None  # moved to host memory for c

        def restore_fails(*args):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

        monkeypatch.setattr(core.cache, "_restore", restore_fails)
        add(core, "a", [9], greedy(3), Collector())
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            run(core)
        monkeypatch.undo()
        for session in list(core.sessions.values()):
            core.fail(session, RuntimeError("engine tick failed"))
    finally:
        for slot in held:
            core.cache.release_slot(slot)
    assert core.cache.num_free_slots == 4 and core.at_baseline()


def test_bad_chunk_fails_only_its_session(core):
    good, bad = Collector(), Collector()
    add(core, "good", [1, 2], greedy(6), good, first=True, resumable=False)
    add(core, "bad", [1, 2], greedy(6), bad, first=True)
    core.step()
    add(core, "bad", [CFG.vocab_size + 5], greedy(2), bad)  # out of vocabulary
    run(core)
    assert isinstance(bad.items[-1], ValueError) and "bad" not in core.sessions
    assert good.chunks() == reference([([1, 2], 6, None)])[0]


def test_detokenizer_failure_is_isolated(core):
    class Exploding:
        def push_many(self, tokens):
            raise RuntimeError("boom")

    good, bad = Collector(), Collector()
    add(core, "good", [3, 3], greedy(5), good, first=True, resumable=False)
    add(core, "bad", [3, 3], greedy(5), bad, first=True, resumable=False)
    core.sessions["bad"].detokenizer = Exploding()
    run(core)
    assert isinstance(bad.items[-1], RuntimeError)
    assert good.chunks() == reference([([3, 3], 5, None)])[0]


def test_serving_never_compiles(core):
    """Every shape the scheduler dispatches was compiled at start-up (offload/restore included)."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    held = [core.cache.take_slot(), core.cache.take_slot()]
    try:
        rng = np.random.default_rng(0)
        sinks = {}
        for i in range(6):
            rid = f"r{i}"
            sinks[rid] = Collector()
            prompt = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 30))).tolist()
            add(core, rid, prompt, SamplingParams(temperature=float(i % 2), seed=i, max_tokens=int(rng.integers(1, 9))),
                sinks[rid], first=True)
            for _ in range(3):
                core.step()
        run(core)
        evicted = core.evictions
        for rid in sinks:  # the evicted ones come back through restore
            add(core, rid, [1, 2], greedy(2), sinks[rid])
            run(core)
            core.end_input(rid)
        assert core.evictions > evicted
        assert compiles == []
        jax.jit(lambda x: x * 3 + 1)(np.float32(2))  # proves the listener sees compiles
        assert len(compiles) == 1
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        for slot in held:
            core.cache.release_slot(slot)


# -- EngineConfig validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1, got 0"),
    (dict(max_sessions=0), "max_sessions must be an integer >= 1"),
    (dict(max_sessions=2.0), "max_sessions must be an integer >= 1"),
    (dict(page_size=True), "page_size must be an integer >= 1"),
    (dict(encoder_page_size=0), "encoder_page_size must be an integer >= 1"),
    (dict(num_pages=1), "num_pages must be an integer >= 2"),
    (dict(encoder_num_pages=0), "encoder_num_pages must be an integer >= 2"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1"),
    (dict(host_offload_bytes=-1), "host_offload_bytes must be an integer >= 0"),
    (dict(seed=0.5), "seed must be an integer"),
    (dict(kv_memory_fraction=0.0), r"kv_memory_fraction must be a number in \(0, 1\]"),
    (dict(kv_memory_fraction=1.2), r"kv_memory_fraction must be a number in \(0, 1\]"),
    (dict(kv_memory_fraction=float("nan")), r"kv_memory_fraction must be a number in \(0, 1\]"),
    (dict(max_queued_audio_seconds=0), "max_queued_audio_seconds must be a finite number > 0"),
    (dict(max_queued_audio_seconds=float("inf")), "max_queued_audio_seconds must be a finite number > 0"),
    (dict(planned_stream_seconds=0), "planned_stream_seconds must be a finite number > 0 or None"),
    (dict(planned_stream_seconds="60"), "planned_stream_seconds must be a finite number > 0 or None"),
    (dict(batch_buckets=()), "batch_buckets must be a non-empty sequence of ints >= 1"),
    (dict(batch_buckets=(4, 0)), "batch_buckets must be a non-empty sequence of ints >= 1"),
    (dict(prefill_buckets=()), "prefill_buckets must be a non-empty sequence of"),
    (dict(prefill_buckets=((2, 0),)), "prefill_buckets must be a non-empty sequence of"),
    (dict(prefill_buckets=((2, 8, 1),)), "prefill_buckets must be a non-empty sequence of"),
    (dict(prefill_buckets=(8,)), "prefill_buckets must be a non-empty sequence of"),
    (dict(realtime_step_buckets=(1, -4)), "realtime_step_buckets must be a non-empty sequence of ints >= 1"),
    (dict(realtime_prefill_buckets=((1, 0.5),)), "realtime_prefill_buckets must be a non-empty sequence of"),
    (dict(default_delay_ms=100), "default_delay_ms: delay_ms must be a multiple of 80"),
    (dict(dtype="int8"), "dtype must be a floating-point dtype name"),
    (dict(dtype="float33"), "dtype must be a floating-point dtype name"),
    (dict(attention_impl="cuda"), "attention_impl must be one of xla, cpu, pallas, pallas_tpu or None"),
    (dict(compat="sglang"), "compat must be 'vllm' or 'strict'"),
    (dict(realtime_admission="greedy"), "realtime_admission must be 'window' or 'demand'"),
    (dict(tp_axis=None), "tp_axis must be a mesh axis name"),
    (dict(mesh="4 devices"), "mesh must be a jax.sharding.Mesh with a 'tp' axis"),
])
def test_invalid_engine_config_raises(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_buckets_become_tuples():
    config = EngineConfig(batch_buckets=[1, 4], prefill_buckets=[[2, 8]], realtime_step_buckets=[1, 4])
    assert (config.batch_buckets, config.prefill_buckets, config.realtime_step_buckets) == ((1, 4), ((2, 8),), (1, 4))
    hash(config)


def test_a_one_token_budget_still_serves_every_session():
    """Decode rows cost one token and prefills split into budget-sized pieces: below the decode bucket
    and the prefill chunk, every session still advances to the same tokens, one token per tick."""
    config = EngineConfig(max_sessions=4, page_size=4, batch_buckets=(4,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=1)
    small = build_text_core(ToyLM(CFG), config)
    prompts = {"a": list(range(1, 12)), "b": [5, 4, 3], "c": [60] * 9}
    sinks = {rid: Collector() for rid in prompts}
    for rid, prompt in prompts.items():
        add(small, rid, prompt, greedy(4), sinks[rid], first=True, resumable=False)
    ticks = 0
    while small.has_work():
        assert small.step()
        ticks += 1
    assert ticks == sum(len(prompt) + 4 - 1 for prompt in prompts.values())  # one token each
    for rid, prompt in prompts.items():
        assert sinks[rid].chunks() == reference([(prompt, 4, None)])[0]
    assert small.at_baseline()


def test_tick_log_keeps_the_last_ticks_in_order_as_it_wraps():
    """The preallocated tick log against a bounded deque of the same ticks."""
    import collections

    log, oracle = TickLog(capacity=5), collections.deque(maxlen=5)
    for number in range(13):
        stats = TickStats(number, 2 * number, number / 10, number / 100, None if number % 3 else number / 1000,
                          None if number % 2 else number / 2000)
        log.append(stats)
        oracle.append(stats)
        assert len(log) == len(oracle) and log.recorded == number + 1
        assert log.window(0, number + 1) == list(oracle)
        assert log.window(number, number + 1) == [stats]
        assert log.window(number - 1, number + 1) == list(oracle)[-2:]
        assert log.durations(number - 3, number + 1) == tuple(t.total_s for t in list(oracle)[-4:])
    assert log.window(0, 8) == []  # ticks overwritten since are not held
    assert log.window(13, 20) == [] and log.durations(13, 20) == ()  # nor ticks not recorded yet


def test_a_ticks_host_cpu_counts_the_engine_threads_work_since_the_previous_tick(core):
    """The engine thread's CPU outside ticks (commands: one append per stream per 80 ms, the audio they
    store, the outputs handed over) is host work of the tick that follows; `jaxstream bench` reported the
    tick alone, about half of it at 256 streams."""
    core.off_tick_cpu_s = 0.004
    core.record_tick(TickStats(1, 1, 0.010, 0.002, 0.003))
    core.record_tick(TickStats(1, 1, 0.010, 0.002, 0.003))
    first, second = core.tick_stats.window(core.ticks_recorded - 2, core.ticks_recorded)
    assert first.host_cpu_s == pytest.approx(0.007) and second.host_cpu_s == pytest.approx(0.003)
    assert core.off_tick_cpu_s == 0.0


def test_default_pools_fit_the_hosts_memory_on_a_cpu():
    """A CPU device reports no memory limit: default pools are fitted to the host's available memory
    (4,096 full windows of Voxtral 4B's decoder would be ~3.6 TB), keeping at least one window."""
    import jax.numpy as jnp

    from jaxstream.engine import builders, kv_cache, sharding

    cfg = EngineConfig(max_sessions=4096, dtype="bfloat16")
    spec = kv_cache.stack_spec("decoder", num_layers=26, num_kv_heads=8, head_dim=128, page_size=64, ring=8192,
                               num_pages=None, max_sessions=cfg.max_sessions)
    placement = sharding.Placement(None, "tp")
    free = builders._free_device_bytes(placement)
    if free is None:
        pytest.skip("this host reports no available memory (not Linux)")
    [fitted] = builders.fit_pools([spec], cfg, placement)
    assert fitted.pages_per_window <= fitted.num_pages - 1 < spec.num_pages - 1
    assert (fitted.num_pages - 1) * fitted.bytes_per_page(jnp.bfloat16) <= max(
        cfg.kv_memory_fraction * free, fitted.pages_per_window * fitted.bytes_per_page(jnp.bfloat16))


def _voxtral_4b_specs(max_sessions: int):
    from jaxstream.engine import kv_cache

    return [kv_cache.stack_spec("decoder", num_layers=26, num_kv_heads=8, head_dim=128, page_size=64, ring=8192,
                                num_pages=None, max_sessions=max_sessions),
            kv_cache.stack_spec("encoder", num_layers=32, num_kv_heads=32, head_dim=64, page_size=64, ring=750,
                                num_pages=None, max_sessions=max_sessions)]


def _planned_pages(specs, seconds: float) -> dict[str, int]:
    """The pages of each of `specs` that a stream of `seconds` at Voxtral's default delay holds."""
    from jaxstream.engine.realtime_admission import stream_pages
    from jaxstream.models.audio import DEFAULT_DELAY_MS, n_delay_from_ms, stream_slot_bound

    return stream_pages({spec.name: spec for spec in specs}, stream_slot_bound(seconds, n_delay_from_ms(
        DEFAULT_DELAY_MS)), downsample_factor=4)


def test_demand_admission_keeps_the_smaller_pools_whole_and_scales_the_largest(monkeypatch):
    """Voxtral 4B's pools for 128 streams in 120 GB (bf16: 1.07 GB of full windows each, 137 GB in all):
    window admission scales both pools alike; demand admission, planned for 5-minute streams (which fill the
    encoder window), keeps the encoder pool whole and gives the decoder pool the rest of the budget."""
    import jax.numpy as jnp

    from jaxstream.engine import builders, kv_cache, sharding, steps

    free = 120e9
    monkeypatch.setattr(builders, "_free_device_bytes", lambda placement: free)
    specs = _voxtral_4b_specs(128)
    placement = sharding.Placement(None, "tp")
    fitted = {}
    for admission in ("window", "demand"):
        cfg = EngineConfig(max_sessions=128, dtype="bfloat16", realtime_admission=admission)
        fitted[admission] = {spec.name: spec for spec in builders.fit_pools(
            specs, cfg, placement, stream_pages=_planned_pages(specs, cfg.planned_stream_seconds))}
    page_bytes = {spec.name: spec.bytes_per_page(jnp.bfloat16) for spec in specs}
    full = {spec.name: spec.num_pages for spec in specs}
    budget = EngineConfig().kv_memory_fraction * free
    window, demand = fitted["window"], fitted["demand"]
    shares = [(window[name].num_pages - 1) / (full[name] - 1) for name in full]
    assert max(shares) < 0.8 and shares[0] == pytest.approx(shares[1], abs=0.01)
    assert demand["encoder"].num_pages == full["encoder"]
    used = sum((demand[name].num_pages - 1) * page_bytes[name] for name in full)
    assert budget - page_bytes["decoder"] < used <= budget
    # Memory other state takes (a text engine's penalty counts) comes off the budget first.
    reserved = 10e9
    cfg = EngineConfig(max_sessions=128, dtype="bfloat16", realtime_admission="window")
    less = builders.fit_pools(specs, cfg, placement, reserved_bytes=reserved)
    used = sum((spec.num_pages - 1) * page_bytes[spec.name] for spec in less)
    assert budget - reserved - sum(page_bytes.values()) < used <= budget - reserved
    # A slot's counts, their chunk start and its structured-output bitmask (one bit an id).
    assert kv_cache.slot_row_bytes(steps.text_slot_shapes(131072)) == (131072 + 1 + 2 * 131072 // 32) * 4


@pytest.mark.parametrize("seconds", [10.0, 60.0, 300.0])
def test_demand_admission_plans_the_pools_for_streams_of_the_planned_length(monkeypatch, seconds):
    """Voxtral 4B in bfloat16 on a 16 GB chip (~6 GB of KV: neither pool fits 64 sessions' windows). Scaled
    alike, the pools hold 5 streams of 10 s (the encoder pool, 0.18 of the memory, runs out first). Planned for
    streams of `seconds`, both pools hold as many such streams as the memory does, and what is left goes to the decoder pool, where a longer stream still grows."""
    import jax.numpy as jnp

    from jaxstream.engine import builders, sharding

    free = 6.5e9
    monkeypatch.setattr(builders, "_free_device_bytes", lambda placement: free)
    specs = _voxtral_4b_specs(64)
    placement = sharding.Placement(None, "tp")
    cfg = EngineConfig(dtype="bfloat16", planned_stream_seconds=seconds)
    planned = _planned_pages(specs, seconds)
    fitted = {spec.name: spec for spec in builders.fit_pools(specs, cfg, placement, stream_pages=planned)}
    alike = {spec.name: spec for spec in builders.fit_pools(specs, cfg, placement)}
    page_bytes = {spec.name: spec.bytes_per_page(jnp.bfloat16) for spec in specs}
    budget = cfg.kv_memory_fraction * free

    def streams(pools, pages):
        return min((pools[name].num_pages - 1) // pages[name] for name in pages)

    used = sum((fitted[name].num_pages - 1) * page_bytes[name] for name in fitted)
    assert budget - page_bytes["decoder"] < used <= budget
    # As many as fit beside one whole window of each pool (a single stream may fill its windows).
    assert streams(fitted, planned) == max(n for n in range(1, 65) if sum(
        max(n * planned[spec.name], spec.pages_per_window) * page_bytes[spec.name] for spec in specs) <= budget)
    # A stream past 15 s fills its encoder window: a longer one grows in the decoder pool alone.
    if seconds > 15:
        assert fitted["encoder"].num_pages - 1 == streams(fitted, planned) * planned["encoder"]
    assert fitted["decoder"].num_pages - 1 > streams(fitted, planned) * planned["decoder"]
    assert streams(alike, _planned_pages(specs, 10.0)) == 5
    assert streams(fitted, planned) >= 1.5 * streams(alike, planned)
