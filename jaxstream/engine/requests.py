"""Request-side types with vLLM's names: `SamplingParams`, `StructuredOutputsParams`, `StreamingInput`,
`RequestOutput`, `Logprob`."""
import dataclasses
import enum
import json
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxstream.errors import InvalidRequestError

# Bounds of the per-row arrays a batch carries to the device (int32 top-k, float32 temperature / top-p).
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Stop strings per request, and characters per stop string (OpenAI takes up to 4 strings; vLLM sets no bound).
MAX_STOP_STRINGS = 64
# The most likely tokens a request may ask the logprobs of at each step (vLLM's default `max_logprobs`): the text
# programs always compute this many, so no request compiles a program.
MAX_LOGPROBS = 20
MAX_STOP_STRING_CHARS = 1000
# Entries of a request's `logit_bias` (OpenAI's bound): the text programs carry this many per row, so no request
# compiles a program.
MAX_LOGIT_BIAS = 300
# Completions one request may ask for (OpenAI's bound on `n`): each is an engine request of its own.
MAX_N = 128
# vLLM's bounds on a request's bad words (VLLM_MAX_NUM_BAD_WORDS: token sequences once tokenized, so words too;
# VLLM_MAX_BAD_WORDS_TOTAL_TOKENS of its V2 model runner), and characters a word (each is tokenized twice on the
# engine thread; vLLM sets no bound).
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
MAX_BAD_WORD_CHARS = 1000
# Entries of `allowed_token_ids`: the largest vocabularies' size (vLLM sets no bound; each entry is checked in Python).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# Seeds take any 64-bit value, signed or not (torch's `manual_seed` range, as vLLM); the engine reduces
# them to the 32 bits its PRNG keys hold.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# vLLM's `--generation-config` values jaxstream takes ("auto": the checkpoint's sampling defaults; "vllm": none), not
# its third form, a folder holding another generation_config.json. Here, without jax, so the server's config reads it.
GENERATION_CONFIGS = ("auto", "vllm")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens/text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output at the end (not allowed for streaming input)


