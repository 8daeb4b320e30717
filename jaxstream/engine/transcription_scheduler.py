"""Scheduler of realtime transcription sessions over Voxtral Realtime (delayed-streams decoding).

A session's decoder position p is fed the token sampled at p - 1 plus the audio embedding of 80 ms slot p
(`specs/voxtral_realtime.md` §4). Positions 0..prompt_len-1 are the prompt (BOS + 32 left-pad + n_delay
`[STREAMING_PAD]`), prefilled with the first prompt_len slots; then every slot of audio runs one decoder
step. The sampled token stays on the device (`last_token` slot row) and is fed back there, so a dispatch
can run up to K steps per session when audio is queued (catch-up) and the host only reads tokens back to
stream them. At the end of the stream (right padding appended by the front end) positions up to
total_slots - 2 are fed, as in Hugging Face `generate`; an end-of-text token ends the session earlier.

Both rings wrap (encoder W = 750 frames, decoder W = 8192 tokens), so a stream of any length runs in
bounded memory; RoPE positions are absolute and exact (models/layers.py).
"""
import collections
import itertools
import logging
import time

import numpy as np

from jaxstream.engine import steps
from jaxstream.engine.residency import Residency, SessionBase, Status, TickStats, deliver
from jaxstream.engine.transcription_session import (
    PROGRESS, TranscriptionDelta, TranscriptionDone, TranscriptionUsage, to_ms, token_time, word_timings,
)
from jaxstream.models.audio import SAMPLING_RATE

logger = logging.getLogger(__name__)


class RealtimeSession(SessionBase):
    def __init__(self, request_id, sink, pages, *, n_delay: int, delay_ms: int, prompt_ids, decoder, backlog):
        super().__init__(request_id, sink, pages)
        self.backlog = backlog  # transcription_session.AudioBacklog: this thread writes `consumed` only
        self.n_delay = n_delay
        self.delay_ms = delay_ms
        self.prompt_ids = list(prompt_ids)
        self.mel: collections.deque[np.ndarray] = collections.deque()  # queued slots, each [8, n_mel]
        self.fed = 0  # decoder positions dispatched (= audio slots consumed)
        self.in_flight = 0  # dispatches whose tokens are not collected yet
        self.total_slots: int | None = None  # known once the input is finished
        self.samples = 0.0  # real audio received, in 16 kHz samples
        self.generated: list[int] = []
        self.undelivered: list[int] = []  # ids not yet carried by a delta
        self.decoder = decoder
        self.text = ""
        self.arrival = 0  # order of creation, for FIFO admission

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def last_position(self) -> int | None:
        """One past the last position to feed (the last audio slot is never fed, as in HF generate)."""
        return None if self.total_slots is None else self.total_slots - 1

    def feedable(self) -> int:
        count = len(self.mel)
        if self.last_position is not None:
            count = min(count, self.last_position - self.fed)
        if self.fed < self.prompt_len and count < self.prompt_len - self.fed:
            return 0  # the prompt is prefilled in one go once all its slots are here
        return max(count, 0)



