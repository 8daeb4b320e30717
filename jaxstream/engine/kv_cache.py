"""Paged ring-buffer KV cache: host-side page pools and page tables, device arrays, host offload.

One pool per attention stack (Voxtral has two: the encoder, W = 750 frames, and the decoder, W = 8192
tokens). Page 0 of every pool is the null page: never written by valid rows, and what unallocated
page-table entries point at. A session's table has `pages_per_window` entries; position p lives in
logical page (p // page_size) % pages_per_window, so a session allocates pages as it grows and wraps onto
its own pages once it holds a full window (design.md, "The KV cache: a paged ring buffer").
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """Shape of one attention stack's cache: `num_layers` x (k, v) of [num_pages, kv_heads, page, dim]."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    ring: int  # positions a session must keep: min(window, longest stream)
    num_pages: int  # including the null page
    pages_per_window: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "pages_per_window", math.ceil(self.ring / self.page_size))

    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    def bytes_per_page(self, dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * jnp.dtype(dtype).itemsize


def stack_spec(name, *, num_layers, num_kv_heads, head_dim, page_size, ring, num_pages, max_sessions) -> StackSpec:
    """A `StackSpec` whose pool defaults to `max_sessions` full windows plus the null page."""
    page_size = min(page_size, ring)
    if num_pages is None:
        num_pages = max_sessions * math.ceil(ring / page_size) + 1
    if num_pages < 2:
        raise ValueError(f"the {name} pool needs at least 2 pages (one is the null page)")
    return StackSpec(name, num_layers, num_kv_heads, head_dim, page_size, ring, num_pages)


class PagePool:
    """Free list of one stack's physical pages; page 0 (the null page) is never handed out.

    A numpy stack, so a scheduler can hand out the pages of many sessions in one call (`allocate`)."""

    def __init__(self, num_pages: int):
        self.capacity = num_pages - 1
        self._free = np.arange(num_pages - 1, NULL_PAGE, -1, dtype=np.int32)  # the top hands out low pages first
        self._num_free = self.capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, count: int) -> np.ndarray:
        if count > self._num_free:
            raise MemoryError(f"page pool exhausted: {count} pages wanted, {self._num_free} free")
        top = self._num_free
        self._num_free -= count
        return self._free[top - count : top][::-1].copy()

    def pin(self, count: int) -> np.ndarray:
        """Takes `count` pages out of circulation for good (the engine's own data, such as a cached prompt
        prefix): they are never handed out again and no longer count in `capacity`."""
        pages = self.allocate(count)
        self.capacity -= count
        return pages

    def release(self, pages) -> None:
        pages = np.asarray(pages, np.int32).ravel()
        pages = pages[pages != NULL_PAGE]
        self._free[self._num_free : self._num_free + pages.size] = pages
        self._num_free += pages.size


class SessionPages:
    """One session's page-table row for one stack (`table` may be a row of a scheduler's table array)."""

    def __init__(self, spec: StackSpec, table: np.ndarray | None = None):
        self.spec = spec
        self.table = np.full(spec.pages_per_window, NULL_PAGE, np.int32) if table is None else table

    @property
    def num_allocated(self) -> int:
        return int(np.count_nonzero(self.table))

    def missing(self, start: int, stop: int) -> list[int]:
        """Logical pages positions [start, stop) will write that have no physical page yet."""
        if stop <= start:
            return []
        size, count = self.spec.page_size, self.spec.pages_per_window
        first, last = start // size, (stop - 1) // size
        if first == last:  # the usual case: one page
            page = first % count
            return [] if self.table[page] != NULL_PAGE else [page]
        # Plain Python: spans are a page or two, and this runs per session per tick.
        logical = range(count) if last - first + 1 >= count else {page % count for page in range(first, last + 1)}
        table = self.table
        return [page for page in logical if table[page] == NULL_PAGE]

    def assign(self, pool: PagePool, logical_pages: list[int]) -> None:
        """Gives each logical page a physical page from `pool` (raises MemoryError if it is short)."""
        if len(logical_pages):
            self.table[logical_pages] = pool.allocate(len(logical_pages))

    def release(self, pool: PagePool) -> None:
        pool.release(self.table[self.table != NULL_PAGE])
        self.table[:] = NULL_PAGE


