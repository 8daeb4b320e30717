"""Structured outputs (vLLM's guided decoding) with llguidance: a request's grammar allows some tokens at each step.

`Grammars` (one an engine) compiles a request's `StructuredOutputsParams` into an llguidance matcher, off the engine
thread (`AsyncEngine.generate` awaits it, and `AsyncEngine.check_sampling_params` for a server that refuses an invalid
grammar before it answers), keeping the last compiled ones so a repeated or checked schema costs a copy. The
scheduler keeps the matcher with its session: before a step that samples for it, the matcher's bitmask of allowed
ids (one bit an id) goes into the session's slot on the device (`write_masks`, program `TOKEN_MASKS`, which writes
the slots' allowed_token_ids and bad words bitmasks too: sample_masks.py), the step sets every other id's logit to
-inf (steps.text_step), and the sampled id advances the matcher (`advance`).
A batch without such a row pays one `lax.cond` and transfers nothing more.

As vLLM's guidance backend: JSON schemas compile with flexible whitespace unless `disable_any_whitespace`, a
`choice` is the alternation of its strings, `grammar` is Lark or GBNF (llguidance converts GBNF), `json_object` is the
schema {"type": "object"}; once the grammar is complete only the EOS ids are allowed, so the request stops; masking
happens before the sampler, so logprobs are those of the masked logits. llguidance reads the tokenizer itself: a
tokenizer.json (Llama, Qwen, ...) or Mistral's tekken; sentencepiece `.model` files are refused (vLLM's guidance
backend takes fast tokenizers and tekken only). With a reasoning parser vLLM applies a grammar only once the
reasoning ends; here a request says so itself (`StructuredOutputsParams.reasoning_end_token_id`: the grammar starts
after that id, in the prompt or the outputs), which the server sets for its `--reasoning-parser`. Not served: vLLM's
`whitespace_pattern` and `structural_tag`.
"""
import collections
import copy
import json
import logging
import threading

import numpy as np

from jaxstream.engine.requests import StructuredOutputsParams
from jaxstream.errors import InvalidRequestError

logger = logging.getLogger(__name__)

TOKEN_MASKS = ("token_masks",)  # the program that writes slots' allowed-id bitmasks (steps.write_token_masks)
MASK_ROWS = 16  # slots one call of that program writes (a tick with more guided rows calls it again)
_CACHED_GRAMMARS = 64  # compiled grammars kept for reuse (vLLM caches its compiled grammars too)


def mask_words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


class Guide:
    """A request's llguidance matcher, the width of its bitmasks (llguidance's vocabulary, >= the model's) and the
    reasoning end id it still waits for (None: the grammar applies)."""

    __slots__ = ("matcher", "words", "waits_for")

    def __init__(self, matcher, words: int, waits_for: int | None = None):
        self.matcher, self.words, self.waits_for = matcher, words, waits_for

    def start(self, prompt_ids) -> None:
        """A prompt that already ends the reasoning (a template that closed the thinking) starts the grammar."""
        if self.waits_for in prompt_ids:
            self.waits_for = None

    @property
    def applies(self) -> bool:
        return self.waits_for is None

    def advance(self, token: int, request_id: str) -> None:
        """The sampled id moves the matcher on (the reasoning end id starts the grammar instead). The matcher refuses an
        id only when the mask let nothing through (min_tokens banning the EOS a complete grammar allows alone): it then
        allows EOS alone, and the request ends there."""
        if self.waits_for is not None:
            if token == self.waits_for:
                self.waits_for = None
            return
        if self.matcher.is_stopped() or self.matcher.consume_token(token):
            return
        logger.warning("request %s: structured outputs: sampled id %d is outside the grammar: %s", request_id, token,
                       _first_line(self.matcher.get_error()))

    def mask(self) -> np.ndarray:
        """The bitmask of the ids the grammar allows next (llguidance's vocabulary's width)."""
        row = np.empty(self.words, np.int32)  # llguidance writes exactly its vocabulary's width
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row


