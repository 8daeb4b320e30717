"""Automatic prefix caching of text LMs (engine/text_prefix_cache.py) on the tiny Llama (full attention), pages of 4
positions. The oracle is the same engine with `enable_prefix_caching=False` run on the same requests (and
transformers' greedy output where the committed fixture gives it): tokens equal and logprobs within float32
rounding, while the cached engine computes fewer positions, exactly as many fewer as its hit count says."""
import asyncio
import dataclasses
import hashlib
import logging

import jax
import numpy as np
import pytest
from prometheus_client import generate_latest

from jaxstream.cli import main
from jaxstream.commands import serve
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.builders import build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.kv_cache import StackSpec
from jaxstream.engine.parallel_sampling import child_ids, child_params
from jaxstream.engine.requests import SamplingParams
from jaxstream.engine.residency import END_OF_STREAM
from jaxstream.engine.text_prefix_cache import CachingPagePool, supported
from jaxstream.errors import InvalidRequestError
from jaxstream.serving.metrics import ServerMetrics
from test_engine_scheduler import leave_at_baseline
from test_engine_text_model import LLAMA, tiny_lm

# 32 usable pages of 4 positions: a few sessions fill the pool. max_model_len 96 keeps one window within it.
CFG = EngineConfig(max_sessions=4, page_size=4, num_pages=33, max_model_len=96, batch_buckets=(4,),
                   prefill_buckets=((2, 8),), max_num_batched_tokens=64)
PAGE = CFG.page_size


@pytest.fixture(scope="module")
def cached():
    return build_text_core(tiny_lm(LLAMA), CFG)


@pytest.fixture(scope="module")
def plain():
    return build_text_core(tiny_lm(LLAMA), dataclasses.replace(CFG, enable_prefix_caching=False))


@pytest.fixture(autouse=True)
def back_to_baseline(request):
    """Each test leaves both engines at their baseline (cached pages nobody holds count as free)."""
    yield
    for name in ("cached", "plain"):
        if name in request.fixturenames:
            leave_at_baseline(request.getfixturevalue(name))


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, **kw)


def prompt_of(seed, length):
    return np.random.default_rng(seed).integers(3, 256, length).tolist()


class Run:
    """Requests added to one core and run to the end: each request's tokens and logprobs per chunk, and what the
    run cost (positions computed, prefix-cache tokens hit)."""

    def __init__(self, core):
        self.core, self.items = core, {}
        self._computed, self._hits = self.computed(), core.prefix_cache_counts[1]

    def computed(self) -> int:
        return sum(stats.steps for stats in self.core.tick_stats.window(0, self.core.ticks_recorded))

    def add(self, request_id, prompt, params, *, first=True, resumable=False):
        self.items.setdefault(request_id, [])
        self.core.add_chunk(request_id, prompt, params, first=first, resumable=resumable,
                            sink=self.items[request_id].append)
        return self

    def run(self):
        while self.core.has_work():
            self.core.step()
        return self

    def chunks(self, request_id):
        """[(tokens, logprobs)] per chunk."""
        chunks, current = [], ([], [])
        for item in self.items[request_id]:
            if item is END_OF_STREAM:
                continue
            assert not isinstance(item, Exception), item
            current[0].extend(item.outputs[0].token_ids)
            current[1].extend(item.outputs[0].logprobs)
            if item.outputs[0].finish_reason:
                chunks.append(current)
                current = ([], [])
        return chunks

    @property
    def cost(self) -> tuple[int, int]:
        """(positions computed, prefix-cache hits) since the run started."""
        return self.computed() - self._computed, self.core.prefix_cache_counts[1] - self._hits


def assert_same(run, oracle, request_ids):
    for request_id in request_ids:
        ours, theirs = run.chunks(request_id), oracle.chunks(request_id)
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs], request_id
        np.testing.assert_allclose(np.concatenate([lps for _, lps in ours]),
                                   np.concatenate([lps for _, lps in theirs]), atol=2e-5)


