"""Scheduler of realtime transcription sessions over Voxtral Realtime (delayed-streams decoding).

A session's decoder position p is fed the token sampled at p - 1 plus the audio embedding of 80 ms slot p
(`specs/voxtral_realtime.md` §4). Positions 0..prompt_len-1 are the prompt (BOS + 32 left-pad + n_delay
`[STREAMING_PAD]`), prefilled with the first prompt_len slots, of which the first 31 (pure left-pad
silence) are copied from the engine's prefix cache (prefix_cache.py); then every slot of audio runs one decoder
step. The sampled token stays on the device (`last_token` slot row) and is fed back there, so a dispatch
can run up to K steps per session when audio is queued (catch-up) and the host only reads tokens back to
stream them. At the end of the stream (right padding appended by the front end) positions up to
total_slots - 2 are fed, as in Hugging Face `generate`; an end-of-text token ends the session earlier.

Both rings wrap (encoder W = 750 frames, decoder W = 8192 tokens), so a stream of any length runs in
bounded memory; RoPE positions are absolute and exact (models/layers.py).

The host side of a tick is vectorised over the sessions' rows (stream_rows.py): with hundreds of streams a
tick must cost the host a couple of milliseconds, not Python per session. Generated ids wait in their
row's buffer until one of them is text (or the stream ends, or the buffer fills), so a session that only
produced control ids this tick costs no Python; then they go to the stream's consumer as `GeneratedIds`,
whose detokenizer (transcription_session.TranscriptAssembler) runs on the consumer's side, off this thread.
"""
import dataclasses
import functools
import time
import typing

import numpy as np

from jaxstream.engine import first_runs, steps
from jaxstream.engine.kv_cache import missing_pages
from jaxstream.engine.prefix_cache import PrefixCache
from jaxstream.engine.realtime_admission import RealtimeAdmission
from jaxstream.engine.residency import SessionBase, Status, TickStats, deliver
from jaxstream.engine.stream_rows import STATUS_CODE, UNKNOWN_LIMIT, RowSession, StreamRows
from jaxstream.engine.transcription_session import PROGRESS, GeneratedIds
from jaxstream.errors import InvalidRequestError
from jaxstream.models.audio import ALLOWED_DELAYS_MS, SLOT_SECONDS, n_delay_from_ms, prompt_length
from jaxstream.models.tokenizers import NUM_CONTROL_IDS, Tokenizer

# Generated control ids a row holds before they move to its session's lists (text ids move at once).
TOKEN_BUFFER = 64
RUNNING, PARKED = STATUS_CODE[Status.RUNNING], STATUS_CODE[Status.PARKED]


class RealtimeSession(RowSession, SessionBase):
    """A transcription stream: its hot counters live in its `StreamRows` row (`fed`, `in_flight`, `slot`,
    `status`, ...), the rest here."""

    def __init__(self, request_id, sink, rows: StreamRows, *, n_delay: int, prompt_ids, backlog,
                 arrival: int, max_slots: int | None, commitment: dict[str, int]):
        super().__init__(request_id, sink, rows.attach(self))
        rows.n_delay[self.row] = n_delay
        rows.prompt_len[self.row] = len(prompt_ids)
        rows.arrival[self.row] = arrival
        self.backlog = backlog  # transcription_session.AudioBacklog, shared with the event loop
        self.prompt_ids = list(prompt_ids)
        self.samples = 0.0  # real audio received, in 16 kHz samples
        self.skip = 0  # leading mel slots still to drop (the cached prefix computed them)
        self.max_slots = max_slots  # None: a stream of any length
        self.commitment = commitment  # pages per pool admission reserves for it (RealtimeScheduler.admit)

    @property
    def last_position(self) -> int | None:
        """One past the last position to feed (the last audio slot is never fed, as in HF generate)."""
        if self.row is None:
            return None
        limit = int(self.rows.limit[self.row])
        return None if limit == UNKNOWN_LIMIT else limit


