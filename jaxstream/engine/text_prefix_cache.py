"""Automatic prefix caching of a text LM's KV pages (vLLM's APC): sessions whose contexts start alike share pages.

A *block* is one page's worth of positions of a session's context. Once every position of a block has its KV
computed, its page is registered under the block's key; a session that starts computing from position 0 (its
first prefill, a recompute after preemption or after its KV was dropped) points its first page-table entries at
the registered pages of the blocks its context begins with and starts its prefill after them. No device copy: the
pages are shared, ref-counted, vLLM's way (v1/core/block_pool.py, kv_cache_utils.py):

* Only full blocks are cached, and a hit is capped at `num_tokens - 1`: the last known token is computed so that
  the step samples after it. So a hit is whole blocks below the last token.
* Keys chain: a block's key is the SHA-256 of its parent block's key and its token ids (int32 bytes), so a key
  names the whole prefix up to its block, and no client can make two prefixes share one (vLLM made SHA-256 its
  default after CVE-2025-25183: Python's `hash` is steerable wherever PYTHONHASHSEED is fixed, as deployments do
  for reproducibility; it costs under a microsecond a block). A session keeps its blocks' keys: each block is
  hashed once. Only the leader of a
  multi-host engine schedules, so only it hashes; followers get page tables in the batches they replay.
* A page's reference count is the number of sessions whose page table holds it. A cached page nobody holds stays
  cached and goes to the tail of an LRU queue; it loses its key only when the allocator hands it out again, and
  the allocator takes never-cached free pages first (vLLM's single queue would evict a cached block while an
  uncached free one waits behind it). A session's pages are freed last block first, so its last blocks are
  evicted first and its prefix stays reachable longest.
* Every position a session writes is at or past its `num_computed`, so a shared page, always a full block below
  it, is never written while cached: provided a session never wraps onto its own pages. A stack whose page ring
  holds fewer positions than `max_model_len` (a sliding-window model such as Mistral 7B v0.1, or a tiny window)
  would rewrite old pages, so caching is off for it (`supported`): simple and correct, rather than uncaching and
  copying pages on write.
* No registered block holds a token whose KV was not computed at its position: a block is registered once the
  session's `num_computed` passes its end, and the last sampled token of a chunk, discarded from the context
  (specs/streaming_semantics.md §1.2), is never computed. Prompt and output tokens alike become cached, as vLLM's.
* A failed dispatch that consumed the donated device state loses every page's contents: `drop` empties the map.

Sessions admitted in one tick with the same new prefix (the n children of a request with `n > 1`, a burst of chats
with one system prompt) would each compute it, since a block is registered only once its tick's results are read
(vLLM registers a block when it schedules it, so rows of one step read KV that step writes: that relies on every
row's KV being written before any row attends, an order `ring_attention` does not promise). So a waiting session
whose next missing block a running session is about to compute waits for it (`waits_for`): its admission is
deferred, without holding a slot, until that block is cached.

The sampling penalties read per-slot counts that the step builds from the tokens it feeds (sampling.py), so a
session that skipped its prefix has no counts of it: when its chunk uses a penalty, the scheduler counts the prefix
on the host and writes the slot's row before its prefill (`TextScheduler._write_counts`; a checkpoint's defaults
may set one for every request: Qwen2.5's repetition_penalty 1.05), and it recomputes a hit session's KV from 0
before a later chunk that uses one when the first did not (`TextScheduler._apply`). Nor
does a request that asks prompt logprobs look up (vLLM's skip_reading_prefix_cache): a cached block has KV but no
logits; it computes its whole prompt, and its blocks are cached for the others all the same.
"""
import collections
import hashlib

import numpy as np

from jaxstream.engine.kv_cache import NULL_PAGE, PagePool, StackSpec

ROOT = b""  # the parent key of a context's first block


def supported(spec: StackSpec, max_model_len: int) -> bool:
    """Whether prefix caching is safe on `spec`'s pool: no session ever wraps onto its own pages."""
    return max_model_len <= spec.pages_per_window * spec.page_size