def missing_pages(spec: StackSpec, tables: np.ndarray, start: np.ndarray, stop: np.ndarray):
    """`SessionPages.missing` for many rows at once: (row indices, logical pages) of the pages positions
    [start, stop) of each row of `tables` [rows, pages_per_window] will write that have no physical page
    yet, each (row, page) pair once, rows in order."""
    size, count = spec.page_size, spec.pages_per_window
    first = start // size
    last = np.where(stop > start, (stop - 1) // size, first - 1)
    span = int((last - first).max(initial=-1)) + 1
    if span <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    offsets = np.arange(min(span, count))
    logical = (first[:, None] + offsets) % count
    wanted = (first[:, None] + offsets) <= last[:, None]
    hole = wanted & (np.take_along_axis(tables, logical, axis=1) == NULL_PAGE)
    rows, columns = np.nonzero(hole)
    return rows, logical[rows, columns]


def init_stack(spec: StackSpec, dtype, sharding=None) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k_pages, v_pages) of one stack, placed with `sharding` when given."""

    def zeros():
        return jnp.zeros(spec.layer_shape(), dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)
    return [(make(), make()) for _ in range(spec.num_layers)]


def gather_session(cache, table):
    """The pages of one session (its page-table row, [P]) from every layer: for offloading to host."""
    return [(k[table], v[table]) for k, v in cache]


def scatter_session(cache, table, data):
    """Writes offloaded pages back at the physical pages of `table`; entries equal to the null page are
    dropped so a restore never writes page 0."""
    num_pages = cache[0][0].shape[0]
    target = jnp.where(table == NULL_PAGE, num_pages, table)
    return [(k.at[target].set(dk, mode="drop"), v.at[target].set(dv, mode="drop"))
            for (k, v), (dk, dv) in zip(cache, data)]


def slot_row_bytes(slot_shapes: dict) -> int:
    """The bytes of one slot's rows of `slot_shapes` ({name: (shape, dtype)})."""
    return sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in slot_shapes.values())