class RealtimeScheduler(Residency):
    """Host-side scheduler of transcription sessions; `step()` runs one tick on the calling thread."""

    def __init__(self, programs: steps.Programs, engine_cfg, model_cfg, tokenizer, *, prefill_buckets):
        super().__init__(programs.cache, engine_cfg.host_offload_bytes)
        self.programs = programs
        self.cfg = engine_cfg
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.prefill_buckets = prefill_buckets
        self.eos_id = model_cfg.eos_id
        self._arrivals = itertools.count()
        self._in_flight: list = []  # the previous tick's (rows, device outputs), collected next tick

    # -- start-up -------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        impl = self.cfg.attention_impl
        enc = self.cache.specs["encoder"].pages_per_window
        dec = self.cache.specs["decoder"].pages_per_window

        def decode(model, state, batch):
            return steps.realtime_decode_step(model, state, batch, eos_id=self.eos_id, attention_impl=impl)

        def prefill(model, state, batch):
            return steps.realtime_prefill_step(model, state, batch, attention_impl=impl)

        for rows in self.cfg.decode_batch_buckets:
            for k in self.cfg.realtime_step_buckets:
                batch = steps.realtime_batch(rows, k, self.model_cfg, enc, dec, with_tokens=False)
                self.programs.compile(("decode", rows, k), decode, batch)
        for rows, chunk in self.prefill_buckets:
            batch = steps.realtime_batch(rows, chunk, self.model_cfg, enc, dec, with_tokens=True)
            self.programs.compile(("prefill", rows, chunk), prefill, batch)
        self.cache.warm_up()

    # -- commands (engine thread) ---------------------------------------------------------------------
    def add_session(self, request_id: str, *, n_delay: int, delay_ms: int, prompt_ids, sink, backlog) -> None:
        session = RealtimeSession(request_id, sink, self.cache.new_pages(), n_delay=n_delay, delay_ms=delay_ms,
                                  prompt_ids=prompt_ids, decoder=self.tokenizer.stream_decoder(), backlog=backlog)
        session.arrival = next(self._arrivals)
        self.sessions[request_id] = session
        self.touch(session)

    def add_audio(self, request_id: str, mel_slots: np.ndarray, samples: float, total_slots=None) -> None:
        session = self.sessions.get(request_id)
        if session is None:
            return
        session.mel.extend(mel_slots)
        session.samples += samples
        if total_slots is not None:
            session.total_slots = total_slots
        self.touch(session)
        if self._input_consumed(session):
            self._done(session)

    @staticmethod
    def _input_consumed(session: RealtimeSession) -> bool:
        """Finished input, every position fed, and every dispatched token collected."""
        return (session.last_position is not None and session.fed >= session.last_position
                and session.in_flight == 0)

    def abort(self, request_id: str) -> None:
        session = self.sessions.get(request_id)
        if session is not None:
            self.release(session)
            deliver(session, None)

    def has_work(self) -> bool:
        return bool(self._in_flight) or any(s.feedable() for s in self.sessions.values())

    # -- one tick -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One tick, pipelined: dispatch this tick's programs, then collect the previous tick's tokens while
        the device runs (nothing the host schedules depends on them: feedback stays on the device).
        Returns False when there was nothing to dispatch or collect."""
        start = time.perf_counter()
        self.tick += 1
        decode, prefill, steps_k, bucket = self._schedule()
        dispatched = []
        if decode or prefill:
            try:
                if decode:
                    rows = next(b for b in self.cfg.decode_batch_buckets if b >= len(decode))
                    batch = self._batch(decode, rows, steps_k, with_tokens=False)
                    dispatched.append((decode, self.programs.run(("decode", rows, steps_k), batch)))
                if prefill:
                    rows, chunk = bucket
                    batch = self._batch(prefill, rows, chunk, with_tokens=True)
                    dispatched.append((prefill, self.programs.run(("prefill", rows, chunk), batch)))
            except Exception as exc:  # noqa: BLE001 - a failed dispatch ends the sessions it carried
                self._drop_in_flight(decode + prefill)
                self.dispatch_failed([session for session, _, _ in decode + prefill], exc)
                dispatched = []
        previous, self._in_flight = self._in_flight, dispatched
        waited = self._collect(previous)
        if not previous and not dispatched:
            return False
        rows = [row for group, _ in previous for row in group]
        self.record_tick(TickStats(len(rows), sum(count for _, _, count in rows),
                                         time.perf_counter() - start, waited))
        return True

    def _collect(self, dispatched) -> float:
        """Fetches a dispatched tick's tokens and streams them; returns the seconds spent waiting."""
        if not dispatched:
            return 0.0
        rows = [row for group, _ in dispatched for row in group]
        self._drop_in_flight(rows)
        try:
            fetched, waited = self.fetch([out for _, out in dispatched])
        except Exception as exc:  # noqa: BLE001 - the device failed while running these sessions
            self.dispatch_failed([session for session, _, _ in rows], exc)
            return 0.0
        for (group, _), out in zip(dispatched, fetched):
            for i, (session, start, count) in enumerate(group):
                if self.sessions.get(session.request_id) is not session:
                    continue  # ended (EOS, abort, error) while this tick was in flight
                try:
                    self._advance(session, start + count, out["tokens"][i])
                except Exception as exc:  # noqa: BLE001 - isolate host-side failures to their session
                    logger.exception("session %s: streaming its tokens failed; ending it", session.request_id)
                    self.fail(session, exc)
        return waited

    @staticmethod
    def _drop_in_flight(rows) -> None:
        for session, _, _ in rows:
            session.in_flight -= 1

    def _schedule(self):
        # Resident sessions first (they hold slots and pages), then the others in arrival order.
        ordered = sorted(self.sessions.values(), key=lambda s: (not s.resident, s.arrival))
        ready = {}
        for session in ordered:
            count = session.feedable()
            if count:
                ready[session] = count
            elif session.resident and session.status is not Status.PARKED:
                session.status = Status.PARKED
        decode_ready = [s for s in ready if s.fed >= s.prompt_len]
        prefill_ready = [s for s in ready if s.fed < s.prompt_len]
        steps_k = self._steps_bucket([ready[s] for s in decode_ready])
        decode, scheduled = [], set()
        for session in decode_ready[: self.cfg.decode_batch_buckets[-1]]:
            count = min(ready[session], steps_k)
            if self._place(session, count, scheduled):
                decode.append((session, self._dispatched(session, count), count))
        prefill, bucket = [], None
        if prefill_ready:
            bucket = max(self.prefill_buckets, key=lambda b: (
                sum(min(s.prompt_len - s.fed, b[1]) for s in prefill_ready[: b[0]]), -b[0] * b[1]))
            rows, chunk = bucket
            for session in prefill_ready[:rows]:
                count = min(session.prompt_len - session.fed, chunk)
                if self._place(session, count, scheduled):
                    prefill.append((session, self._dispatched(session, count), count))
        return decode, prefill, steps_k, bucket

    def _steps_bucket(self, counts) -> int:
        """K maximising useful steps per cost (K steps plus about one step of fixed dispatch cost)."""
        buckets = self.cfg.realtime_step_buckets
        return max(buckets, key=lambda k: (sum(min(c, k) for c in counts) / (k + 1), k))

    def admit(self, session: RealtimeSession) -> bool:
        """Admission commits a whole window of every pool to the session (pages are still assigned as the
        stream grows). A transcription session cannot give its KV back (its audio is gone), so without the
        commitment two growing streams could each hold part of the pool and wait for each other forever;
        with it, every resident stream can always reach its full window, and the rest wait their turn."""
        if session.resident:
            return True
        while not self._window_fits():
            if not self.evict_one_parked(protect=(session,)):
                return False
        return super().admit(session)

    def _window_fits(self) -> bool:
        """One more resident session's full windows fit beside those of the resident ones."""
        resident = self.num_resident
        return all((resident + 1) * spec.pages_per_window <= self.cache.pools[name].capacity
                   for name, spec in self.cache.specs.items())

    def _place(self, session: RealtimeSession, count: int, scheduled: set) -> bool:
        """Admits the session and reserves pages for its next `count` slots (False: it waits)."""
        if not self.admit(session):
            return False
        frames = self.model_cfg.downsample_factor
        spans = {"encoder": (frames * session.fed, frames * (session.fed + count)),
                 "decoder": (session.fed, session.fed + count)}
        if not self.reserve(session, spans, protect=scheduled):
            return False
        session.status = Status.RUNNING
        scheduled.add(session)
        self.touch(session)
        return True

    def _dispatched(self, session: RealtimeSession, count: int) -> int:
        """Books `count` slots of a session into the tick being built; returns its first position."""
        start = session.fed
        session.fed += count
        session.in_flight += 1
        return start

    def _batch(self, rows, num_rows: int, num_slots: int, *, with_tokens: bool):
        batch = steps.realtime_batch(num_rows, num_slots, self.model_cfg,
                                     self.cache.specs["encoder"].pages_per_window,
                                     self.cache.specs["decoder"].pages_per_window, with_tokens=with_tokens)
        frames = self.model_cfg.mel_frames_per_token
        mel = batch["mel"]
        for i, (session, start, count) in enumerate(rows):
            for k in range(count):
                mel[i, k * frames : (k + 1) * frames] = session.mel.popleft()
            session.backlog.consumed += count
            if session.backlog.waiting:
                deliver(session, PROGRESS)
            if with_tokens:
                batch["token_ids"][i, :count] = session.prompt_ids[start : start + count]
        used = len(rows)
        batch["slot"][:used] = [session.slot for session, _, _ in rows]
        batch["num_slots"][:used] = [count for _, _, count in rows]
        batch["dec_lengths"][:used] = [start for _, start, _ in rows]
        batch["n_delay"][:used] = [session.n_delay for session, _, _ in rows]
        batch["enc_table"][:used] = [session.pages["encoder"].table for session, _, _ in rows]
        batch["dec_table"][:used] = [session.pages["decoder"].table for session, _, _ in rows]
        return batch

    # -- results --------------------------------------------------------------------------------------
    def _advance(self, session: RealtimeSession, computed: int, tokens) -> None:
        if computed < session.prompt_len:
            return  # part of a prompt: nothing sampled yet
        new = [int(t) for t in np.atleast_1d(tokens) if t >= 0]
        session.generated += new
        session.undelivered += new
        text = "".join(session.decoder.push(t) for t in new)
        ended = self.eos_id in new or self._input_consumed(session)
        if text:
            session.text += text
            audio_seconds = to_ms(min(token_time(len(session.generated) - 1), session.samples / SAMPLING_RATE))
            deliver(session, TranscriptionDelta(text, session.undelivered, audio_seconds))
            session.undelivered = []
        if ended:
            self._done(session)

    def _done(self, session: RealtimeSession) -> None:
        tail = session.decoder.flush()
        audio_seconds = session.samples / SAMPLING_RATE
        if tail:
            session.text += tail
            deliver(session, TranscriptionDelta(tail, session.undelivered, to_ms(audio_seconds)))
        usage = TranscriptionUsage(audio_seconds, session.prompt_len, len(session.generated))
        words = word_timings(session.generated, self.tokenizer, audio_seconds)
        done = TranscriptionDone(session.text, list(session.generated), words, usage, session.delay_ms)
        self.release(session)
        deliver(session, done)