@dataclasses.dataclass
class Dispatch:
    """One program call of a tick: its rows (with their generations, to drop rows freed meanwhile), the
    positions each one computes, and when each slot's audio reached the engine."""

    key: tuple  # ("decode" | "prefill", batch rows, slots per row)
    rows: np.ndarray
    generations: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    arrived: np.ndarray | None = None  # [rows, slots] perf_counter times
    blocks: np.ndarray | None = None  # [rows, slots] mel slab blocks of the booked slots, freed once collected
    outputs: dict | None = None

    @property
    def prefill(self) -> bool:
        return self.key[0] == "prefill"


class RealtimeScheduler(RealtimeAdmission):
    """Host-side scheduler of transcription sessions; `step()` runs one tick on the calling thread.

    Per tick, the host work is a fixed number of array operations over the session rows (readiness, order,
    page checks, batch gathers, token bookkeeping); Python runs per session only where something happens to
    that session: admission, new pages, text to stream, the end of its stream, and the audio counter the
    event loop reads."""

    def __init__(self, programs: steps.Programs, engine_cfg, model_cfg, tokenizer, *, prefill_buckets):
        super().__init__(programs, engine_cfg)
        self.cfg = engine_cfg
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.prefill_buckets = prefill_buckets
        self.eos_id = model_cfg.eos_id
        self._arrivals = 0
        self._in_flight: list[Dispatch] = []  # the previous tick's dispatches, collected next tick
        # Wall, CPU and device-call CPU seconds of calls since the last tick that collected.
        self._uncollected = (0.0, 0.0, 0.0)
        self._device_call_cpu = 0.0  # this call's CPU inside the device's calls so far
        self._waiting: set = set()  # AudioBacklogs of appenders waiting for room (added on the event loop)
        # Called after a dispatch's ids are handed to their sinks and before `collected` counts them: an
        # engine whose sinks buffer (AsyncEngine's outbox) posts them here, so that a reader on the event
        # loop that sees the count has their events queued ahead of it (Kyutai's markers count on it).
        self.hand_off_barrier: typing.Callable[[], None] | None = None
        slot_shape = (model_cfg.mel_frames_per_token, model_cfg.encoder.num_mel_bins)
        self.rows = StreamRows(self.cache.specs, slot_shape, TOKEN_BUFFER + max(engine_cfg.realtime_step_buckets))
        self._text_table = _text_id_table(tokenizer)
        self.prefix = PrefixCache(self.cache, model_cfg, engine_cfg.cache_silent_prefix)

    # -- start-up -------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        impl = self.cfg.attention_impl
        enc = self.cache.specs["encoder"].pages_per_window
        dec = self.cache.specs["decoder"].pages_per_window

        decode = functools.partial(steps.realtime_decode_step, eos_id=self.eos_id, attention_impl=impl)
        prefill = functools.partial(steps.realtime_prefill_step, attention_impl=impl)
        cfg = self.model_cfg
        runs = []  # (key, batch, decoder lengths): every program's first runs, once all are compiled
        windows = (cfg.encoder.sliding_window, cfg.text.attention_window, cfg.downsample_factor)
        decode_lengths = first_runs.decode_lengths(*windows)
        for rows in self.cfg.decode_batch_buckets:
            for k in self.cfg.realtime_step_buckets:
                batch = steps.realtime_batch(rows, k, cfg, enc, dec, with_tokens=False)
                self.programs.compile(("decode", rows, k), decode, batch)
                runs.append((("decode", rows, k), dict(batch, num_slots=np.full(rows, k, np.int32)), decode_lengths))
        longest_prompt = prompt_length(n_delay_from_ms(max(ALLOWED_DELAYS_MS)), cfg.n_left_pad_tokens)
        for rows, chunk in self.prefill_buckets:
            batch = steps.realtime_batch(rows, chunk, cfg, enc, dec, with_tokens=True,
                                         prefix_pages=self.prefix.pages_per_row)
            self.programs.compile(("prefill", rows, chunk), prefill, batch)
            runs.append((("prefill", rows, chunk), dict(batch, num_slots=np.full(rows, chunk, np.int32)),
                         first_runs.prefill_lengths(self.prefix.slots, longest_prompt, chunk, *windows)))
        for key, batch, lengths in runs:  # padding slot rows (-1): no session's per-slot state changes
            first_runs.run_once_per_bucket(self.programs, key, batch, lengths,
                                           tables={"encoder": "enc_table", "decoder": "dec_table"},
                                           length_key="dec_lengths")
        self.cache.warm_up()
        self.prefix.build(self.programs, self.prefill_buckets)

    def state_reset(self) -> None:
        self.prefix.build(self.programs, self.prefill_buckets)

    # -- commands (engine thread) ---------------------------------------------------------------------
    def add_session(self, request_id: str, *, n_delay: int, prompt_ids, sink, backlog,
                    max_slots: int | None = None) -> None:
        """`sink` receives the stream's `GeneratedIds` (a `transcript_sink` makes them events), `PROGRESS` and
        its error. `max_slots`: the most mel slots the stream can have (prompt and end padding included), or
        None for a stream of any length; admission commits pages for that many (see `admit`)."""
        self._arrivals += 1
        session = RealtimeSession(request_id, sink, self.rows, n_delay=n_delay, prompt_ids=prompt_ids,
                                  backlog=backlog, arrival=self._arrivals, max_slots=max_slots,
                                  commitment=self._commitment(max_slots))
        # The stream starts after the cached prefix: its slots are dropped on arrival, never computed.
        rows, row = self.rows, session.row
        session.skip = rows.fed[row] = rows.received[row] = rows.collected[row] = self.prefix.slots
        # Slots consumed: those dispatched (`fed`, which starts past the prefix) and the prefix's dropped;
        # slots collected: those whose generated ids are collected, counted the same way.
        backlog.attach(lambda: int(rows.fed[row]) - session.skip, lambda: int(rows.collected[row]) - session.skip,
                       self._waiting, session)
        self.sessions[request_id] = session
        self.touch(session)

    def add_audio(self, request_id: str, mel_slots: np.ndarray, samples: float, total_slots=None) -> None:
        self.add_audio_many([(request_id, mel_slots, samples, total_slots)])

    def add_audio_many(self, appends) -> None:
        """Applies appends `(request_id, mel slots, samples, total slots or None)` of any sessions, in order.
        The engine thread hands it every append queued since its last tick: per append the Python is a
        lookup and a few checks; the slots are stored, and the sessions touched, as arrays in one go."""
        rows = self.rows
        owners, parts, finished = [], [], []
        pending: dict[int, int] = {}  # slots of this call not stored yet, per row with an audio limit
        for request_id, mel_slots, samples, total_slots in appends:
            session = self.sessions.get(request_id)
            if session is None:
                continue
            if session.skip:
                dropped = min(session.skip, len(mel_slots))
                session.skip -= dropped
                mel_slots = mel_slots[dropped:]
            row = session.row
            if session.max_slots is not None:
                held = pending.get(row, 0) + len(mel_slots)
                if rows.received[row] + held > session.max_slots:
                    # The caller checks the session's audio limit; past it, its pages were never committed.
                    self._store_audio(owners, parts)  # the session's earlier appends, before its row is freed
                    owners, parts, pending = [], [], {}
                    self.fail(session, InvalidRequestError(f"session {request_id}: more audio than its limit"))
                    continue
                pending[row] = held
            owners.append(row)
            parts.append(np.asarray(mel_slots, np.float32))
            session.samples += samples
            if total_slots is not None:
                rows.limit[row] = total_slots - 1
                finished.append(session)
        self._store_audio(owners, parts)
        for session in finished:
            if session.row is not None and self._input_consumed(session):
                self._done(session)

    def _store_audio(self, owners: list[int], parts: list[np.ndarray]) -> None:
        if owners:
            owners = np.array(owners)
            self.rows.store_audio(owners, parts)
            # Touched in append order; a row appended to twice keeps its later (larger) clock value.
            np.maximum.at(self.rows.last_active, owners, self.next_clock(owners.size) + np.arange(owners.size))

    @staticmethod
    def _input_consumed(session: RealtimeSession) -> bool:
        """Finished input, every position fed, and every dispatched token collected."""
        last = session.last_position
        return last is not None and session.fed >= last and session.in_flight == 0

    def abort(self, request_id: str) -> None:
        session = self.sessions.get(request_id)
        if session is not None:
            self.release(session)
            deliver(session, None)

    def release(self, session: RealtimeSession) -> None:
        if session.resident:
            self._commit(session, -1)
        super().release(session)
        session.backlog.detach()
        self.rows.detach(session)

    def at_baseline(self) -> bool:
        return super().at_baseline() and self.rows.mel.num_held == 0 and not any(self._committed.values())

    def has_work(self) -> bool:
        return bool(self._in_flight) or bool(self._feedable().any())

    def _feedable(self) -> np.ndarray:
        """Slots each row can dispatch now (0 for free rows): its queued audio up to its last position; a
        prompt is prefilled in one go once all its slots are here."""
        rows = self.rows
        fed, prompt = rows.fed, rows.prompt_len
        count = np.minimum(rows.received, rows.limit) - fed
        count[(fed < prompt) & (count < prompt - fed)] = 0
        return np.maximum(count, 0)

    # -- one tick -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One tick, pipelined: dispatch this tick's programs, then collect the previous tick's tokens while
        the device runs (nothing the host schedules depends on them: feedback stays on the device).
        Returns False when there was nothing to dispatch or collect."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.tick += 1
        scheduled: list[Dispatch] = []
        try:
            self._schedule(scheduled)
        except BaseException:  # e.g. an eviction's host copy failed: nothing booked may stay held
            self._drop_in_flight(scheduled)
            raise
        # A tick that held its decoding streams back for a batch (`_hold`) dispatched nothing, but they advance
        # in a moment: not a tick where no stream can advance.
        self.end_starvation(busy=bool(self._in_flight) or self.held_until is not None,
                            dispatched=bool(scheduled))
        dispatched, self._device_call_cpu = [], 0.0
        try:
            for dispatch in scheduled:
                batch = self._batch(dispatch)
                call_start = time.thread_time()
                dispatch.outputs = self.programs.run(dispatch.key, batch)
                self._device_call_cpu += time.thread_time() - call_start
                dispatched.append(dispatch)
        except Exception as exc:  # noqa: BLE001 - a failed dispatch ends the sessions it carried
            sessions = self._sessions_of(scheduled)
            self._drop_in_flight(scheduled)
            self.dispatch_failed(sessions, exc)
            dispatched = []
        previous, self._in_flight = self._in_flight, dispatched
        waited = self._collect(previous)
        elapsed, cpu = time.perf_counter() - start + self._uncollected[0], time.thread_time() - cpu_start
        cpu += self._uncollected[1]
        device_call_cpu = self._device_call_cpu + self._uncollected[2]
        if not previous:
            # A tick's record is made when its batch is collected; a call that collected nothing (it only
            # dispatched, after a held-back tick, or it held back) counts toward the next one.
            self._uncollected = (elapsed, cpu, device_call_cpu)
            return bool(dispatched)
        self._uncollected = (0.0, 0.0, 0.0)
        self.record_tick(TickStats(sum(len(d.rows) for d in previous), sum(int(d.counts.sum()) for d in previous),
                                   elapsed, waited, cpu, device_call_cpu))
        return True

    def _sessions_of(self, dispatches) -> list[RealtimeSession]:
        """The sessions still holding the rows of `dispatches`."""
        rows = self.rows
        return [rows.sessions[row] for d in dispatches
                for row in d.rows[rows.generation[d.rows] == d.generations].tolist()]

    def _drop_in_flight(self, dispatches) -> None:
        """Dispatches that were collected or failed (run or not): their rows' in-flight counts drop, and their
        slab blocks are freed (the device may still read them until the fetch that follows returns, but the
        slab is only written by `add_audio_many`, between ticks)."""
        rows = self.rows
        for d in dispatches:
            rows.in_flight[d.rows[rows.generation[d.rows] == d.generations]] -= 1
            rows.mel.release(d.blocks.ravel())

    def _collect(self, dispatched: list[Dispatch]) -> float:
        """Fetches a dispatched tick's tokens and streams them; returns the seconds spent waiting."""
        if not dispatched:
            return 0.0
        self._drop_in_flight(dispatched)
        call_start = time.thread_time()
        try:
            fetched, waited = self.fetch([d.outputs for d in dispatched])
        except Exception as exc:  # noqa: BLE001 - the device failed while running these sessions
            self.dispatch_failed(self._sessions_of(dispatched), exc)
            return 0.0
        finally:
            self._device_call_cpu += time.thread_time() - call_start
        now = time.perf_counter()
        for dispatch, out in zip(dispatched, fetched):
            self._advance(dispatch, np.asarray(out["tokens"]), np.asarray(out["logprobs"]), now)
        return waited

    def _schedule(self, scheduled: list[Dispatch]) -> None:
        """Books this tick's dispatches into `scheduled` (the caller's, so it can free them if a later
        placement raises)."""
        rows = self.rows
        self.held_until = None
        ready = self._feedable()
        resident = rows.slot >= 0
        rows.status[resident & (ready == 0) & (rows.status != PARKED)] = PARKED
        self.begin_tick()
        candidates = np.flatnonzero(ready)
        if not candidates.size:
            return
        if self.demand:  # strictly by arrival: an evicted older stream comes back before newer ones run
            candidates = candidates[np.argsort(rows.arrival[candidates], kind="stable")]
        else:  # resident sessions first (they hold slots and pages), then the others in arrival order
            candidates = candidates[np.lexsort((rows.arrival[candidates], ~resident[candidates]))]
        decoding = rows.fed[candidates] >= rows.prompt_len[candidates]
        decode = candidates[decoding]
        if decode.size and self._hold(decode, ready, resident):
            decode = decode[:0]
        if decode.size:
            steps_k = self._steps_bucket(ready[decode])
            decode = decode[: self.cfg.decode_batch_buckets[-1]]
            decode, counts = self._place(decode, np.minimum(ready[decode], steps_k))
            if decode.size:
                # Rows in the order of their next slot's slab block: a tick's slots are stored as one
                # ascending run, so the batch's mel is then a view of the slab (MelSlab.batch), not a copy.
                order = np.argsort(rows.ring[decode, rows.fed[decode] % rows.ring.shape[1]], kind="stable")
                decode, counts = decode[order], counts[order]
                batch_rows = next(b for b in self.cfg.decode_batch_buckets if b >= decode.size)
                scheduled.append(self._book(("decode", batch_rows, steps_k), decode, counts))
        prefill = candidates[~decoding]
        if prefill.size:
            remaining = rows.prompt_len[prefill] - rows.fed[prefill]
            batch_rows, chunk = max(self.prefill_buckets, key=lambda b: (
                int(np.minimum(remaining[: b[0]], b[1]).sum()), -b[0] * b[1]))
            prefill, counts = self._place(prefill[:batch_rows], np.minimum(remaining[:batch_rows], chunk))
            if prefill.size:
                scheduled.append(self._book(("prefill", batch_rows, chunk), prefill, counts))

    def _hold(self, decode: np.ndarray, ready: np.ndarray, resident: np.ndarray) -> bool:
        """Whether `decode` (rows with audio here, none behind) waits for the paced streams whose next slot
        is due, so that one dispatch carries them all: until they are all here, or until
        `realtime_batch_wait_ms` after the oldest waiting slot arrived (`held_until`). Only a busy device
        waits (its last tick took half a slot or more): one with time to spare dispatches at once."""
        wait = self.cfg.realtime_batch_wait_ms / 1e3
        if not wait or decode.size >= self.cfg.decode_batch_buckets[-1] or ready[decode].max() > 1:
            return False
        last = self.tick_stats.durations(self.ticks_recorded - 1, self.ticks_recorded)
        if not last or last[0] < SLOT_SECONDS / 2:
            return False
        rows = self.rows
        now = time.perf_counter()
        deadline = float(rows.mel.arrived[rows.ring[decode, rows.fed[decode] % rows.ring.shape[1]]].min()) + wait
        if now >= deadline:
            return False
        # Streams running at real time whose next slot is due: decoding, input not finished, and audio
        # within the last slot and a half (a client's chunks are seldom exactly 80 ms apart).
        due = (resident & (ready == 0) & (rows.fed >= rows.prompt_len) & (rows.limit == UNKNOWN_LIMIT)
               & (now - rows.last_arrival < 1.5 * SLOT_SECONDS))
        if not due.any():
            return False
        self.held_until = deadline
        return True

    def _steps_bucket(self, counts: np.ndarray) -> int:
        """K maximising useful steps per cost (K steps plus about one step of fixed dispatch cost)."""
        return max(self.cfg.realtime_step_buckets,
                   key=lambda k: (int(np.minimum(counts, k).sum()) / (k + 1), k))

    def _spans(self, fed, counts) -> dict:
        """Positions the next `counts` slots from `fed` write, with the cached prefix a first prefill copies."""
        frames = self.model_cfg.downsample_factor
        start = fed
        if self.prefix.slots:
            start = np.where(np.asarray(fed) == self.prefix.slots, 0, fed)
            start = int(start) if start.ndim == 0 else start
        return {"encoder": (frames * start, frames * (fed + counts)), "decoder": (start, fed + counts)}

    def _place(self, candidates: np.ndarray, counts: np.ndarray):
        """Admits the rows (in order) and reserves pages for their next `counts` slots; returns the rows
        placed and their counts (the others wait). Placed sessions are RUNNING, so the parked sessions an
        admission or a page shortage evicts are never among them."""
        rows = self.rows
        resident = rows.slot[candidates] >= 0
        which = np.flatnonzero(resident)
        holes = self._holes(candidates[which], counts[which])
        fits = all(self.cache.pools[name].num_free >= len(logical) for name, (_, logical) in holes.items())
        if self.demand and not (fits and resident.all()):
            missing = np.zeros(len(candidates), bool)
            missing[which[np.concatenate([index for index, _ in holes.values()])]] = True
            placed = self.place_in_arrival_order(candidates, counts, missing)
            self._touch_rows(candidates[placed])
            return candidates[placed], counts[placed]
        placed = np.zeros(len(candidates), bool)
        placed[which] = self._reserve_resident(candidates[which], counts[which], holes, fits)
        running = candidates[placed]
        rows.status[running] = RUNNING  # before any admission below may evict parked sessions
        self._touch_rows(running)
        for i in np.flatnonzero(~resident).tolist():
            session = rows.sessions[candidates[i]]
            if self.admit(session) and self.reserve(session, self._spans(session.fed, int(counts[i]))):
                placed[i] = True
                session.status = Status.RUNNING
                self.touch(session)
        return candidates[placed], counts[placed]

    def _touch_rows(self, placed: np.ndarray) -> None:
        self.rows.last_active[placed] = self.next_clock(placed.size) + np.arange(placed.size)
        if self.demand:
            self._placed[placed] = True

    def _holes(self, resident: np.ndarray, counts: np.ndarray) -> dict:
        """Per pool, (index into `resident`, logical page) of every page their next `counts` slots need."""
        spans = self._spans(self.rows.fed[resident], counts)
        return {name: missing_pages(self.cache.specs[name], self.rows.tables[name][resident], *span)
                for name, span in spans.items()}

    def _reserve_resident(self, resident: np.ndarray, counts: np.ndarray, holes: dict, fits: bool) -> np.ndarray:
        """Pages for the resident candidates, allocated together: window admission committed a window of every
        pool to each resident session, so the pools can always serve them (a shortage takes the one-by-one
        path of `Residency.reserve`, which may evict). Returns which of them got their pages."""
        rows = self.rows
        ok = np.ones(len(resident), bool)
        if fits:
            for name, (index, logical) in holes.items():
                if len(logical):
                    rows.tables[name][resident[index], logical] = self.cache.pools[name].allocate(len(logical))
            return ok
        for i in np.unique(np.concatenate([index for index, _ in holes.values()])).tolist():
            session = rows.sessions[resident[i]]
            ok[i] = self.reserve(session, self._spans(session.fed, int(counts[i])))
        return ok

    def _book(self, key, chosen: np.ndarray, counts: np.ndarray) -> Dispatch:
        """Books the slots of the chosen rows (and their slab blocks) into the tick being built."""
        rows = self.rows
        starts = rows.fed[chosen].copy()
        blocks = rows.queued_blocks(chosen, starts, counts, key[2])
        rows.fed[chosen] += counts
        rows.in_flight[chosen] += 1
        return Dispatch(key, chosen, rows.generation[chosen].copy(), starts, counts, blocks=blocks)

    def _batch(self, dispatch: Dispatch):
        """The dispatch's batch, gathered from the rows (padding rows read row 0: slot -1, no slots)."""
        rows = self.rows
        _, num_rows, num_slots = dispatch.key
        used = len(dispatch.rows)
        index = np.zeros(num_rows, np.int64)
        index[:used] = dispatch.rows
        counts = np.zeros(num_rows, np.int64)
        counts[:used] = dispatch.counts
        starts = np.zeros(num_rows, np.int64)
        starts[:used] = dispatch.starts
        blocks = np.zeros((num_rows, num_slots), np.int64)
        blocks[:used] = dispatch.blocks
        mel = rows.mel.batch(blocks, used)
        dispatch.arrived = rows.mel.arrived[dispatch.blocks]
        batch = {
            "slot": rows.slot[index],
            "mel": mel.reshape(num_rows, num_slots * mel.shape[2], mel.shape[3]),
            "num_slots": counts.astype(np.int32),
            "enc_table": rows.tables["encoder"][index],
            "dec_table": rows.tables["decoder"][index],
            "dec_lengths": starts.astype(np.int32),
            "n_delay": rows.n_delay[index],
        }
        sessions = rows.sessions
        if dispatch.prefill:
            batch["token_ids"] = np.zeros((num_rows, num_slots), np.int32)
            self.prefix.fill(batch, dispatch.starts, rows.tables["encoder"][dispatch.rows],
                             rows.tables["decoder"][dispatch.rows], rows.n_delay[dispatch.rows])
            for i, (row, start, count) in enumerate(zip(dispatch.rows.tolist(), dispatch.starts.tolist(),
                                                        dispatch.counts.tolist())):
                batch["token_ids"][i, :count] = sessions[row].prompt_ids[start : start + count]
        if self._waiting:  # appenders waiting for room: wake those whose audio this dispatch consumes
            booked = set(dispatch.rows.tolist())
            for backlog in tuple(self._waiting):
                stream = backlog.stream  # None for one the event loop added as its stream was ending
                if stream is not None and stream.row in booked:
                    deliver(stream, PROGRESS)
        return batch

    # -- results --------------------------------------------------------------------------------------
    def _advance(self, dispatch: Dispatch, tokens: np.ndarray, logprobs: np.ndarray, now: float) -> None:
        """Buffers a dispatch's generated ids, records their latency, and streams text and ends; Python runs
        only for the rows with text, an end, or a full buffer."""
        rows = self.rows
        used = len(dispatch.rows)
        alive = rows.generation[dispatch.rows] == dispatch.generations
        if dispatch.prefill:  # one id, sampled after the prompt's last slot once the whole prompt is in
            eligible = alive & (dispatch.starts + dispatch.counts >= rows.prompt_len[dispatch.rows])
            tokens, logprobs = tokens[:used, None], logprobs[:used, None]
            arrived = dispatch.arrived[np.arange(used), dispatch.counts - 1][:, None]
            produced = eligible.astype(np.int64)
        else:
            eligible = alive
            tokens, logprobs = tokens[:used], logprobs[:used]
            arrived = dispatch.arrived
            produced = np.where(alive, (tokens >= 0).sum(axis=1), 0)
        valid = np.arange(tokens.shape[1]) < produced[:, None]
        self.token_latency.record(now - arrived[valid])
        rows.buffer_tokens(dispatch.rows, tokens, logprobs, produced)
        text = valid & self._is_text(tokens)
        ended = (valid & (tokens == self.eos_id)).any(axis=1) | (
            (rows.fed[dispatch.rows] >= rows.limit[dispatch.rows]) & (rows.in_flight[dispatch.rows] == 0))
        busy = np.flatnonzero(eligible & (text.any(axis=1) | ended | (rows.buffered[dispatch.rows] >= TOKEN_BUFFER)))
        busy_rows = dispatch.rows[busy]
        taken = rows.take_tokens(busy_rows)
        sessions = rows.sessions
        for row, (ids, logprobs), end in zip(busy_rows.tolist(), taken, ended[busy].tolist()):
            session = sessions[row]
            if end:
                self._done(session, ids, logprobs)
            else:
                deliver(session, GeneratedIds(ids, logprobs, session.samples, False))
        # Counted after the hand-offs above are queued: a consumer that sees the count sees their ids next.
        if busy.size and self.hand_off_barrier is not None:
            self.hand_off_barrier()
        live = rows.generation[dispatch.rows] == dispatch.generations
        rows.collected[dispatch.rows[live]] = (dispatch.starts + dispatch.counts)[live]

    def _is_text(self, tokens: np.ndarray) -> np.ndarray:
        """Ids that may decode to text (control ids decode to nothing; out-of-vocabulary ids count, so the
        detokenizer rejects them)."""
        if self._text_table is None:
            return tokens >= NUM_CONTROL_IDS
        size = len(self._text_table)
        return (tokens >= size) | self._text_table[np.clip(tokens, 0, size - 1)]

    def _done(self, session: RealtimeSession, ids=None, logprobs=None) -> None:
        """Ends a stream whose input is all consumed or whose model ended it: hands over its last ids (those
        left in its row's buffer unless given) with the end, and frees it."""
        if ids is None:
            [(ids, logprobs)] = self.rows.take_tokens(np.array([session.row]))
        deliver(session, GeneratedIds(ids, logprobs, session.samples, True))
        # Every position the stream has is collected (its end is handed on above); its backlog keeps that.
        self.rows.collected[session.row] = session.fed
        self.release(session)


def _text_id_table(tokenizer) -> np.ndarray | None:
    """Which ids are text, for tokenizers whose control ids are not simply those below `NUM_CONTROL_IDS`."""
    if type(tokenizer).is_control is Tokenizer.is_control:
        return None
    return np.array([not tokenizer.is_control(i) for i in range(tokenizer.vocab_size)], bool)