# The kinds of constraint a `StructuredOutputsParams` holds exactly one of (vLLM's fields).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Characters of a request's schema, regex or grammar: it is compiled (on a worker thread) and its parser runs on the
# engine thread every step, so an unbounded one could slow everyone; vLLM sets no bound.
MAX_STRUCTURED_OUTPUT_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: the tokens sampled must spell text that `json` (a JSON schema: a dict, or its JSON
    text), `regex`, `choice` (one of these strings), `grammar` (Lark or GBNF) or `json_object` (any JSON object)
    accepts; exactly one of them. `disable_any_whitespace` allows no whitespace between JSON tokens,
    `disable_additional_properties` closes every object schema that does not say (vLLM's options). The engine
    compiles it with llguidance (structured_outputs.py); an invalid one raises `InvalidRequestError` from
    `generate`. `reasoning_end_token_id` (jaxstream's): the constraint applies only after that id, in the prompt or
    the outputs; vLLM does so with a reasoning parser (`--reasoning-parser`), whose model thinks freely first."""

    json: dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_end_token_id: int | None = None

    def __post_init__(self):
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise InvalidRequestError("structured outputs take exactly one of json, regex, choice, grammar and "
                                      f"json_object, got {', '.join(given) or 'none'}")
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"structured outputs' json is not a JSON schema: {exc}") from None
        if self.json is not None and not isinstance(schema, dict):
            raise InvalidRequestError(f"structured outputs' json must be a JSON schema (an object), got {schema!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"structured outputs' {name} must be a string, got {getattr(self, name)!r}")
        choice = self.choice
        if choice is not None:
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice \
                    or not all(isinstance(text, str) for text in choice):
                raise InvalidRequestError(f"structured outputs' choice must be a non-empty list of strings, "
                                          f"got {choice!r}")
            choice = tuple(choice)
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError(f"structured outputs' json_object must be true, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured outputs' {name} must be a bool, got {getattr(self, name)!r}")
        if self.reasoning_end_token_id is not None:
            object.__setattr__(self, "reasoning_end_token_id",
                               _int("reasoning_end_token_id", self.reasoning_end_token_id, 0, _INT32_MAX))
        object.__setattr__(self, "json", schema)
        object.__setattr__(self, "choice", choice)
        try:
            text = self.key[1]
        except (TypeError, ValueError) as exc:  # a Python caller's schema holding what JSON cannot
            raise InvalidRequestError(f"structured outputs' json is not JSON: {exc}") from None
        if len(text) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise InvalidRequestError(f"structured outputs' {self.kind} takes at most {MAX_STRUCTURED_OUTPUT_CHARS} "
                                      "characters")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) is not None)

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What the compiled grammar depends on: (kind, the constraint as text, the two options). Key order is kept:
        a schema's properties are generated in its order."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value)
        return self.kind, text, self.disable_any_whitespace, self.disable_additional_properties


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-chunk sampling and stopping parameters (vLLM's names and meanings).

    `max_tokens=None` means `max_model_len - len(chunk prompt)`; `temperature=0` is greedy; `top_k` 0 or
    -1 and `top_p = 1` disable those filters; `seed` makes sampling reproducible per session; `stop` (a
    string or a list of them) ends a one-shot request as vLLM does (stop_strings.py), and is refused with
    streaming input. Invalid values raise `InvalidRequestError` here (`bool` is not accepted where a number
    is expected).

    The logits a token is chosen from go through vLLM's steps, in its order (sampling.py): `structured_outputs`' grammar
    (ids it does not allow at this step get -inf: the logprobs are those of the masked logits); `logit_bias` ({token id:
    bias in [-100, 100]: OpenAI's range, refused outside it, where vLLM clamps}, up to 300 ids, added) and
    min_tokens' bans; `repetition_penalty` (> 0: the logit of every id in the chunk's context, cumulative prompt and
    outputs, divided by it when positive, multiplied when not), `frequency_penalty` and `presence_penalty` (in [-2,
    2], OpenAI's: minus the penalty times the id's count among the chunk's outputs, and once more if it occurs
    there); then temperature; `min_p` (in [0, 1]: drops ids less likely than min_p times the likeliest); top-k;
    top-p. `allowed_token_ids` (only these ids may be sampled) and `bad_words` (vLLM's rule: the last token of a word's
    tokenization, with and without a leading space, is banned where the chunk's outputs end with the tokens before it;
    a one-token word is never sampled) apply with min_tokens' bans (sample_masks.py). Logprobs are the raw logits'
    (the grammar's masked ones, for structured outputs): as vLLM's sampler, which takes its raw logprobs before
    applying allowed_token_ids and bad_words, neither changes them.
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
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    # When set, outputs carry the sampled token's logprob and (`top_logprobs`) the `logprobs` most likely ones'.
    logprobs: int | None = None
    # When set, the request's first output carries `RequestOutput.prompt_logprobs`: each prompt token's logprob and
    # rank and the `prompt_logprobs` most likely ids' at its position. One-shot requests only (refused with streaming
    # input); such a request computes its whole prompt, the prefix cache's hits included (they have no logits).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token ids as ints or decimal strings (JSON's keys)
    # The text the outputs must form (a `StructuredOutputsParams`, or a dict of its fields). One-shot requests only.
    structured_outputs: "StructuredOutputsParams | None" = None
    allowed_token_ids: tuple[int, ...] | None = None  # ids in the vocabulary (check_vocabulary), not empty
    bad_words: tuple[str, ...] | None = None  # non-empty strings, kept once each in order (vLLM's); needs a tokenizer
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self):
        """Checks every field and keeps plain Python values: anything the engine could not put in a batch
        raises `InvalidRequestError` here, so one bad request fails alone instead of every request
        dispatched with it."""
        fields = {
            "n": _int("n", self.n, 1, MAX_N),
            "temperature": _float("temperature", self.temperature),
            "top_p": _float("top_p", self.top_p),
            "top_k": _int("top_k", self.top_k, -1, _INT32_MAX),
            "seed": None if self.seed is None else _int("seed", self.seed, _SEED_MIN, _SEED_MAX),
            "max_tokens": None if self.max_tokens is None else _int("max_tokens", self.max_tokens, 1),
            "min_tokens": _int("min_tokens", self.min_tokens, 0),
            "logprobs": None if self.logprobs is None else _int("logprobs", self.logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs": (None if self.prompt_logprobs is None
                                else _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": _stop_token_ids(self.stop_token_ids),
            "presence_penalty": _float("presence_penalty", self.presence_penalty),
            "frequency_penalty": _float("frequency_penalty", self.frequency_penalty),
            "repetition_penalty": _float("repetition_penalty", self.repetition_penalty),
            "min_p": _float("min_p", self.min_p),
            "logit_bias": _logit_bias(self.logit_bias),
            "structured_outputs": _structured_outputs(self.structured_outputs),
            "allowed_token_ids": _allowed_token_ids(self.allowed_token_ids),
            "bad_words": _bad_words(self.bad_words),
        }
        if fields["temperature"] < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < fields["top_p"] <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= fields[name] <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if fields["repetition_penalty"] <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= fields["min_p"] <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if fields["max_tokens"] is not None and fields["min_tokens"] > fields["max_tokens"]:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raises InvalidRequestError when `logit_bias` or `allowed_token_ids` names an id outside [0, vocab_size)
        (vLLM's 400s; the second in vLLM's words)."""
        outside = sorted(token for token in self.logit_bias or () if token >= vocab_size)
        if outside:
            raise InvalidRequestError(f"logit_bias holds token ids outside the vocabulary [0, {vocab_size}): "
                                      f"{outside[:10]}")
        if any(not 0 <= token < vocab_size for token in self.allowed_token_ids or ()):
            raise InvalidRequestError("allowed_token_ids contains out-of-vocab token id!")

    def check_supported(self, *, streaming: bool) -> None:
        """Raises InvalidRequestError for what jaxstream does not serve (vLLM rejects the same for streaming
        input)."""
        if streaming and self.n != 1:
            raise InvalidRequestError("n > 1 is not supported with streaming input")
        if not self.skip_special_tokens:  # the detokenizers always skip them: refused, not silently ignored
            raise InvalidRequestError("skip_special_tokens=False is not supported")
        if streaming and self.stop:
            raise InvalidRequestError("stop strings are not supported with streaming input; use stop_token_ids")
        if streaming and self.output_kind is RequestOutputKind.FINAL_ONLY:
            raise InvalidRequestError("output_kind FINAL_ONLY is not supported with streaming input")
        # vLLM computes a request's prompt logprobs once, over its first prompt: a session's later chunks would get
        # none, so jaxstream refuses them rather than answer for the first chunk alone.
        if streaming and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with streaming input")
        # A session's grammar would have to span its chunks, each of which may end anywhere in it.
        if streaming and self.structured_outputs is not None:
            raise InvalidRequestError("structured outputs are not supported with streaming input")


@dataclasses.dataclass(frozen=True)
class StreamingInput:
    """One chunk of a streaming-input session: token ids, text, or {"prompt_token_ids": [...]} /
    {"prompt": "..."}; its `sampling_params`, when set, apply to this chunk only."""

    prompt: Any
    sampling_params: SamplingParams | None = None


@dataclasses.dataclass
class Logprob:
    """vLLM's: a token's logprob at a position, its rank there (1: the likeliest; ids at least as likely count) and its
    text (the tokenizer's `token_string`; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `PromptLogprobs`: None for the first prompt token, then for each later one {token id: Logprob} holding it and
# the `SamplingParams.prompt_logprobs` most likely ids at its position (N or N + 1 entries).
PromptLogprobs = Sequence[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while a chunk runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the chunk, if any
    # Per token of `token_ids`, the `SamplingParams.logprobs` most likely ids and their logprobs, most likely first
    # (the sampled id's is in `logprobs`), as vLLM's; None when the request asked for no logprobs.
    top_logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    # The chunk prompts so far (as vLLM reports it, not the engine context); the outputs of one chunk share
    # one list, so read it, don't change it.
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    # With `SamplingParams.prompt_logprobs`: on the first output with tokens (DELTA; then empty, as vLLM's), or on
    # every output from then on (CUMULATIVE, FINAL_ONLY); None before, and for a request that asks none.
    prompt_logprobs: PromptLogprobs | None = None


def _int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}")
    return int(value)


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise InvalidRequestError(f"{name} must be finite (and within float32), got {value}")
    return float(value)


def _stop_strings(stop) -> tuple[str, ...] | None:
    if stop is None:
        return None
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(text, str) for text in stop):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
    if not all(stop):
        raise InvalidRequestError("stop cannot contain an empty string")  # it would match before any text
    # Every string is looked for in each token's new text, on the engine thread that serves every session:
    # unbounded, one request's list slowed all (300,000 strings: 73 ms between everyone's tokens against 0.6).
    if len(stop) > MAX_STOP_STRINGS or max(map(len, stop), default=0) > MAX_STOP_STRING_CHARS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                                  f"{MAX_STOP_STRING_CHARS} characters each")
    return tuple(stop)


def _logit_bias(biases) -> dict[int, float] | None:
    """{token id: bias} (a copy), None when empty; keys are ints or decimal strings, as JSON objects send them."""
    if biases is None:
        return None
    if not isinstance(biases, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {biases!r}")
    if len(biases) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(biases)}")
    checked = {}
    for key, bias in biases.items():
        if isinstance(key, str) and key.isascii() and key.isdecimal():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or not 0 <= key <= _INT32_MAX:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        token = int(key)
        value = _float("logit_bias value", bias)
        if not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        checked[token] = value
    return checked or None


def _allowed_token_ids(ids) -> tuple[int, ...] | None:
    """The ids as given; their range is the vocabulary's (`check_vocabulary`, vLLM's message for any outside it)."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__"):
        raise InvalidRequestError(f"allowed_token_ids must be a list of token ids, got {ids!r}")
    if not ids:
        raise InvalidRequestError("allowed_token_ids is not None and empty!")  # vLLM's words
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequestError(f"allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(ids)}")
    if any(isinstance(token, bool) or not isinstance(token, numbers.Integral) for token in ids):
        raise InvalidRequestError(f"allowed_token_ids must be a list of token ids (integers), got {list(ids)[:10]!r}")
    return tuple(int(token) for token in ids)


