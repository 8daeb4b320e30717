"""The realtime scheduler's array state (jaxstream/engine/stream_rows.py, kv_cache.missing_pages) against
plain-Python oracles: per-session page checks, FIFO audio queues, token buffers, row reuse and growth."""
import collections

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxstream.engine.kv_cache import NULL_PAGE, PagePool, SessionPages, StackSpec, missing_pages
from jaxstream.engine.residency import Status
from jaxstream.engine.stream_rows import MelSlab, RowSession, StreamRows

SPEC = StackSpec("decoder", num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, ring=24, num_pages=64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.booleans(), min_size=6, max_size=6), st.integers(0, 60), st.integers(0, 30)),
                min_size=1, max_size=8))
def test_missing_pages_equals_the_per_session_check(rows):
    tables = np.array([[7 if held else NULL_PAGE for held in holding] for holding, _, _ in rows], np.int32)
    start = np.array([s for _, s, _ in rows])
    stop = start + np.array([n for _, _, n in rows])
    index, logical = missing_pages(SPEC, tables, start, stop)
    expected = []
    for i, table in enumerate(tables):
        pages = SessionPages(SPEC, table.copy())
        expected += [(i, page) for page in sorted(pages.missing(int(start[i]), int(stop[i])))]
    assert sorted(zip(index.tolist(), logical.tolist())) == expected


def test_page_pool_hands_out_low_pages_first_and_takes_them_back():
    pool = PagePool(8)
    first = pool.allocate(3)
    assert first.tolist() == [1, 2, 3] and pool.num_free == 4
    pool.release(np.array([2, NULL_PAGE]))
    assert pool.allocate(2).tolist() == [2, 4] and pool.num_free == 3


class Session(RowSession):
    def __init__(self, rows):
        self.pages = rows.attach(self)
        self.status = Status.WAITING


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=40))
@example([(0, 0, 0), (1, 2, 1)])  # an empty append beside one of two slots: as many slots as appends
def test_audio_queues_are_fifo_through_ring_widening_slab_growth_and_row_reuse(ops):
    rows = StreamRows({"decoder": SPEC}, (2, 3), token_width=8, capacity=2)
    rows.mel = type(rows.mel)((2, 3), blocks=4)  # small, so the slab grows too
    sessions, oracle, serial, appended_since = {}, {}, [0], []

    def fresh_slots(n):
        values = np.arange(serial[0], serial[0] + n, dtype=np.float32)
        serial[0] += n
        return np.broadcast_to(values[:, None, None], (n, 2, 3)).copy()

    for which, appended, taken in ops:
        if which not in sessions:
            sessions[which], oracle[which] = Session(rows), collections.deque()
        session = sessions[which]
        slots = fresh_slots(appended)
        appended_since.append((session.row, slots))
        oracle[which].extend(slots[:, 0, 0].tolist())
        if not taken:
            continue  # appends of several sessions (some of one row) are stored together, as between ticks
        owners, parts = zip(*appended_since)
        rows.store_audio(np.array(owners), list(parts))
        appended_since.clear()
        count = min(taken, len(oracle[which]))
        row = np.array([session.row])
        blocks = rows.queued_blocks(row, rows.fed[row], np.array([count]), max(count, 1))
        got = rows.mel.data[blocks[0, :count]][:, 0, 0].tolist()
        rows.mel.release(blocks.ravel())
        rows.fed[row] += count
        assert got == [oracle[which].popleft() for _ in range(count)]
        if taken % 7 == 3:  # the session ends: its row and its queued audio are freed
            rows.detach(session)
            assert session.row is None and session.status is Status.WAITING
            del sessions[which], oracle[which]
    for session in sessions.values():
        rows.detach(session)
    assert rows.mel._num_free == len(rows.mel.data) - 1  # every block is back


