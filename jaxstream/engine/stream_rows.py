"""The realtime scheduler's per-session state as numpy columns indexed by row, and the queued audio.

A tick of the transcription scheduler reads and writes the state of every live stream; kept in arrays
(one row per session, row 0 the padding row that batch buckets are filled with), readiness, scheduling,
page checks and batch assembly are a few array operations per tick instead of Python per session.
Sessions see their row through `Column` attributes, so code off the hot path (eviction, tests, metrics)
reads `session.fed` or `session.slot` as before.

Queued audio lives in one slab of 80 ms mel slots shared by all sessions (`MelSlab`); a session's queue
is a ring of slab block indices (`ring[row, position % ring_width]`), so gathering a batch's mel is one
fancy index, or no copy at all when the batch's slots sit in consecutive blocks. Each block also holds the
time its slot reached the engine, the start of that token's latency.
"""
import time

import numpy as np

from jaxstream.engine.kv_cache import NULL_PAGE, SessionPages
from jaxstream.engine.residency import Status

STATUSES = tuple(Status)
STATUS_CODE = {status: code for code, status in enumerate(STATUSES)}
UNKNOWN_LIMIT = np.iinfo(np.int64).max // 2  # `limit` of a stream whose end is not known yet
# XLA:CPU reads a host array in place only when its data is 64-byte aligned (numpy aligns to 16); any other
# array is copied once more when a program is called with it.
DEVICE_ALIGNMENT = 64

# name -> (dtype, value of a free row and of the padding row 0)
COLUMNS = {
    "fed": (np.int64, 0),  # positions dispatched (= audio slots consumed)
    "received": (np.int64, 0),  # audio slots received; received - fed are queued
    "limit": (np.int64, UNKNOWN_LIMIT),  # one past the last position to feed, once the input is finished
    "prompt_len": (np.int64, 0),
    "in_flight": (np.int64, 0),  # dispatches whose tokens are not collected yet
    "collected": (np.int64, 0),  # positions whose generated ids were collected (their text handed on)
    "arrival": (np.int64, 0),  # order of creation, for FIFO admission
    "slot": (np.int32, -1),  # device slot; -1 while not resident (and for padding rows)
    "n_delay": (np.float32, 1.0),
    "status": (np.int8, STATUS_CODE[Status.WAITING]),
    "last_active": (np.int64, 0),  # residency clock of the last activity (LRU eviction)
    "generation": (np.int64, 0),  # bumped when a row is freed: results of a freed row's dispatch are dropped
    "buffered": (np.int64, 0),  # generated ids in `tokens` not yet moved to the session's lists
    "last_arrival": (np.float64, 0.0),  # perf_counter time its latest audio reached the engine
}


class Column:
    """A session attribute stored in its row of a `StreamRows` column (in a plain dict once detached)."""

    def __init__(self, column: str, decode=int, encode=lambda value: value):
        self.column, self.decode, self.encode = column, decode, encode

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, session, owner=None):
        if session is None:
            return self
        if session.row is None:
            return session.detached[self.name]
        return self.decode(session.rows.columns[self.column][session.row])

    def __set__(self, session, value):
        if session.row is None:
            session.detached[self.name] = value
        else:
            session.rows.columns[self.column][session.row] = self.encode(value)


def _slot_or_none(value):
    return None if value < 0 else int(value)


class RowSession:
    """Base of sessions whose hot state lives in a `StreamRows` row (`row` is None once detached)."""

    slot = Column("slot", _slot_or_none, lambda slot: -1 if slot is None else slot)
    status = Column("status", STATUSES.__getitem__, STATUS_CODE.__getitem__)
    last_active = Column("last_active")
    fed = Column("fed")
    in_flight = Column("in_flight")
    prompt_len = Column("prompt_len")

    def bind(self, rows: "StreamRows", row: int) -> None:
        self.rows, self.row, self.detached = rows, row, {}