class DeviceCache:
    """The engine's device-resident session state and its host-side bookkeeping.

    `state` is the pytree every step program takes (donated) and returns: `{"stacks": {name: [(k, v)
    per layer]}, "slots": {name: [max_sessions + reserved_slots, ...]}}`; the per-slot arrays hold
    per-session device state (Voxtral's conv state and last sampled token, a text session's context counts for
    the sampling penalties) at the session's slot index; the
    `reserved_slots` rows past `max_sessions` are never handed to a session (the engine's own rows). Sessions
    leave and return through `offload` / `restore`, which copy a session's pages and slot rows to host
    memory and back bit for bit.
    """

    def __init__(self, specs: list[StackSpec], slot_shapes: dict, max_sessions: int, dtype, shardings=None,
                 slot_sharding=None, reserved_slots: int = 0, pool_types: dict | None = None):
        self.specs = {spec.name: spec for spec in specs}
        # A stack's pool class (default PagePool): the text stack's caches prefixes when enabled (text_prefix_cache).
        pool_types = pool_types or {}
        self.pools = {spec.name: pool_types.get(spec.name, PagePool)(spec.num_pages) for spec in specs}
        self.max_sessions = max_sessions
        self.dtype = dtype
        self._free_slots = list(range(max_sessions - 1, -1, -1))
        shardings = shardings or {}

        def fresh_state():
            return {
                "stacks": {spec.name: init_stack(spec, dtype, shardings.get(spec.name)) for spec in specs},
                "slots": {name: jax.device_put(jnp.zeros((max_sessions + reserved_slots, *shape), slot_dtype),
                                               slot_sharding)
                          for name, (shape, slot_dtype) in slot_shapes.items()},
            }

        self._fresh_state = fresh_state
        self.slot_row_bytes = slot_row_bytes(slot_shapes)  # what an offload copies besides the pages
        self.state = fresh_state()
        self.shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, self.state)
        self._offload = self._restore = None  # compiled ahead of time by warm_up()

    def state_lost(self) -> bool:
        """True when a failed dispatch consumed the donated state (every session's KV is gone)."""
        return any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.state))

    def reset_state(self) -> None:
        self.state = self._fresh_state()

    # -- slots ------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def take_slot(self) -> int:
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def new_pages(self) -> dict[str, SessionPages]:
        return {name: SessionPages(spec) for name, spec in self.specs.items()}

    def release_pages(self, pages: dict[str, SessionPages]) -> None:
        for name, session_pages in pages.items():
            session_pages.release(self.pools[name])

    def at_baseline(self) -> bool:
        """True when no session holds a page or a slot (a cached page nobody holds is free)."""
        return (all(pool.num_free == pool.capacity for pool in self.pools.values())
                and len(self._free_slots) == self.max_sessions)

    # -- host offload -----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compiles the offload and restore programs ahead of time (eviction never compiles while serving;
        AOT executables also take the state whether or not its arrays are committed to a device)."""
        if self._offload is not None:
            return
        tables = {name: np.zeros(spec.pages_per_window, np.int32) for name, spec in self.specs.items()}
        slot = np.int32(0)
        self._offload = _OFFLOAD.lower(self.state, slot, tables).compile()
        data = jax.eval_shape(_offload_session, self.state, slot, tables)
        leaves, tree = jax.tree_util.tree_flatten(self.shardings)
        self._restore = _restore_jit(tuple(leaves), tree).lower(self.state, slot, tables, data).compile()

    def offload(self, slot: int, pages: dict[str, SessionPages]):
        """Copies a session's pages and slot rows to host memory and frees them. Returns (data, bytes)."""
        self.warm_up()
        tables = {name: p.table.copy() for name, p in pages.items()}
        data = jax.device_get(self._offload(self.state, np.int32(slot), tables))
        # Host memory holds only the pages the session had (a short session offloads little).
        used = {name: np.flatnonzero(table) for name, table in tables.items()}
        data["stacks"] = {name: [(k[used[name]], v[used[name]]) for k, v in layers]
                          for name, layers in data["stacks"].items()}
        self.release_pages(pages)
        self.release_slot(slot)
        nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(data))
        return (tables, data), nbytes

    def pages_to_restore(self, offloaded) -> dict[str, int]:
        tables, _ = offloaded
        return {name: int(np.count_nonzero(table)) for name, table in tables.items()}

    def restore(self, offloaded, pages: dict[str, SessionPages]) -> int:
        """Brings an offloaded session back into fresh pages and a slot; returns the slot."""
        old_tables, data = offloaded
        slot = self.take_slot()
        try:
            stacks = {}
            for name, old in old_tables.items():
                used = np.flatnonzero(old)
                pages[name].assign(self.pools[name], used.tolist())
                # Back to full page-table rows; unused rows land on null entries, which the scatter drops.
                stacks[name] = [tuple(_expand(part, used, len(old)) for part in layer)
                                for layer in data["stacks"][name]]
            tables = {name: p.table.copy() for name, p in pages.items()}
            self.warm_up()
            self.state = self._restore(self.state, np.int32(slot), tables, {"stacks": stacks, "slots": data["slots"]})
        except BaseException:
            # A failed restore (the device out of memory) keeps nothing: its pages and slot go back, and the
            # session stays offloaded (the caller keeps the host copy).
            for name, session_pages in pages.items():
                session_pages.release(self.pools[name])
            self.release_slot(slot)
            raise
        return slot


def _expand(rows: np.ndarray, used: np.ndarray, size: int) -> np.ndarray:
    full = np.zeros((size, *rows.shape[1:]), rows.dtype)
    full[used] = rows
    return full


def _offload_session(state, slot, tables):
    return {
        "stacks": {name: gather_session(cache, tables[name]) for name, cache in state["stacks"].items()},
        "slots": {name: rows[slot] for name, rows in state["slots"].items()},
    }


def _restore_session(state, slot, tables, data):
    return {
        "stacks": {name: scatter_session(cache, tables[name], data["stacks"][name])
                   for name, cache in state["stacks"].items()},
        "slots": {name: rows.at[slot].set(data["slots"][name], mode="drop")
                  for name, rows in state["slots"].items()},
    }


# One jitted offload for the process and one restore per placement of the state, as steps.py keeps its steps: a
# cache built again in the same process gets its executables back rather than lowering them again.
_OFFLOAD = jax.jit(_offload_session)


@functools.lru_cache(16)
def _restore_jit(sharding_leaves, sharding_tree):
    return jax.jit(_restore_session, donate_argnums=(0,),
                   out_shardings=jax.tree_util.tree_unflatten(sharding_tree, sharding_leaves))
