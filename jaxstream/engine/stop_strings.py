"""vLLM's stop strings (`SamplingParams.stop`) for one-shot text generation, on the engine thread.

The rules are those of vLLM's detokenizer (vllm/v1/engine/detokenizer.py, `check_stop_strings` and
`BaseIncrementalDetokenizer`), applied to the text each sampled token adds:
- a stop string counts where it ends in the new text (it may start in earlier tokens' text); the first of
  the request's stop strings, in the order given, that does so wins, at its first such occurrence;
- the output text is cut before the match, or after it with `include_stop_str_in_output`;
- no stop string is looked for until `min_tokens` tokens were produced, and then only in text that ends
  in the tokens after them;
- until the request ends, the last (longest stop string - 1) characters are held back (none with
  `include_stop_str_in_output`, where a cut never reaches text already given out), so a client is never
  handed text that a later cut removes. The request's end hands out the rest.

Streaming input cannot have stop strings (vLLM refuses them: specs/streaming_semantics.md §1.1), so one
`StopStringText` serves one request's single chunk.
"""
from jaxstream.engine.requests import SamplingParams


def find_stop(text: str, new_chars: int, stops, include: bool) -> tuple[str, int] | None:
    """(stop string, length to cut `text` to) for the first of `stops` that ends in the last `new_chars`
    characters of `text`, or None."""
    if not new_chars:
        return None
    for stop in stops:
        # A match ending in the new text starts at most len(stop) - 1 characters before it.
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index >= 0:
            return stop, index + len(stop) if include else index
    return None


class StopStringText:
    """The output text of one request with stop strings: what it is so far, cut at a match, and the part of
    it a client may see before the request ends."""

    def __init__(self, params: SamplingParams):
        if not params.stop:
            raise ValueError("StopStringText needs stop strings")
        self.stops = params.stop
        self.include = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold = 0 if self.include else max(map(len, self.stops)) - 1
        self.text = ""
        self._sent = 0  # characters handed out as deltas

    def add(self, new_text: str, *, produced: int, check: bool = True) -> str | None:
        """Appends the text of the request's `produced`-th output token; returns the stop string it completes
        (the text is then cut) or None. `check=False` appends without looking (vLLM does not look at the text
        of a stop token: it ends the request itself)."""
        self.text += new_text
        if not check or produced <= self.min_tokens:
            return None
        found = find_stop(self.text, len(new_text), self.stops, self.include)
        if found is None:
            return None
        stop, cut = found
        self.text = self.text[:cut]
        return stop

    def visible(self, *, finished: bool, delta: bool) -> str:
        """The text to put in the next output: what is new since the previous call (`delta`) or all of it,
        without the held-back tail until `finished`."""
        end = len(self.text) if finished else max(0, len(self.text) - self.hold)
        if not delta:
            return self.text[:end]
        start, self._sent = self._sent, max(self._sent, end)
        return self.text[start:end]