def _bad_words(words) -> tuple[str, ...] | None:
    """Each word once, in order (vLLM's); None when there are none."""
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise InvalidRequestError(f"bad_words must be a list of strings, got {words!r}")
    words = tuple(dict.fromkeys(words))
    if not all(words):
        raise InvalidRequestError(f"bad_words cannot contain an empty string. Got bad_words={list(words)}")
    if len(words) > MAX_BAD_WORDS:  # each is one token sequence at least: vLLM refuses them once tokenized, so
        raise InvalidRequestError(f"Too many bad words after tokenization: {MAX_BAD_WORDS + 1}. The max number is "
                                  f"{MAX_BAD_WORDS}.")
    if max(map(len, words), default=0) > MAX_BAD_WORD_CHARS:
        raise InvalidRequestError(f"bad_words entries take at most {MAX_BAD_WORD_CHARS} characters")
    return words or None


def _stop_token_ids(ids) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    return tuple(_int("stop_token_ids entry", token, 0, _INT32_MAX) for token in ids)


def _structured_outputs(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(f"structured_outputs must be an object, got {value!r}")
    unknown = sorted(set(value) - {field.name for field in dataclasses.fields(StructuredOutputsParams)})
    if unknown:
        raise InvalidRequestError(f"structured_outputs has unknown fields: {', '.join(map(str, unknown))}")
    return StructuredOutputsParams(**value)