class CachingPagePool(PagePool):
    """A `PagePool` whose pages are reference-counted and may stay cached under a block key after their last
    holder frees them (the module docstring). Cached pages nobody holds count as free: `num_free` and so
    `DeviceCache.at_baseline` include them, and `allocate` evicts them, least recently freed first, once the
    never-cached free pages are gone."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self._refs = np.zeros(num_pages, np.int32)
        self._cached = np.zeros(num_pages, bool)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # the next to evict first

    @property
    def num_free(self) -> int:
        return self._num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Pages registered under a key, held or not."""
        return len(self._key_of)

    def references(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, count: int) -> np.ndarray:
        if count > self.num_free:
            raise MemoryError(f"page pool exhausted: {count} pages wanted, {self.num_free} free")
        fresh = min(count, self._num_free)
        pages = super().allocate(fresh)
        if count > fresh:
            pages = np.concatenate([pages, np.array([self._evict() for _ in range(count - fresh)], np.int32)])
        self._refs[pages] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self._cached[page] = False
        return page

    def release(self, pages) -> None:
        """Drops one reference to each of `pages` (a session's, in position order); those nobody holds any more
        become free, the cached ones at the LRU queue's tail, last position first."""
        pages = np.asarray(pages, np.int32).ravel()
        pages = pages[pages != NULL_PAGE]
        self._refs[pages] -= 1
        unheld = pages[self._refs[pages] == 0]
        cached = self._cached[unheld]
        super().release(unheld[~cached])
        for page in unheld[cached][::-1].tolist():
            self._idle[page] = None

    def register(self, page: int, key: bytes) -> None:
        """Caches held `page` under `key`; a key already cached keeps its page (this one stays private)."""
        assert self._refs[page] > 0 and not self._cached[page], page
        if key not in self._page_of:
            self._page_of[key] = page
            self._key_of[page] = key
            self._cached[page] = True

    def is_cached(self, key: bytes) -> bool:
        return key in self._page_of

    def matched(self, keys) -> list[int]:
        """The cached pages of the longest run of `keys` from the first."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """Takes one more reference to each of `pages` (cached: a hit); an unheld one leaves the LRU queue."""
        for page in pages:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1

    def drop(self) -> None:
        """Forgets every key (the pages' contents are gone); unheld cached pages become plain free pages."""
        idle = list(self._idle)
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()
        self._cached[:] = False
        super().release(idle)


class TextPrefixCache:
    """The text scheduler's side of prefix caching over stack `stack`'s `CachingPagePool`: block keys of sessions,
    lookups, registration and vLLM's counters (tokens queried and hit). A session carries `block_keys` (its
    blocks' keys so far), `cached_blocks` (its leading blocks already registered, or found cached),
    `probed_blocks` (its leading blocks `waits_for` last found cached) and
    `num_computed`, `pages`, `prompt_ids`, `num_tokens`, `tokens(start, stop)`."""

    def __init__(self, pool: CachingPagePool, stack: str, page_size: int):
        self.pool = pool
        self.stack = stack
        self.page_size = page_size
        self.queries = 0  # tokens of the sessions that looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which found cached (vLLM's prefix_cache_hits)

    def _keys(self, session, blocks: int) -> list[bytes]:
        """`session.block_keys`, extended to at least `blocks` blocks (their tokens must be final)."""
        keys = session.block_keys
        if len(keys) < blocks:
            size = self.page_size
            rows = np.asarray(session.tokens(len(keys) * size, blocks * size), np.int32).reshape(-1, size)
            parent = keys[-1] if keys else ROOT
            for row in rows:
                parent = hashlib.sha256(parent + row.tobytes()).digest()
                keys.append(parent)
        return keys

    def _limit(self, session) -> int:
        """Blocks a hit may cover: whole blocks before the last known token."""
        return (session.num_tokens - 1) // self.page_size

    def lookup(self, session) -> int:
        """Points a session about to compute from position 0 (holding no page) at the cached pages of its leading
        blocks; returns the positions they cover (its new `num_computed`)."""
        limit = self._limit(session)
        pages = self.pool.matched(self._keys(session, limit)[:limit])
        self.pool.share(pages)
        session.pages[self.stack].table[:len(pages)] = pages
        session.cached_blocks = len(pages)
        self.queries += session.num_tokens
        self.hits += len(pages) * self.page_size
        return len(pages) * self.page_size

    def register(self, session) -> None:
        """Caches the session's blocks that became full of computed positions."""
        full = session.num_computed // self.page_size
        if full > session.cached_blocks:
            keys, table = self._keys(session, full), session.pages[self.stack].table
            for block in range(session.cached_blocks, full):
                self.pool.register(int(table[block]), keys[block])
            session.cached_blocks = full

    def pending(self, sessions) -> set[bytes]:
        """Keys of the prompt blocks `sessions` (running ones) will compute and have not yet."""
        keys = set()
        for session in sessions:
            blocks = len(session.prompt_ids) // self.page_size
            if blocks > session.cached_blocks:
                keys.update(self._keys(session, blocks)[session.cached_blocks:blocks])
        return keys

    def waits_for(self, session, pending: set[bytes]) -> bool:
        """Whether the first block of `session`'s context that a hit could cover but that is not cached is about to
        be computed by a running session (`pending`): admitted a tick later, it finds the block cached.

        A deferred session asks every tick, so it walks on from the blocks it found cached last time
        (`session.probed_blocks`) instead of from its first: a tick costs a few lookups per deferred session, not
        one per cached block of its prefix (100 sessions deferred behind a 4,096-block prompt took 38 ms a tick).
        An eviction since may have shortened the hit; then this answer is only a worse guess of when to admit it,
        never a wrong hit: `lookup` walks from the first block."""
        limit = self._limit(session)
        keys = self._keys(session, limit)
        hit = min(session.probed_blocks, limit)
        while hit < limit and self.pool.is_cached(keys[hit]):
            hit += 1
        session.probed_blocks = hit
        return hit < limit and keys[hit] in pending
