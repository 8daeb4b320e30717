"""Continuous batching of text sessions with vLLM's streaming-input semantics.

One `TextSession` per request id (vLLM's resumable "anchor" request). Its context is `prompt_ids`
(the cumulative prompt) + `outputs` (the current chunk's sampled tokens); `num_computed` positions have
KV. A chunk applied to a session folds every output of the previous chunk except the last sampled one
(never fed back, so it has no KV) into the prompt, then appends the chunk's tokens
(`specs/streaming_semantics.md` §1.2). Chunks queue FIFO while a chunk runs and are never coalesced;
stop, EOS and max_tokens end the chunk and park the session with its KV; only abort, errors, the end of
input and (by jaxstream's rule) reaching `max_model_len` end the session. A one-shot request's stop strings
are looked for in its text as each token is detokenized, here on the host (stop_strings.py).

A tick schedules running sessions first (decodes, then unfinished prefills), then admits waiting ones in
FIFO order, under a token budget; decode rows (one token) go to a C = 1 program and prefill rows to one
prefill bucket; both are dispatched before one host sync. Sessions whose contexts start alike share the KV pages
of their common full blocks (automatic prefix caching, text_prefix_cache.py). A request with `prompt_logprobs` gets
those of its prompt positions from its prefills and with its first token (prompt_logprobs.py). A chunk's grammar
(structured_outputs.py) and its allowed_token_ids and bad words (sample_masks.py) are bitmasks in its slot.
"""
import collections
import dataclasses
import functools
import logging
import numbers
import time

import numpy as np

from jaxstream.engine import first_runs, sample_masks, sampling, steps, structured_outputs, text_prefix_cache
from jaxstream.engine.prompt_logprobs import FlatPromptLogprobs
from jaxstream.engine.requests import SamplingParams
from jaxstream.engine.residency import END_OF_STREAM, Residency, SessionBase, Status, TickStats, deliver
from jaxstream.engine.stop_strings import StopStringText
from jaxstream.engine.text_outputs import session_output, top_logprobs
from jaxstream.errors import InvalidRequestError

logger = logging.getLogger(__name__)
STACK = "text"
COUNT_ROW = ("count_row",)  # the program that writes a slot's penalty counts (steps.write_count_row)
_MASK32 = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class ChunkUpdate:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    guide: structured_outputs.Guide | None = None
    sample_mask: sample_masks.SampleMask | None = None


class TextSession(SessionBase):
    def __init__(self, request_id, sink, pages, *, resumable, detokenizer):
        super().__init__(request_id, sink, pages)
        self.resumable = resumable
        self.prompt_ids: list[int] = []
        self.outputs: list[int] = []
        self.num_computed = 0
        self.params = SamplingParams()
        self.max_tokens = 0
        self.seed = 0
        self.queue: collections.deque = collections.deque()
        # What vLLM reports as prompt_token_ids: chunk prompts only. A new list per chunk, shared by that chunk's
        # outputs (as vLLM shares its request's list): copying it into every output cost O(prompt) a token.
        self.chunk_prompts: list[int] = []
        self.streamed: list[int] = []  # every sampled token, for CUMULATIVE outputs
        self.streamed_logprobs: list[float] = []
        self.streamed_top: list[dict[int, float]] = []  # each streamed token's most likely ids (empty: not asked)
        self.text = ""
        self.cumulative_logprob = 0.0
        self.detokenizer = detokenizer
        self.stop_text: StopStringText | None = None  # the output text of a one-shot request with stop strings
        self.stop_token_ids: frozenset[int] = frozenset()  # the chunk's
        self.logit_bias: tuple[list[int], list[float]] | None = None  # the chunk's (ids, biases)
        # Prefix caching (text_prefix_cache.py): the keys of the context's blocks hashed so far (a block's tokens
        # never change once keyed), the leading blocks registered or found cached, and whether the penalty counts
        # of the slot miss the tokens of a prefix the session took from the cache.
        self.block_keys: list[bytes] = []
        self.cached_blocks = 0
        self.probed_blocks = 0
        self.counts_stale = False
        # Prompt logprobs (a request that asks them): those still being computed, then those delivered (with the
        # first token: later outputs refer to them, and a recompute after a preemption computes none again).
        self.collecting: FlatPromptLogprobs | None = None
        self.prompt_logprobs: FlatPromptLogprobs | None = None
        self.guide: structured_outputs.Guide | None = None  # structured outputs: the grammar's matcher
        self.sample_mask: sample_masks.SampleMask | None = None  # the chunk's allowed_token_ids and bad words

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.outputs)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Context tokens [start, stop) (without concatenating the whole context)."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.outputs[start - split : stop - split]
        return self.prompt_ids[start:stop] + self.outputs[: max(0, stop - split)]