def test_a_ticks_slots_come_back_as_one_run_and_are_stored_in_one_copy():
    slab = MelSlab((2, 3), blocks=16)
    parts = [np.full((n, 2, 3), value, np.float32) for value, n in ((1, 2), (2, 1), (3, 3))]
    blocks = slab.store(parts, np.arange(6.0))
    assert blocks.tolist() == [1, 2, 3, 4, 5, 6]
    slab.release(blocks[[4, 0, 5, 2, 1, 3]])  # consumed in batch-row order, not slab order
    again = slab.store(parts[::-1], np.zeros(6))
    assert again.tolist() == [1, 2, 3, 4, 5, 6]
    assert slab.data[again][:, 0, 0].tolist() == [3, 3, 3, 2, 1, 1]
    # Free blocks that are not one run (some still queued) go through the scattered path, same contents.
    slab.release(again[[0, 2, 4]])
    scattered = slab.store(parts, np.zeros(6))
    assert scattered[:3].tolist() == [1, 3, 5]
    assert slab.data[scattered][:, 0, 0].tolist() == [1, 1, 2, 3, 3, 3]


def test_a_batch_of_consecutive_slots_is_an_aligned_view_and_any_other_a_zero_padded_copy():
    slab = MelSlab((4, 4), blocks=8)  # 64-byte slots, as the real ones (4 KB) are a multiple of
    parts = [np.arange(i * 16, i * 16 + 48, dtype=np.float32).reshape(3, 4, 4) for i in range(2)]
    blocks = slab.store(parts, np.zeros(6))  # blocks 1-6
    view = slab.batch(np.array([[3], [4], [5], [0]]), used=3)  # the padding row reads block 6, not zeros
    assert np.shares_memory(view, slab.data) and view.ctypes.data % 64 == 0
    expected = np.concatenate(parts)[2:5, None]
    np.testing.assert_array_equal(view[:3], expected)
    for rows, used in (([[4], [3], [5], [0]], 3), ([[3, 4], [5, 0]], 2), ([[6], [7], [0], [0]], 2)):
        copy = slab.batch(np.array(rows), used)  # out of order; two slots per row; past the slab's end
        assert not np.shares_memory(copy, slab.data)
        np.testing.assert_array_equal(copy, slab.data[np.array(rows)])
        assert not copy[np.array(rows) == 0].any()
    slab.release(blocks)
    slab.store([np.ones((12, 4, 4), np.float32)], np.zeros(12))  # grows the slab: the view keeps its data
    np.testing.assert_array_equal(view[:3], expected)
    assert slab.data.ctypes.data % 64 == 0 and not slab.data[0].any()


def test_token_buffer_keeps_each_rows_ids_and_logprobs_in_order():
    rows = StreamRows({"decoder": SPEC}, (2, 3), token_width=6)
    a, b = Session(rows), Session(rows)
    index = np.array([a.row, b.row])
    first, second = np.array([[5, 6, -1], [7, -1, -1]]), np.array([[8, -1, -1], [9, 10, 11]])
    rows.buffer_tokens(index, first, -first / 4, np.array([2, 1]))  # logprobs: -id / 4, exact in f32
    rows.buffer_tokens(index, second, -second / 4, np.array([1, 3]))
    assert rows.take_tokens(np.array([b.row, a.row])) == [([7, 9, 10, 11], [-1.75, -2.25, -2.5, -2.75]),
                                                          ([5, 6, 8], [-1.25, -1.5, -2.0])]
    assert rows.take_tokens(np.array([a.row])) == [([], [])]


def test_rows_grow_and_page_tables_stay_the_sessions_views():
    rows = StreamRows({"decoder": SPEC}, (2, 3), token_width=4, capacity=2)
    sessions = [Session(rows) for _ in range(5)]  # capacity 2 (one usable row) doubles to 8
    for i, session in enumerate(sessions):
        session.pages["decoder"].table[0] = i + 1
        session.fed = 10 * i
    assert rows.capacity == 8 and len({s.row for s in sessions}) == 5
    for i, session in enumerate(sessions):
        assert rows.tables["decoder"][session.row, 0] == i + 1 and session.fed == 10 * i
        assert np.shares_memory(session.pages["decoder"].table, rows.tables["decoder"])
