"""Which transcription streams hold the device's KV pages, and which give way when the pools run short.

A transcription stream cannot recompute its KV (its audio is gone), so two growing streams that each hold
part of a pool could wait for each other forever. `EngineConfig.realtime_admission` picks how that is
avoided:

* `"window"`: admission commits to each stream, in every pool, the pages of its whole window (or of its
  whole length when it has an audio limit and that is shorter). Every resident stream can always grow to its
  largest size; a stream that finds the pools committed waits, after idle parked streams (and parked ones that
  arrived after it) are evicted. Safe and simple, but a stream is charged its whole window from its first
  slot: 1.07 GB for Voxtral Realtime 4B in bfloat16, while a one-minute turn uses 0.28 GB of it and a 10 s
  one 0.07 GB.
* `"demand"` (the default): nothing is committed; pages are taken as streams grow, so as many streams run at
  once as their actual lengths fit. When a stream finds no free page, streams give way in this order: parked
  streams idle for `IDLE_SECONDS` or more (least recently active first), then resident streams that arrived
  after it and are not in this tick's batch (newest first). Each moves to host memory (`host_offload_bytes`)
  and comes back bit for bit when pages free up. Streams are placed in arrival order, so the oldest stream
  always advances (no livelock): a stream that finds no page (or cannot come back from host memory) keeps
  newer streams from taking pages, and if host memory refuses its victims for `STARVED_SECONDS`, newer
  streams stop running until one gives way (below).

Under both, a stream never displaces an older one that is still streaming, so two paced streams never take
turns evicting each other every 80 ms. Under demand admission, when host memory is full too and a stream
cannot advance, the newest stream on the device ends with `CapacityError` rather than the older one waiting
as long as the newer ones run (or every stream waiting forever).
"""
import logging
import time

import numpy as np

from jaxstream.engine.residency import Residency, Status
from jaxstream.engine.stream_rows import STATUS_CODE
from jaxstream.errors import CapacityError

logger = logging.getLogger(__name__)
# A parked stream with no audio for this long is idle, not between the chunks of a paced stream: any
# stream may displace it.
IDLE_SECONDS = 1.0
# A stream starved while host memory refuses the newer streams that could give it pages waits this long for
# one of them to end or pause on its own; then they stop running, and the newest one ends.
STARVED_SECONDS = 1.0
PARKED = STATUS_CODE[Status.PARKED]