class TextScheduler(Residency):
    """The host-side scheduler of a text LM engine; `step()` runs one tick on the calling thread."""

    can_drop_kv = True

    def __init__(self, programs: steps.Programs, engine_cfg, model_cfg, *, max_model_len, eos_token_id=None,
                 primary_eos_token_id=None, tokenizer=None):
        super().__init__(programs, engine_cfg.host_offload_bytes)
        self.cfg = engine_cfg
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = max_model_len
        # One id or several (Llama 3's generation_config stops at any of three).
        if isinstance(eos_token_id, numbers.Integral):
            eos_token_id = (eos_token_id,)
        eos_ids = [int(token) for token in eos_token_id or ()]
        # vLLM's update_from_generation_config: the model's own EOS (the tokenizer's; else the first id given)
        # ends a request with stop_reason None, every other declared EOS id is a stop token id and is reported.
        # The tokenizer's EOS stops a request even where the checkpoint does not declare it (vLLM's
        # `eos_token_id` check), as BLIP-2's tokenizer EOS 2 beside its generation_config's 50118.
        if primary_eos_token_id is None and eos_ids:
            primary_eos_token_id = eos_ids[0]
        if primary_eos_token_id is not None:
            eos_ids.append(int(primary_eos_token_id))
        self.eos_token_ids = frozenset(eos_ids)
        self.secondary_eos_token_ids = self.eos_token_ids - {primary_eos_token_id}
        self.tokenizer = tokenizer  # its stream decoders detokenize the outputs; it tokenizes bad words
        self.sample_masks = sample_masks.SampleMasks(tokenizer, self.vocab_size)
        self.waiting: collections.deque[TextSession] = collections.deque()
        self.running: list[TextSession] = []
        self._seed_counter = 0
        self._preempted: set[TextSession] = set()
        self.preemptions = 0
        pool = self.cache.pools[STACK]
        # Automatic prefix caching, where the builder gave the text stack a caching pool (EngineConfig's
        # enable_prefix_caching, on a stack that never wraps: text_prefix_cache.supported).
        self.prefix = (text_prefix_cache.TextPrefixCache(pool, STACK, self.cache.specs[STACK].page_size)
                       if isinstance(pool, text_prefix_cache.CachingPagePool) else None)

    # -- start-up -------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compiles every decode and prefill bucket, runs each once per early attention bucket (first_runs.py),
        and compiles the offload/restore programs."""
        spec = self.cache.specs[STACK]
        step = functools.partial(steps.text_step, stack=STACK, attention_impl=self.cfg.attention_impl)
        shapes = dict.fromkeys([(rows, 1) for rows in self.cfg.decode_batch_buckets] + list(self.cfg.prefill_buckets))
        for rows, chunk in shapes:
            self.programs.compile(("text", rows, chunk), step, steps.text_batch(rows, chunk, spec.pages_per_window))
        lengths = first_runs.early_reaches(spec.ring)  # the ring is the window the model attends over
        for rows, chunk in shapes:
            batch = dict(steps.text_batch(rows, chunk, spec.pages_per_window), num_new=np.full(rows, chunk, np.int32))
            first_runs.run_once_per_bucket(self.programs, ("text", rows, chunk), batch, lengths,
                                           tables={STACK: "page_table"}, length_key="lengths")
        if self.prefix is not None:
            self.programs.compile(COUNT_ROW, steps.write_count_row, steps.count_row_batch(self.vocab_size))
        self.programs.compile(structured_outputs.TOKEN_MASKS, steps.write_token_masks,
                              structured_outputs.token_masks_batch(self.vocab_size))
        self.cache.warm_up()

    # -- commands (engine thread) ---------------------------------------------------------------------
    def add_chunk(self, request_id: str, prompt_ids, params: SamplingParams, *, first: bool, resumable: bool,
                  sink, guide: structured_outputs.Guide | None = None) -> None:
        """A request's first chunk creates its session; later chunks queue, or apply at once if parked.
        A chunk for an unknown id that is not a first chunk is dropped: an ended session never revives.
        `guide`: the compiled grammar of `params.structured_outputs` (structured_outputs.Grammars)."""
        session = self.sessions.get(request_id)
        created = session is None
        if created:
            if not first:
                return
            session = TextSession(request_id, sink, self.cache.new_pages(), resumable=resumable,
                                  detokenizer=self.tokenizer.stream_decoder() if self.tokenizer is not None else None)
            self.sessions[request_id] = session
        try:
            ids = self._validated(prompt_ids)
            if (guide is None) != (params.structured_outputs is None):
                raise ValueError("structured outputs need their compiled grammar (AsyncEngine.generate compiles it)")
            params.check_supported(streaming=resumable)  # stop strings: one-shot requests only
            params.check_vocabulary(self.vocab_size)
            if params.stop and session.detokenizer is None:
                raise InvalidRequestError("stop strings need a tokenizer and this model has none; use stop_token_ids")
            if len(self._min_tokens_bans(params)) > sampling.MAX_BANNED_IDS:
                raise ValueError(f"min_tokens bans the EOS and stop ids until then: at most "
                                 f"{sampling.MAX_BANNED_IDS} of them are supported")
            update = ChunkUpdate(ids, params, guide, self.sample_masks.for_params(params))
        except ValueError as exc:
            logger.info("request %s: chunk rejected: %s", request_id, exc)
            self.fail(session, exc)
            return
        if created and session.detokenizer is not None:
            # Text continues the prompt's (vLLM primes with the first chunk's prompt only: later chunks leave
            # the detokenizer as it is, so their text continues the previous outputs').
            session.detokenizer.prime(update.prompt_ids)
        if created or session.status is Status.PARKED:
            self._apply(session, update)
        else:
            session.queue.append(update)

    def end_input(self, request_id: str) -> None:
        """The session's input is closed: finish it now if parked, else after its queued chunks."""
        session = self.sessions.get(request_id)
        if session is None:
            return
        if session.status is Status.PARKED:
            self.release(session)
            if self.cfg.compat == "strict":
                deliver(session, session_output(session, [], [], [], None, None, finished=True))
            deliver(session, END_OF_STREAM)
        else:
            session.queue.append(None)

    def abort(self, request_id: str) -> None:
        session = self.sessions.get(request_id)
        if session is None:
            return
        self.release(session)
        deliver(session, session_output(session, [], [], [], "abort", None, finished=True))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- chunk application ----------------------------------------------------------------------------
    def _validated(self, prompt_ids) -> tuple[int, ...]:
        ids = tuple(int(t) for t in prompt_ids)
        if not ids:
            raise ValueError("a chunk prompt must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _apply(self, session: TextSession, update: ChunkUpdate) -> None:
        """vLLM's `_update_request_as_session`: fold all outputs but the last into the prompt, append the
        chunk, take its params; KV (num_computed) is kept."""
        assert not session.outputs or session.num_tokens - 1 >= session.num_computed
        session.prompt_ids += session.outputs[:-1]
        session.outputs = []
        session.prompt_ids += update.prompt_ids
        session.chunk_prompts = [*session.chunk_prompts, *update.prompt_ids]  # outputs hold the old list
        session.params = update.params
        session.stop_text = StopStringText(update.params) if update.params.stop else None
        # A set: looked up at every token on the engine thread, for a list as long as the request made it.
        session.stop_token_ids = frozenset(update.params.stop_token_ids or ())
        bias = update.params.logit_bias
        session.logit_bias = (list(bias), list(bias.values())) if bias else None
        session.max_tokens = update.params.max_tokens or max(1, self.max_model_len - len(update.prompt_ids))
        if update.params.prompt_logprobs is not None:  # a one-shot request's one chunk (check_supported)
            session.collecting = FlatPromptLogprobs(session.prompt_ids, update.params.prompt_logprobs)
        session.seed = self._seed(update.params)
        session.guide = update.guide
        session.sample_mask = update.sample_mask
        if session.guide is not None:
            session.guide.start(session.prompt_ids)
        if session.counts_stale and _uses_penalties(update.params):
            self._recompute(session)
        self.touch(session)
        if session.status is Status.RUNNING:
            self.running.remove(session)
        session.status = Status.WAITING
        if len(session.prompt_ids) >= self.max_model_len:
            self.release(session)
            deliver(session, session_output(session, [], [], [], "length", None, finished=True))
            return
        self.waiting.append(session)

    def _min_tokens_bans(self, params: SamplingParams) -> list[int]:
        """vLLM's MinTokensLogitsProcessor: the EOS ids (unless ignore_eos) and stop ids may not be sampled
        before min_tokens outputs (skipping the stop check alone would still emit them)."""
        if not params.min_tokens:
            return []
        eos = () if params.ignore_eos else self.eos_token_ids
        return sorted({*eos, *(params.stop_token_ids or ())})

    def _seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed & _MASK32
        self._seed_counter += 1
        return (self.cfg.seed * 1_000_003 + self._seed_counter) & _MASK32

    # -- residency hooks ------------------------------------------------------------------------------
    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        return (self.prefix.queries, self.prefix.hits) if self.prefix is not None else (0, 0)

    def _looks_up(self, session: TextSession) -> bool:
        """Whether admitting `session` looks its context up in the prefix cache: it will compute from position 0 and
        asks no prompt logprobs (a cached prefix has no logits: vLLM's skip_reading_prefix_cache; its blocks are
        still cached). A chunk with a penalty gets the prefix's counts written into its slot (`_write_counts`)."""
        return (self.prefix is not None and session.num_computed == 0 and not session.resident
                and session.offloaded is None
                and session.params.prompt_logprobs is None)

    def admit(self, session: TextSession) -> bool:
        """Residency's admission; a session that `_looks_up` then takes the cached pages of its leading blocks."""
        looks_up = self._looks_up(session)
        if not super().admit(session):
            return False
        self.sample_masks.forget(session.slot)  # a restore wrote the slot's bitmasks
        if looks_up:
            session.num_computed = self.prefix.lookup(session)
            if session.num_computed and _uses_penalties(session.params):
                self._write_counts(session)
            # Without a penalty now the slot's counts miss the prefix: a later chunk with one recomputes.
            session.counts_stale = session.num_computed > 0 and not _uses_penalties(session.params)
        return True

    def _write_counts(self, session: TextSession) -> None:
        """The penalty counts of the prefix a session took from the cache, as its prefill would have built them
        (sampling.count_fed_tokens): every token seen, the current chunk's outputs among them counted."""
        prefix = np.asarray(session.tokens(0, session.num_computed), np.int64)
        outputs = prefix[len(session.prompt_ids):]
        batch = steps.count_row_batch(self.vocab_size)
        batch["slot"][0] = session.slot
        batch["row"][0] = 2 * np.bincount(outputs, minlength=self.vocab_size) + (
            np.bincount(prefix, minlength=self.vocab_size) > 0)
        batch["output_start"][0] = len(session.prompt_ids)
        self.programs.run(COUNT_ROW, batch)

    def _dropped_kv(self, session: TextSession) -> None:
        session.num_computed = session.cached_blocks = 0

    def _recompute(self, session: TextSession) -> None:
        """Drops the KV of a session whose slot lacks the penalty counts of a prefix it took from the cache, for a
        chunk that needs them: its next prefill computes its context from position 0 (which rebuilds the counts)
        and looks nothing up."""
        if session.resident:
            self.cache.release_pages(session.pages)  # it keeps its slot
        elif session.offloaded is not None:
            self.host_bytes -= session.offloaded_bytes
            session.offloaded, session.offloaded_bytes = None, 0
        session.num_computed = session.cached_blocks = 0
        session.counts_stale = False

    def state_reset(self) -> None:
        """The device state was rebuilt: no cached page holds its KV any more."""
        if self.prefix is not None:
            self.prefix.pool.drop()
        self.sample_masks.forget()

    def _unschedule(self, session: TextSession) -> None:
        if session in self.running:
            self.running.remove(session)
        if session in self.waiting:
            self.waiting.remove(session)

    def release(self, session: TextSession) -> None:
        self._unschedule(session)
        super().release(session)

    def _preempt(self, session: TextSession) -> None:
        """vLLM preemption: free the KV and recompute the whole context later (tokens are kept)."""
        self._unschedule(session)
        self.cache.release_pages(session.pages)
        self.cache.release_slot(session.slot)
        session.slot = None
        session.num_computed = session.cached_blocks = 0
        session.status = Status.WAITING
        self.preemptions += 1
        self.waiting.appendleft(session)
        self._preempted.add(session)

    # -- one tick -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One tick; False when nothing could be scheduled."""
        start = time.perf_counter()
        self.tick += 1
        self._preempted = set()  # not re-admitted in the tick that preempted them
        decode, prefill, bucket = self._schedule()
        if not decode and not prefill:
            return False
        try:
            results, waited = self._execute(decode, prefill, bucket)
        except Exception as exc:  # noqa: BLE001 - a failed dispatch ends the sessions it carried
            self.dispatch_failed([session for session, _, _ in decode + prefill], exc)
            return True
        for rows, fetched in results:
            for i, (session, start_pos, count) in enumerate(rows):
                try:
                    if session.collecting is not None:
                        session.collecting.record(start_pos, count, fetched, i)
                    self._advance(session, start_pos + count, int(fetched["tokens"][i]),
                                  float(fetched["logprobs"][i]), top_logprobs(session.params, fetched, i))
                except Exception as exc:  # noqa: BLE001 - isolate host-side failures to their session
                    logger.exception("request %s: processing its token failed; ending it", session.request_id)
                    self.fail(session, exc)
        rows = decode + prefill
        self.record_tick(TickStats(len(rows), sum(count for _, _, count in rows),
                                         time.perf_counter() - start, waited))
        return True

    def _schedule(self):
        budget = self.cfg.max_num_batched_tokens
        max_decode = self.cfg.decode_batch_buckets[-1]
        decode, candidates, scheduled = [], [], set()

        def plan(session):
            """A decode row now, or a prefill candidate for after the decodes."""
            nonlocal budget
            if session.num_tokens - session.num_computed > 1:
                candidates.append(session)
            elif budget >= 1 and len(decode) < max_decode and self._reserve(session, 1, scheduled):
                decode.append((session, session.num_computed, 1))
                scheduled.add(session)
                budget -= 1

        for session in [s for s in self.waiting if s.resident]:  # KV-holding sessions first, like vLLM
            self.waiting.remove(session)
            session.status = Status.RUNNING
            self.running.append(session)
        for session in list(self.running):
            if session.status is Status.RUNNING:  # not preempted by an earlier row of this tick
                plan(session)
        deferred, pending = [], None
        while budget > 0 and self.waiting and self.waiting[0] not in self._preempted:
            session = self.waiting[0]
            if self._looks_up(session):
                if pending is None:
                    pending = self.prefix.pending(self.running)
                if self.prefix.waits_for(session, pending):  # a running session is computing its next block
                    deferred.append(self.waiting.popleft())
                    continue
            if not self.admit(session):
                break
            self.waiting.popleft()
            session.status = Status.RUNNING
            self.running.append(session)
            plan(session)
            if pending is not None:
                pending |= self.prefix.pending([session])
        self.waiting.extendleft(reversed(deferred))
        prefill, bucket = [], None
        candidates = [s for s in candidates if s.status is Status.RUNNING]
        if candidates and budget > 0:
            bucket = self._prefill_bucket(candidates, budget)
            rows, chunk = bucket
            for session in candidates[:rows]:
                count = min(session.num_tokens - session.num_computed, chunk, budget)
                if count <= 0 or session.status is not Status.RUNNING:
                    continue
                if self._reserve(session, count, scheduled):
                    prefill.append((session, session.num_computed, count))
                    scheduled.add(session)
                    budget -= count
        return decode, prefill, bucket

    def _prefill_bucket(self, candidates, budget):
        def tokens(bucket):
            rows, chunk = bucket
            left, total = budget, 0
            for session in candidates[:rows]:
                take = min(session.num_tokens - session.num_computed, chunk, left)
                total, left = total + take, left - take
            return total

        return max(self.cfg.prefill_buckets, key=lambda b: (tokens(b), -b[0] * b[1]))

    def _reserve(self, session: TextSession, count: int, scheduled: set) -> bool:
        """Pages for the next `count` positions; evicts parked sessions, then preempts running ones."""
        span = {STACK: (session.num_computed, session.num_computed + count)}
        while not self.reserve(session, span, protect=scheduled):
            victims = [s for s in reversed(self.running) if s is not session and s not in scheduled]
            if not victims:
                self._preempt(session)
                return False
            self._preempt(victims[0])
        return True

    def _execute(self, decode, prefill, bucket):
        scheduled = decode + prefill
        masks = [(session.slot, sampling.GRAMMAR_MASK, session.guide.mask) for session, start, count in scheduled
                 if _guided(session, start, count)] + self.sample_masks.writes(scheduled)
        if masks:  # into the slots before the steps that read them
            structured_outputs.write_masks(self.programs, self.vocab_size, masks)
        dispatched = []
        if decode:
            rows = next(b for b in self.cfg.decode_batch_buckets if b >= len(decode))
            dispatched.append((decode, self._run(("text", rows, 1), self._batch(decode, rows, 1))))
        if prefill:
            rows, chunk = bucket
            dispatched.append((prefill, self._run(("text", rows, chunk), self._batch(prefill, rows, chunk))))
        fetched, waited = self.fetch([outputs for _, outputs in dispatched])
        return [(rows, out) for (rows, _), out in zip(dispatched, fetched)], waited

    def _run(self, key, batch) -> dict:
        """Dispatches a text program; its prompt logprobs stay on the device unless a row asked for them."""
        outputs = self.programs.run(key, batch)
        if batch["prompt_targets"].max() < 0:
            outputs = {name: value for name, value in outputs.items() if name not in steps.PROMPT_OUTPUTS}
        return outputs

    def _batch(self, rows, num_rows: int, chunk: int):
        batch = steps.text_batch(num_rows, chunk, self.cache.specs[STACK].pages_per_window)
        for i, (session, start, count) in enumerate(rows):
            batch["token_ids"][i, :count] = session.tokens(start, start + count)
            batch["page_table"][i] = session.pages[STACK].table
            batch["lengths"][i] = start
            batch["num_new"][i] = count
            params = session.params
            batch["temperature"][i] = params.temperature
            batch["top_k"][i] = params.top_k
            batch["top_p"][i] = params.top_p
            batch["seed"][i] = session.seed
            batch["position"][i] = session.num_tokens
            batch["num_top"][i] = params.logprobs or 0
            batch["slot"][i] = session.slot
            batch["output_start"][i] = len(session.prompt_ids)
            batch["presence"][i] = params.presence_penalty
            batch["frequency"][i] = params.frequency_penalty
            batch["repetition"][i] = params.repetition_penalty
            batch["min_p"][i] = params.min_p
            if session.logit_bias is not None:
                ids, biases = session.logit_bias
                batch["bias_ids"][i, :len(ids)] = ids
                batch["bias_values"][i, :len(ids)] = biases
            if len(session.outputs) < params.min_tokens:
                bans = self._min_tokens_bans(params)
                batch["banned_ids"][i, :len(bans)] = bans
            if session.collecting is not None:
                targets = session.collecting.targets(start, count)
                batch["prompt_targets"][i, :len(targets)] = targets
            batch["guided"][i] = _guided(session, start, count)
            batch["masked"][i] = sample_masks.samples_under(session, start, count)
        return batch

    # -- results --------------------------------------------------------------------------------------
    def _advance(self, session: TextSession, computed: int, token: int, logprob: float, top: dict) -> None:
        session.num_computed = computed
        if self.prefix is not None:
            self.prefix.register(session)
        if computed < session.num_tokens:
            return  # a prefill chunk that does not reach the end of the known tokens samples nothing
        session.outputs.append(token)
        if session.guide is not None:
            session.guide.advance(token, session.request_id)
        reason, stop_reason, session_over = self._check_stop(session)
        # vLLM's detokenizer leaves out the text of the token that stopped the chunk (EOS or a stop id) unless
        # the request keeps its stops in the text (`include_stop_str_in_output`); the id is still reported.
        token_stopped = reason == "stop" and not session.params.include_stop_str_in_output
        text = "" if session.detokenizer is None or token_stopped else session.detokenizer.push_many([token])
        if session.stop_text is not None:
            # vLLM looks for stop strings after its engine's checks, and a match overrides their reason.
            matched = session.stop_text.add(text, produced=len(session.outputs), check=not token_stopped)
            if matched is not None:
                reason, stop_reason = "stop", matched
        if reason is None:
            deliver(session, session_output(session, [token], [logprob], [top], None, None, finished=False, text=text))
            return
        head = session.queue[0] if session.queue else False
        finished = session_over or not session.resumable or head is None
        deliver(session, session_output(session, [token], [logprob], [top], reason, stop_reason,
                                      finished=finished, text=text))
        self.touch(session)
        if finished:
            self.release(session)
        elif head is not False:
            self._apply(session, session.queue.popleft())
        else:
            self.running.remove(session)
            session.status = Status.PARKED

    def _check_stop(self, session: TextSession):
        """vLLM's check_stop order: length caps first, then (after min_tokens) EOS and stop ids.
        Returns (finish_reason, stop_reason, ends_session)."""
        produced = len(session.outputs)
        if session.num_tokens >= self.max_model_len:
            return "length", None, True
        if produced >= session.max_tokens:
            return "length", None, False
        if produced < session.params.min_tokens:
            return None, None, False
        last = session.outputs[-1]
        if not session.params.ignore_eos and last in self.eos_token_ids:
            return "stop", last if last in self.secondary_eos_token_ids else None, False
        if last in session.stop_token_ids:
            return "stop", last, False
        return None, None, False


def _guided(session: TextSession, start: int, count: int) -> bool:
    """Whether a row of `session` from `start` samples under its grammar's mask."""
    return session.guide is not None and session.guide.applies and start + count == session.num_tokens


def _uses_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