def both(cached, plain, requests, *, exact=True):
    """Runs `requests` [(request id, prompt, params)] added together on both engines; returns both runs, checked
    alike, and (`exact`: when neither preempts) that the cached one computed as many fewer positions as it hit."""
    runs = []
    for core in (cached, plain):
        run = Run(core)
        for request in requests:
            run.add(*request)
        runs.append(run.run())
    assert_same(*runs, [request_id for request_id, *_ in requests])
    assert runs[1].cost[1] == 0
    if exact:
        assert runs[1].cost[0] - runs[0].cost[0] == runs[0].cost[1]
    return runs


# -- the pool ---------------------------------------------------------------------------------------------------

def test_pool_counts_references_and_evicts_unheld_cached_pages_last_block_first():
    pool = CachingPagePool(9)  # 8 pages
    session = pool.allocate(4)
    for block, page in enumerate(session[:3]):
        pool.register(int(page), (block, b"k"))
    assert pool.matched([(0, b"k"), (1, b"k"), (9, b"x")]) == session[:2].tolist()
    pool.share(session[:3].tolist())  # a second session's hit holds the first three
    pool.release(session)
    assert (pool.num_free, pool.num_cached) == (5, 3)  # the uncached fourth page is free at once
    pool.release(session[:3])
    assert pool.num_free == pool.capacity == 8  # unheld cached pages count as free
    assert [pool.references(int(p)) for p in session] == [0, 0, 0, 0]
    fresh = pool.allocate(5)  # never-cached pages come first: nothing evicted
    assert pool.num_cached == 3 and not set(fresh.tolist()) & set(session[:3].tolist())
    assert pool.allocate(1).tolist() == [session[2]]  # then the last block of the freed session
    assert pool.matched([(0, b"k"), (1, b"k"), (2, b"k")]) == session[:2].tolist()
    pool.drop()
    assert pool.num_cached == 0 and pool.matched([(0, b"k")]) == [] and pool.num_free == 2


def test_a_deferred_session_walks_on_from_the_blocks_it_found_cached():
    """`waits_for` runs every tick for every deferred session: it looked each block of the prefix up again each time
    (38 ms a tick for 100 sessions behind a 4,096-block prompt); now a tick looks up the blocks past the last ones
    it found, and an eviction since only makes its guess worse, never a hit (`lookup` walks from the first)."""
    from jaxstream.engine.text_prefix_cache import TextPrefixCache

    blocks, size = 64, 2
    pool = CachingPagePool(blocks + 2)
    cache = TextPrefixCache(pool, "text", size)
    tokens = list(range(blocks * size + 1))
    session = dataclasses.make_dataclass("Waiting", ["block_keys", "cached_blocks", "probed_blocks", "num_tokens"])(
        [], 0, 0, len(tokens))
    session.tokens = lambda start, stop: tokens[start:stop]
    keys = cache._keys(session, blocks)  # noqa: SLF001
    # A key is the SHA-256 chain of its prefix's blocks (Python's hash, the first keys, is steerable wherever
    # PYTHONHASHSEED is fixed: two prefixes could then share KV).
    parent = b""
    for block, key in enumerate(keys):
        row = np.asarray(tokens[block * size:(block + 1) * size], np.int32)
        parent = hashlib.sha256(parent + row.tobytes()).digest()
        assert key == parent
    for block, page in enumerate(pool.allocate(blocks - 1)):  # all but the last block cached
        pool.register(int(page), keys[block])
    looked_up = []
    is_cached = pool.is_cached
    pool.is_cached = lambda key: looked_up.append(key) or is_cached(key)
    assert cache.waits_for(session, {keys[-1]}) and len(looked_up) == blocks
    looked_up.clear()
    assert cache.waits_for(session, {keys[-1]}) and len(looked_up) == 1  # the next tick: the missing block only
    assert not cache.waits_for(session, set())