def stream_pages(specs, max_slots: int | None, downsample_factor: int) -> dict[str, int]:
    """The most pages of each pool (`specs`: the encoder and decoder stacks by name) that a stream of at most
    `max_slots` decoder slots holds (None: any length, its whole windows); its encoder holds `downsample_factor`
    frames a slot."""
    positions = {"decoder": max_slots, "encoder": None if max_slots is None else max_slots * downsample_factor}
    return {name: spec.pages_per_window if positions[name] is None
            else min(spec.pages_per_window, -(-positions[name] // spec.page_size))
            for name, spec in specs.items()}


class RealtimeAdmission(Residency):
    """Admission, commitments and victims of `RealtimeScheduler` (which owns `rows`, `model_cfg` and the
    placing of each tick's rows)."""

    def __init__(self, programs, engine_cfg):
        super().__init__(programs, engine_cfg.host_offload_bytes)
        self.demand = engine_cfg.realtime_admission == "demand"
        self._committed = {name: 0 for name in self.cache.specs}  # the resident sessions' commitments
        # Demand admission, this tick: rows given pages (never victims) and rows moved off the device (not
        # brought back in the same tick); starved rows that found no page; whether host memory refused a victim.
        self._placed = np.zeros(0, bool)
        self._preempted: set[int] = set()
        self._starved: list[int] = []
        self._host_full = False
        self._starved_since: float | None = None  # when host-full starvation began (across ticks)
        self._held_newer = False  # this tick kept newer streams from running for a starved one

    def begin_tick(self) -> None:
        """Forgets the previous tick's placements (the scheduler calls it before placing a tick's rows)."""
        if self.demand:
            self._placed = np.zeros(len(self.rows.slot), bool)
            self._preempted.clear()
            self._starved.clear()
            self._host_full = False
            self._held_newer = False

    # -- admission ------------------------------------------------------------------------------------
    def admit(self, session) -> bool:
        """A slot for the session (restoring it when evicted), and under window admission its commitment:
        the pages of its whole window, or of its whole stream when it has a length limit and that is
        shorter (pages are still assigned as the stream grows)."""
        if session.resident:
            return True
        while not self._commitment_fits(session):
            if not self.evict_for(session):
                return False
        if not super().admit(session):
            return False
        self._commit(session, +1)
        return True

    def _commitment(self, max_slots: int | None) -> dict[str, int]:
        """Pages per pool admission commits to a stream of at most `max_slots` slots (None: any length)."""
        if self.demand:
            return {name: 0 for name in self.cache.specs}
        return stream_pages(self.cache.specs, max_slots, self.model_cfg.downsample_factor)

    def _commitment_fits(self, session) -> bool:
        return all(self._committed[name] + session.commitment[name] <= self.cache.pools[name].capacity
                   for name in self.cache.specs)

    def _commit(self, session, sign: int) -> None:
        for name, pages in session.commitment.items():
            self._committed[name] += sign * pages

    def evict(self, session) -> bool:
        evicted = super().evict(session)
        if evicted:
            self._commit(session, -1)
            if self.demand:
                self._preempted.add(session.row)
                if session.status is Status.RUNNING:
                    session.status = Status.WAITING
        else:
            self._host_full = True  # a transcription stream moves only to host memory
        return evicted

    # -- victims --------------------------------------------------------------------------------------
    def evict_for(self, requester, protect=()) -> bool:
        return any(self.evict(victim) for victim in self._victims(requester, protect))

    def _victims(self, requester, protect):
        """The streams that may give way to `requester`, in order (a generator: each is tried when the one
        before it could not be evicted): parked streams idle for `IDLE_SECONDS`, least recently active first,
        then streams that arrived after it, newest first; under window admission only parked ones (a
        committed stream is never preempted), under demand admission any not in this tick's batch. A parked
        stream that is still streaming (its next chunk due) never gives way to a newer one: under window
        admission it once did, and paced streams that did not all fit took turns through host memory every
        80 ms (316 evictions for 8 four-second streams in pools for two)."""
        rows = self.rows
        allowed = rows.slot >= 0
        if self.demand:
            allowed &= ~self._placed
        for session in (requester, *protect):
            if session.row is not None:
                allowed[session.row] = False
        parked = rows.status == PARKED
        idle = allowed & parked & (time.perf_counter() - rows.last_arrival >= IDLE_SECONDS)
        newer = allowed & ~idle & (rows.arrival > rows.arrival[requester.row])
        if not self.demand:
            newer &= parked
        order = list(np.flatnonzero(idle)[np.argsort(rows.last_active[idle], kind="stable")])
        order += list(np.flatnonzero(newer)[np.argsort(-rows.arrival[newer], kind="stable")])
        for row in order:
            session = rows.sessions[row]
            if session.resident:
                yield session

    # -- placing (demand) -----------------------------------------------------------------------------
    def place_in_arrival_order(self, candidates: np.ndarray, counts: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Demand admission: admits and reserves for `candidates` (in arrival order) one by one; `missing`
        marks the resident ones whose next slots need new pages. Returns the placed mask."""
        rows = self.rows
        placed = np.zeros(len(candidates), bool)
        hold = self._starved_since is not None and time.perf_counter() - self._starved_since >= STARVED_SECONDS
        for i, row in enumerate(candidates.tolist()):
            session = rows.sessions[row]
            if row in self._preempted:
                continue  # moved off the device by an older stream this tick
            if hold and self._host_full and self._older_starved(row):
                # An older stream has waited STARVED_SECONDS with nowhere to move its victims: the newer ones
                # stop, so that the newest of them can end (`end_starvation`) without a batch that holds it.
                self._held_newer = True
                continue
            if session.resident and not missing[i]:
                placed[i] = True
            elif self._older_starved(row):
                # An older stream found no page and none of the streams it may displace could move: nor can
                # they for this newer one (its victims are a subset), so it waits without trying.
                if session.resident:
                    self._starved.append(row)
                continue
            else:
                fresh = not session.resident and session.offloaded is None
                if self.admit(session) and self.reserve(session, self._spans(session.fed, int(counts[i]))):
                    placed[i] = True
                elif fresh and session.resident:
                    # A new stream has computed nothing: its slot goes back at once, rather than it holding the
                    # slot and being moved to host memory by the next older stream that needs a page.
                    self.cache.release_slot(session.slot)
                    session.slot = None
                elif not fresh:  # on the device and short of a page, or in host memory with no way back
                    self._starved.append(row)
            if placed[i]:
                self._placed[row] = True  # at once: the streams after it must not displace it
                session.status = Status.RUNNING
        return placed

    def _older_starved(self, row: int) -> bool:
        """Whether a stream that arrived before `row` found no page this tick. Each call places its candidates
        in arrival order, but a tick places the decoding streams and then the prefilling ones in two calls: a
        newer decoding stream that starved must not stop an older prefilling one, which may displace it (the
        two then waited for each other for ever)."""
        arrival = self.rows.arrival
        return any(arrival[starved] < arrival[row] for starved in self._starved)

    def end_starvation(self, busy: bool, dispatched: bool) -> None:
        """Demand admission, after each tick's placement: when streams found no page (or no way back from
        host memory) and host memory refused the streams that could have given theirs up, the newest stream
        on the device that arrived after the oldest starved one ends with `CapacityError`, so that the older
        ones go on. That happens once the tick dispatched nothing and nothing is in flight (no stream can
        advance), or once the newer streams were held back for a starved one (`STARVED_SECONDS`): the newest
        may be one with no audio this tick, or one wrapping on its own pages that never asks for more. (Without
        a refusal a starved stream waits: the streams ahead of it end, or go idle and become movable.)"""
        if not self.demand or not self._starved or not self._host_full:
            self._starved_since = None
            return
        if self._starved_since is None:
            self._starved_since = time.perf_counter()
        idle = not busy and not dispatched
        if not idle and not self._held_newer:
            return
        rows = self.rows
        oldest = min(rows.arrival[r] for r in self._starved)
        on_device = rows.slot >= 0
        newer = np.flatnonzero(on_device & (rows.arrival > oldest) & ~self._placed)
        if not newer.size and idle:  # no newer stream holds pages: the oldest starved one itself ends
            newer = np.flatnonzero(on_device & (rows.arrival >= oldest))
        if not newer.size:
            return  # the starved streams are in host memory: they wait for the older streams
        row = int(newer[np.argmax(rows.arrival[newer])])
        session = rows.sessions[row]
        logger.warning("session %s: no KV page for it and none can be freed (host memory full): ending it",
                       session.request_id)
        self.fail(session, CapacityError(
            f"session {session.request_id}: the device's KV pages and the host memory for evicted streams "
            "are full"))