class Grammars:
    """Compiles requests' structured outputs for one model: its tokenizer, vocabulary and EOS ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._words = 0
        self._lock = threading.Lock()  # compiles run on worker threads
        self._compiled: collections.OrderedDict = collections.OrderedDict()

    def guide(self, params: StructuredOutputsParams) -> Guide:
        """A fresh `Guide` for `params`: a copy of `compile`'s template (its errors)."""
        return Guide(self.compile(params).deep_copy(), self._words, params.reasoning_end_token_id)

    def compile(self, params: StructuredOutputsParams):
        """The compiled template of `params`' grammar (an llguidance matcher at its start, never advanced), kept for
        the next request with the same key. InvalidRequestError when the model's tokenizer cannot serve one or the
        schema, regex or grammar is invalid. Slow for a large grammar: call it off the event loop and the engine
        thread."""
        import llguidance

        with self._lock:
            template = self._compiled.get(params.key)
            if template is not None:
                self._compiled.move_to_end(params.key)
                return template
            tokenizer = self._llguidance_tokenizer()
        grammar = grammar_text(params)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"invalid structured outputs {params.kind}: {_first_line(template.get_error())}")
        with self._lock:
            self._compiled[params.key] = template
            while len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template

    def _llguidance_tokenizer(self):
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance_tokenizer(self._tokenizer, self._vocab_size, self._eos_ids)
            self._words = mask_words(self._ll_tokenizer.vocab_size)
        return self._ll_tokenizer


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's view of the model's tokenizer, over the model's vocabulary (ids past the tokenizer's never allowed),
    the EOS ids ending the grammar."""
    import llguidance
    from jaxstream.models.tokenizers import HFTokenizer, TekkenTokenizer

    if tokenizer is None:
        raise InvalidRequestError("structured outputs need the model's tokenizer, and this model is served without one")
    n_vocab = max(vocab_size, tokenizer.vocab_size)
    try:
        if isinstance(tokenizer, HFTokenizer):
            return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=n_vocab, eos_token=list(eos_ids))
        if isinstance(tokenizer, TekkenTokenizer):
            from mistral_common.guidance.tokenizer import MistralLLGTokenizer

            wrapped = llguidance.TokenizerWrapper(MistralLLGTokenizer(tokenizer.tekkenizer))
            return llguidance.LLTokenizer(wrapped, n_vocab=n_vocab, eos_token=list(eos_ids))
    except ValueError as exc:  # a tokenizer.json llguidance cannot read (a word-level one has no byte decoder)
        raise InvalidRequestError(f"structured outputs cannot use this model's tokenizer: {_first_line(str(exc))}") \
            from None
    raise InvalidRequestError("structured outputs need a tokenizer.json or tekken.json tokenizer; this model's is a "
                              "sentencepiece model")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params` (vLLM's guidance backend's serialization)."""
    import llguidance

    options = {"whitespace_flexible": not params.disable_any_whitespace}
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if params.disable_additional_properties:
                schema = _closed_objects(copy.deepcopy(schema))
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        return llguidance.grammar_from(kind, list(params.choice) if kind == "choice" else getattr(params, kind))
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid structured outputs {kind}: {_first_line(str(exc))}") from None


# Keywords whose values are maps of subschemas, and those whose values are subschemas (or lists of them).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "contains", "allOf", "anyOf", "oneOf", "not", "if",
               "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _closed_objects(schema):
    """`disable_additional_properties`: every object schema with properties that says nothing of others allows none."""
    if isinstance(schema, list):
        for item in schema:
            _closed_objects(item)
    elif isinstance(schema, dict):
        for key in _SCHEMA_MAPS:
            if isinstance(schema.get(key), dict):
                for sub in schema[key].values():
                    _closed_objects(sub)
        for key in _SUBSCHEMAS:
            if isinstance(schema.get(key), (dict, list)):
                _closed_objects(schema[key])
        if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
            schema["additionalProperties"] = False
    return schema


def _first_line(message: str) -> str:
    """llguidance's message on one line, shortened (it can quote a whole grammar)."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip()) or "rejected by the compiler"
    return text if len(text) <= 300 else text[:297] + "..."


def token_masks_batch(vocab_size: int) -> dict[str, np.ndarray]:
    """The batch of `steps.write_token_masks`: MASK_ROWS slots (-1: none), which of their bitmasks
    (sampling.GRAMMAR_MASK or SAMPLE_MASK) and those bitmasks (all ids allowed)."""
    return {"slot": np.full(MASK_ROWS, -1, np.int32), "which": np.zeros(MASK_ROWS, np.int32),
            "mask": np.full((MASK_ROWS, mask_words(vocab_size)), -1, np.int32)}


def write_masks(programs, vocab_size: int, rows) -> None:
    """For each (slot, which, make) of `rows`, puts the bitmask `make()` computes into that slot's bitmask `which` on
    the device, MASK_ROWS a call (a bitmask longer than the model's vocabulary's, llguidance's, is cut to it)."""
    rows = list(rows)
    for start in range(0, len(rows), MASK_ROWS):
        part = rows[start:start + MASK_ROWS]
        batch = token_masks_batch(vocab_size)
        for i, (slot, which, make) in enumerate(part):
            batch["slot"][i], batch["which"][i] = slot, which
            batch["mask"][i] = make()[:batch["mask"].shape[1]]
        programs.run(TOKEN_MASKS, batch)