def test_caching_is_off_where_a_session_would_wrap_onto_its_pages(plain):
    assert supported(StackSpec("text", 1, 1, 8, page_size=4, ring=96, num_pages=33), max_model_len=96)
    assert not supported(StackSpec("text", 1, 1, 8, page_size=4, ring=8, num_pages=33), max_model_len=96)
    assert plain.prefix is None
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching must be true or false"):
        EngineConfig(enable_prefix_caching="yes")


# -- hits ---------------------------------------------------------------------------------------------------------

def test_a_repeated_prompt_equals_transformers_and_hits_whole_blocks_before_its_last_token(cached):
    reference = dict(np.load(LLAMA.parent / "llama_tiny_reference.npz"))
    prompt = reference["prompt_ids"][0].tolist()  # 5 tokens: one whole block before the last
    expected = reference["generate"][0, len(prompt):].tolist()
    costs = []
    for request_id in ("first", "again"):
        run = Run(cached).add(request_id, prompt, greedy(len(expected))).run()
        assert run.chunks(request_id)[0][0] == expected
        costs.append(run.cost)
    assert costs == [(len(prompt) + len(expected) - 1, 0), (len(prompt) + len(expected) - 1 - PAGE, PAGE)]
    # A whole cached prompt is not a whole hit: its last token is computed to sample after it.
    for length, hit in ((8, 4), (9, 8)):
        prompt = prompt_of(length, length)
        Run(cached).add("a", prompt, greedy(2)).run()
        assert Run(cached).add("b", prompt, greedy(2)).run().cost[1] == hit


def test_a_shared_prefix_of_a_finished_request(cached, plain):
    system = prompt_of(1, 10)
    cached_run, _ = both(cached, plain, [("a", system + [5, 6], greedy(6))])
    cached_run, _ = both(cached, plain, [("b", system + [7, 8, 9], greedy(6))])
    assert cached_run.cost[1] == 8  # the system prompt's two whole blocks


def test_a_running_session_shares_its_live_pages(cached, plain):
    system = prompt_of(2, 13)
    oracle = Run(plain).add("a", system + [4], greedy(12)).add("b", system + [9, 9], greedy(12)).run()
    run = Run(cached).add("a", system + [4], greedy(12))
    while not run.items["a"]:
        cached.step()  # until "a" samples: its prompt is computed
    run.add("b", system + [9, 9], greedy(12))
    cached.step()
    a, b = (cached.sessions[rid].pages["text"].table for rid in "ab")
    assert (b[:3] == a[:3]).all() and all(cached.prefix.pool.references(int(page)) == 2 for page in a[:3])
    run.run()
    assert_same(run, oracle, "ab")
    assert run.cost[1] == 12


def test_n_children_take_the_prompt_the_first_one_computes(cached, plain):
    """Children admitted together wait for the first one's prefill of their prompt, then hit all of it."""
    prompt = prompt_of(3, 18)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=5, logprobs=0)
    run, _ = both(cached, plain, [(child, prompt, child_params(params, i))
                                  for i, child in enumerate(child_ids("n", params.n))])
    assert run.cost[1] == 3 * 16  # (18 - 1) // 4 whole blocks for each child but the first


def test_n_through_generate_counts_on_the_metrics_endpoint(plain):
    prompt = prompt_of(4, 14)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, logprobs=0)
    oracle = Run(plain)
    for i, child in enumerate(child_ids("n", params.n)):
        oracle.add(child, prompt, child_params(params, i))
    oracle.run()

    async def generate(engine):
        tokens = {}
        async for out in engine.generate(prompt, params, request_id="n"):
            for completion in out.outputs:
                tokens.setdefault(completion.index, []).extend(completion.token_ids)
        await engine.wait_until_idle()
        return tokens

    engine = AsyncEngine(tiny_lm(LLAMA), config=CFG)
    try:
        tokens = asyncio.run(generate(engine))
        assert engine.core.at_baseline()
        metrics = ServerMetrics()
        metrics.attach_engine(engine)
        text = generate_latest(metrics.registry).decode()
    finally:
        engine.close()
    assert tokens == {i: oracle.chunks(child)[0][0] for i, child in enumerate(child_ids("n", params.n))}
    assert "jaxstream_prefix_cache_hits_total 24.0" in text  # (14 - 1) // 4 blocks, for two children
    assert "jaxstream_prefix_cache_queries_total 42.0" in text  # every child's prompt


