"""Request-side types with vLLM's names: `SamplingParams`, `StreamingInput`, `RequestOutput`."""
import dataclasses
import enum
from typing import Any


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens/text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output at the end (not allowed for streaming input)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-chunk sampling and stopping parameters (vLLM's names and meanings).

    `max_tokens=None` means `max_model_len - len(chunk prompt)`; `temperature=0` is greedy; `top_k <= 0`
    and `top_p = 1` disable those filters; `seed` makes sampling reproducible per session.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # when set, outputs carry the sampled token's logprob
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    def check_supported(self, *, streaming: bool) -> None:
        """Raises ValueError for what jaxstream does not serve (vLLM rejects the same for streaming input)."""
        if self.n != 1:
            raise ValueError("n > 1 is not supported")
        if self.stop:
            raise ValueError("stop strings are not supported; use stop_token_ids")
        if streaming and self.output_kind is RequestOutputKind.FINAL_ONLY:
            raise ValueError("output_kind FINAL_ONLY is not supported with streaming input")


@dataclasses.dataclass(frozen=True)
class StreamingInput:
    """One chunk of a streaming-input session: token ids, text, or {"prompt_token_ids": [...]} /
    {"prompt": "..."}; its `sampling_params`, when set, apply to this chunk only."""

    prompt: Any
    sampling_params: SamplingParams | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while a chunk runs
    stop_reason: int | None = None  # the stop token id that ended the chunk, if any


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the chunk prompts so far (as vLLM reports it, not the engine context)
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