class MelSlab:
    """80 ms mel slots of every session's queued audio in one growable array; block 0 stays zero (what
    padding rows and padding steps read)."""

    def __init__(self, slot_shape: tuple[int, ...], blocks: int = 1024):
        self.data = aligned_zeros((blocks, *slot_shape), np.float32)
        self.arrived = np.zeros(blocks, np.float64)  # perf_counter time the slot reached the engine
        self._free = np.arange(blocks - 1, 0, -1, dtype=np.int64)
        self._num_free = blocks - 1

    @property
    def num_held(self) -> int:
        """Blocks holding queued or in-flight slots."""
        return len(self.data) - 1 - self._num_free

    def store(self, parts, arrived: np.ndarray) -> np.ndarray:
        """Copies the slots of `parts` (arrays of slots, in order) into free blocks, with each slot's arrival
        time; returns the blocks, in order."""
        count = len(arrived)
        while count > self._num_free:
            self._grow()
        top = self._num_free
        self._num_free -= count
        blocks = self._free[top - count : top][::-1].copy()
        if count and (np.diff(blocks) == 1).all():  # one ascending run (the steady state): a single copy
            np.concatenate(parts, out=self.data[blocks[0] : blocks[0] + count])
        else:
            self.data[blocks] = np.concatenate(parts)
        self.arrived[blocks] = arrived
        return blocks

    def batch(self, blocks: np.ndarray, used: int) -> np.ndarray:
        """The mel of a batch whose row i reads the slots `blocks[i]` ([rows, slots]), rows past `used` being
        padding. One slot per row in consecutive blocks (a tick's slots are stored as one ascending run) is a
        view of the slab, read in place by the device: its blocks must stay allocated until the dispatch
        is collected, and the padding rows read whatever follows (their results are dropped). Otherwise
        a copy, with zeros (block 0) for the padding rows."""
        rows, width = blocks.shape
        first = int(blocks[0, 0])
        if (width == 1 and first and first + rows <= len(self.data)
                and (blocks[:used, 0] == np.arange(first, first + used)).all()):
            return self.data[first : first + rows, None]
        return self.data[blocks]

    def release(self, blocks: np.ndarray) -> None:
        """Frees blocks; they are handed out again lowest first, so a tick's slots, consumed together by the
        next tick, come back as one ascending run."""
        blocks = np.sort(blocks[blocks != 0])[::-1]
        self._free[self._num_free : self._num_free + blocks.size] = blocks
        self._num_free += blocks.size

    def _grow(self) -> None:
        old = len(self.data)
        data = aligned_zeros((2 * old, *self.data.shape[1:]), self.data.dtype)
        data[:old] = self.data  # batches being read keep viewing the old array
        self.data = data
        self.arrived = np.concatenate([self.arrived, np.zeros_like(self.arrived)])
        # New blocks go under the free ones already there, which keep being handed out first.
        self._free = np.concatenate([np.arange(2 * old - 1, old - 1, -1), self._free[: self._num_free],
                                     np.zeros(old - 1 - self._num_free, np.int64)])
        self._num_free += old


def aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero array whose data starts on a `DEVICE_ALIGNMENT` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + DEVICE_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % DEVICE_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class StreamRows:
    """Rows of per-session columns (`COLUMNS`), page tables per stack, queued audio and generated ids not
    yet handed to their session; rows are reused, and everything grows by doubling."""

    def __init__(self, specs: dict, slot_shape: tuple[int, ...], token_width: int, capacity: int = 16):
        self.specs = specs
        self.capacity = capacity
        self.columns = {name: np.full(capacity, default, dtype) for name, (dtype, default) in COLUMNS.items()}
        self.__dict__.update(self.columns)  # `rows.fed` is the column itself
        self.tables = {name: np.full((capacity, spec.pages_per_window), NULL_PAGE, np.int32)
                       for name, spec in specs.items()}
        self.ring = np.zeros((capacity, 16), np.int64)  # slab block of queued slot p at [row, p % width]
        self.tokens = np.zeros((capacity, token_width), np.int32)  # generated ids, `buffered` per row
        self.logprobs = np.zeros((capacity, token_width), np.float32)  # each buffered id's log-probability
        self.sessions: list = [None] * capacity  # row -> RowSession
        self.mel = MelSlab(slot_shape)
        self._free_rows = list(range(capacity - 1, 0, -1))

    # -- rows -------------------------------------------------------------------------------------
    def attach(self, session: RowSession) -> dict[str, SessionPages]:
        """Gives `session` a fresh row; returns its page tables (views of the row's table rows)."""
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        session.bind(self, row)
        self.sessions[row] = session
        return {name: SessionPages(spec, self.tables[name][row]) for name, spec in self.specs.items()}

    def detach(self, session: RowSession) -> None:
        """Frees the row of a session whose pages are released: its queued audio is dropped, its values
        stay readable on the session, and results of its in-flight dispatches will be ignored."""
        row = session.row
        if row is None:
            return
        queued = np.arange(self.fed[row], self.received[row])
        self.mel.release(self.ring[row, queued % self.ring.shape[1]])
        detached = {name: getattr(session, name) for name in ("slot", "status", "last_active", "fed", "in_flight",
                                                              "prompt_len")}
        for pages in session.pages.values():
            pages.table = pages.table.copy()
        generation = self.generation[row]
        for name, (_, default) in COLUMNS.items():
            self.columns[name][row] = default
        self.generation[row] = generation + 1
        self.sessions[row] = None
        session.row, session.detached = None, detached
        self._free_rows.append(row)

    def _grow_rows(self) -> None:
        old, new = self.capacity, 2 * self.capacity
        for name, (dtype, default) in COLUMNS.items():
            grown = np.full(new, default, dtype)
            grown[:old] = self.columns[name]
            self.columns[name] = grown
        self.__dict__.update(self.columns)
        for name, table in self.tables.items():
            grown = np.full((new, table.shape[1]), NULL_PAGE, np.int32)
            grown[:old] = table
            self.tables[name] = grown
        self.ring = np.concatenate([self.ring, np.zeros_like(self.ring)])
        self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
        self.logprobs = np.concatenate([self.logprobs, np.zeros_like(self.logprobs)])
        self.sessions += [None] * old
        self.capacity = new
        self._free_rows = list(range(new - 1, old - 1, -1)) + self._free_rows
        for row, session in enumerate(self.sessions):  # page tables are views: point them at the new rows
            if session is not None:
                for name, pages in session.pages.items():
                    pages.table = self.tables[name][row]

    # -- queued audio -----------------------------------------------------------------------------
    def store_audio(self, owners: np.ndarray, parts: list[np.ndarray]) -> None:
        """Queues new 80 ms mel slots: `parts[i]` (slots, in order) for row `owners[i]`. The engine thread
        applies every append queued since its last tick with one call, so the slots are stored in the slab
        and the rows' rings in one go (and, in the paced steady state, as one ascending run of blocks)."""
        counts = np.fromiter(map(len, parts), np.int64, len(parts))
        total = int(counts.sum())
        if not total:
            return
        # The row of every new slot (one slot per append in the paced steady state).
        slots = owners if (counts == 1).all() else np.repeat(owners, counts)
        added = np.bincount(slots, minlength=self.capacity)
        positions = self.received[slots]
        if slots.size > np.count_nonzero(added):  # some row got several slots: offset each by its rank
            # Each new slot's rank among its row's new slots: a stable sort groups them, arrival order kept.
            order = np.argsort(slots, kind="stable")
            grouped = slots[order]
            starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
            rank = np.empty(slots.size, np.int64)
            rank[order] = np.arange(slots.size) - np.repeat(starts, np.diff(np.r_[starts, slots.size]))
            positions += rank
        needed = int((self.received + added - self.fed).max())
        if needed > self.ring.shape[1]:
            self._widen_ring(needed)
        now = time.perf_counter()
        self.ring[slots, positions % self.ring.shape[1]] = self.mel.store(parts, np.full(total, now))
        self.received += added
        self.last_arrival[slots] = now

    def _widen_ring(self, needed: int) -> None:
        """A wider ring (power of two): every queued slot moves to its position modulo the new width."""
        old = self.ring.shape[1]
        width = 1 << (int(needed) - 1).bit_length()
        grown = np.zeros((self.capacity, width), np.int64)
        positions = self.fed[:, None] + np.arange(old)
        queued = positions < self.received[:, None]
        rows, steps = np.nonzero(queued)
        grown[rows, positions[rows, steps] % width] = self.ring[rows, positions[rows, steps] % old]
        self.ring = grown

    def queued_blocks(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
        """Slab blocks [len(rows), width] of the queued slots [start, start + count) of each row (block 0,
        all zeros, past `count`)."""
        positions = starts[:, None] + np.arange(width)
        valid = np.arange(width) < counts[:, None]
        return np.where(valid, self.ring[rows[:, None], positions % self.ring.shape[1]], 0)

    # -- generated ids ----------------------------------------------------------------------------
    def buffer_tokens(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray, counts: np.ndarray) -> None:
        """Appends the first `counts[i]` ids of `tokens[i]`, and their `logprobs[i]`, to row `rows[i]`'s buffer."""
        columns = np.arange(tokens.shape[1])
        valid = columns < counts[:, None]
        r, k = np.nonzero(valid)
        at = self.buffered[rows[r]] + k
        self.tokens[rows[r], at] = tokens[r, k]
        self.logprobs[rows[r], at] = logprobs[r, k]
        self.buffered[rows] += counts

    def take_tokens(self, rows: np.ndarray) -> list[tuple[list[int], list[float]]]:
        """Empties the buffers of `rows`; returns each one's (ids, logprobs) in order. Only the buffered
        entries become Python objects (a buffer is mostly empty), then each row's run is a list slice."""
        counts = self.buffered[rows]
        self.buffered[rows] = 0
        held = np.arange(self.tokens.shape[1]) < counts[:, None]
        ids, logprobs = self.tokens[rows][held].tolist(), self.logprobs[rows][held].tolist()
        ends = np.cumsum(counts).tolist()
        return [(ids[end - count:end], logprobs[end - count:end]) for end, count in zip(ends, counts.tolist())]