def test_a_streaming_sessions_later_chunks_are_cached_outputs_included(cached, plain):
    chunks = [(prompt_of(5, 6), 3), (prompt_of(6, 5), 4), (prompt_of(7, 3), 2)]
    runs = []
    for core in (cached, plain):
        run = Run(core)
        for i, (prompt, budget) in enumerate(chunks):
            run.add("s", prompt, greedy(budget), first=i == 0, resumable=True).run()
        runs.append(run)
    assert_same(*runs, ["s"])
    # The context the session computed: every chunk's prompt and outputs but the last of each.
    context = [t for (prompt, _), (tokens, _) in zip(chunks, runs[0].chunks("s")) for t in prompt + tokens[:-1]]
    for core in (cached, plain):
        core.end_input("s")
    run, _ = both(cached, plain, [("follow", context + [3], greedy(3))])
    assert run.cost[1] == len(context) // PAGE * PAGE


# -- pages lost and found -----------------------------------------------------------------------------------------

def test_preempted_sessions_recompute_from_the_cache(cached, plain):
    requests = [(f"p{i}", prompt_of(10 + i, 20), greedy(40)) for i in range(3)]  # 3 x 15 pages > 32
    before = cached.preemptions, plain.preemptions
    run, _ = both(cached, plain, requests, exact=False)
    assert cached.preemptions > before[0] and plain.preemptions > before[1]
    assert run.cost[1] > 0  # the recomputes took their own blocks back


@pytest.mark.parametrize("host_bytes", [8 << 30, 0], ids=["offload", "drop"])
def test_a_parked_session_evicted_for_a_slot_resumes_alike(cached, plain, host_bytes):
    """A parked session that shares pages with a finished one leaves the device for a new session's slot: to host
    memory (restored into pages of its own) or dropping its KV (recomputed from the cache)."""
    seed = 20 if host_bytes else 120  # prompts of their own: the other case cached its own
    system = prompt_of(seed, 12)
    runs = []
    for core in (cached, plain):
        core.host_offload_bytes = host_bytes
        try:
            run = Run(core).add("warm", system + [1], greedy(2)).run()
            run.add("s", system + [2, 3], greedy(3), resumable=True).run()
            for i in range(4):  # every slot
                run.add(f"o{i}", prompt_of(seed + 10 + i, 5), greedy(8))
            run.run()
            assert not core.sessions["s"].resident
            assert (core.sessions["s"].offloaded is not None) == (host_bytes > 0)
            run.add("s", [7, 8], greedy(4), first=False, resumable=True).run()
            core.end_input("s")
        finally:
            core.host_offload_bytes = 8 << 30
        runs.append(run)
    assert_same(*runs, ["s", *(f"o{i}" for i in range(4))])
    # "s" took the system prompt's 3 blocks from "warm"; dropped, its recompute takes back 4 blocks of its own.
    assert runs[0].cost[1] == (12 if host_bytes else 12 + 16)


def test_cached_pages_evicted_by_allocation_pressure_are_never_served(cached, plain):
    """Pages taken for other data lose their blocks' keys, the freed request's last blocks first: a repeat finds its
    leading blocks and computes the rest, whose old pages other sessions have since rewritten."""
    pool = cached.prefix.pool
    pool.drop()  # only this test's request is cached: the LRU order is its own
    prompt = prompt_of(40, 13)  # 13 + 4 outputs: 16 positions computed, 4 whole blocks cached
    Run(cached).add("p", prompt, greedy(4)).run()
    held = pool.allocate(pool.num_free - 2)  # two more pages than were never cached
    pool.release(held)
    assert pool.num_cached == 2
    both(cached, plain, [("other", prompt_of(41, 25), greedy(4))])  # rewrites the pages just freed
    run, _ = both(cached, plain, [("again", prompt, greedy(4))])
    assert run.cost[1] == 2 * PAGE
    pool.release(held := pool.allocate(pool.num_free))
    assert pool.num_cached == 0
    run, _ = both(cached, plain, [("once more", prompt, greedy(4))])
    assert run.cost[1] == 0


