"""vLLM's prompt logprobs of a text request (`SamplingParams.prompt_logprobs`), on the host.

A prefill program gives, for each position whose next token is a prompt token, that token's logprob and rank and the
MAX_LOGPROBS most likely ids there (steps.prompt_logprobs); the scheduler names those positions in each batch
(`targets`) and keeps what comes back in the session's `FlatPromptLogprobs` (`record`). A prompt spans prefill chunks
and ticks, and a preempted session computes it again from position 0: results are stored by position, so a position
computed twice is written twice, never listed twice. When the first token is sampled, every prompt position has been
computed; the object then goes out with that output (vLLM delivers prompt logprobs once, with the first token) and
the engine never writes it again.

`FlatPromptLogprobs` reads as vLLM's list (None, then a dict of `Logprob`s a position) over its arrays, as vLLM's
FlatLogprobs does: a position's dict is made when it is read, so the engine thread, which serves every session, never
builds prompt length x (N + 1) objects.
"""
from collections.abc import Sequence

import numpy as np

from jaxstream.engine.requests import Logprob


class FlatPromptLogprobs(Sequence):
    """The prompt logprobs of `prompt_ids`, each position's `num` most likely ids (entry 0, the first token's, is
    None). Tokens are named by `tokenizer.token_string` once a tokenizer is set (`AsyncEngine.generate` sets it)."""

    def __init__(self, prompt_ids, num: int):
        self.prompt_ids = np.asarray(prompt_ids, np.int32)
        self.num = num
        self.tokenizer = None
        positions = len(self.prompt_ids) - 1
        self.logprob = np.zeros(positions, np.float32)  # of prompt token i + 1 at position i
        self.rank = np.zeros(positions, np.int32)
        self.top_ids = np.zeros((positions, num), np.int32)
        self.top_logprobs = np.zeros((positions, num), np.float32)

    # -- the engine's side ------------------------------------------------------------------------------
    def targets(self, start: int, count: int) -> np.ndarray:
        """The prompt tokens that follow positions [start, start + count), as far as there are any."""
        return self.prompt_ids[start + 1 : min(start + count, len(self.prompt_ids) - 1) + 1]

    def record(self, start: int, count: int, fetched: dict, row: int) -> None:
        """Keeps what batch row `row` computed for positions [start, start + count) (`fetched`: the prefill's
        host outputs)."""
        end = min(start + count, len(self.prompt_ids) - 1)
        if end <= start:
            return
        span = slice(0, end - start)
        self.logprob[start:end] = fetched["prompt_logprob"][row, span]
        self.rank[start:end] = fetched["prompt_rank"][row, span]
        self.top_ids[start:end] = fetched["prompt_top_ids"][row, span, :self.num]
        self.top_logprobs[start:end] = fetched["prompt_top_logprobs"][row, span, :self.num]

    # -- vLLM's list ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError("prompt logprobs index out of range")
        index %= len(self)
        if index == 0:
            return None
        position = index - 1
        token = int(self.prompt_ids[index])
        # vLLM's order: the prompt token with its rank, then the most likely ids by rank; a prompt token among them
        # takes its place there (its rank there, its logprob the same).
        entries = {token: Logprob(float(self.logprob[position]), int(self.rank[position]), self._name(token))}
        for rank, (token_id, logprob) in enumerate(zip(self.top_ids[position].tolist(),
                                                       self.top_logprobs[position].tolist()), 1):
            entries[token_id] = Logprob(logprob, rank, self._name(token_id))
        return entries

    def _name(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_string(token_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"FlatPromptLogprobs({list(self)!r})"