def test_a_dispatch_that_consumed_the_device_state_drops_the_cache(cached, plain, monkeypatch):
    prompt = prompt_of(80, 13)
    Run(cached).add("a", prompt, greedy(4)).run()
    assert cached.prefix.pool.num_cached > 0
    run_program = cached.programs.run

    def consuming(key, batch):
        monkeypatch.setattr(cached.programs, "run", run_program)
        for leaf in jax.tree_util.tree_leaves(cached.cache.state):
            leaf.delete()
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(cached.programs, "run", consuming)
    failed = Run(cached).add("b", prompt_of(81, 6), greedy(2)).run()
    assert isinstance(failed.items["b"][-1], RuntimeError)
    assert cached.prefix.pool.num_cached == 0
    run, _ = both(cached, plain, [("c", prompt, greedy(4))])  # the zeroed pages are not served
    assert run.cost[1] == 0


def test_penalty_chunks_count_the_prefix_they_take_from_the_cache(cached, plain):
    """The penalty counts come from the tokens a step feeds: a session that took its prefix from the cache computes
    it after all when a later chunk uses a penalty; a penalty chunk that hits gets the prefix's counts written into
    its slot (it looked nothing up, so Qwen2.5's default repetition_penalty 1.05 missed the cache every time)."""
    system = prompt_of(90, 16)
    both(cached, plain, [("warm", system + [3], greedy(2))])
    both(cached, plain, [("other", prompt_of(91, 16), greedy(2))])  # the slot "s" takes next: its counts are other's
    penalized = greedy(6, repetition_penalty=2.0, presence_penalty=1.5)
    runs = []
    for core in (cached, plain):
        run = Run(core).add("s", system + [4], greedy(3), resumable=True).run()
        run.add("s", system[:6], penalized, first=False, resumable=True).run()
        core.end_input("s")
        runs.append(run)
    assert_same(*runs, ["s"])
    assert runs[0].cost[1] == 16
    run, _ = both(cached, plain, [("one-shot", system + [5], penalized)])  # the same tokens as computing it all
    assert run.cost[1] == 16
    # A prefix holding what the model would say next: without its counts the penalties would not push them down.
    start = prompt_of(202, 10)
    said = Run(plain).add("said", start, greedy(6)).run().items["said"]
    system = (start + [t for out in said if hasattr(out, "outputs") for t in out.outputs[0].token_ids])[:16]
    both(cached, plain, [("warm2", system + [3], greedy(2))])
    run, _ = both(cached, plain, [("repeats", system + [5], penalized)])
    assert run.cost[1] == 16


# -- configuration --------------------------------------------------------------------------------------------------

def test_serve_takes_the_flag_and_the_toml_key(monkeypatch, tmp_path):
    seen = []
    logger = logging.getLogger("jaxstream")
    monkeypatch.setattr(logger, "level", logger.level)  # `serve` sets a server's log level: put back

    async def capture(model, config, engine_config, *_):
        seen.append(engine_config)
        return 0

    monkeypatch.setattr(serve, "_serve", capture)
    path = tmp_path / "s.toml"
    path.write_text("[engine]\nenable_prefix_caching = false\n")
    for args, enabled in ((["serve"], True), (["serve", "--no-enable-prefix-caching"], False),
                          (["serve", "--config", str(path)], False),
                          (["serve", "--config", str(path), "--enable-prefix-caching"], True)):
        assert main(args) == 0
        assert seen[-1].enable_prefix_caching is enabled, args
