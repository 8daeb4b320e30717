"""The request fields that ask for structured outputs (vLLM's guided decoding) on /v1/completions and
/v1/chat/completions, read into the engine's `StructuredOutputsParams`.

What vLLM takes, and how it combines them (its protocol's `structured_outputs_from_response_format`):
- `structured_outputs`: {`json` (a JSON schema, or its JSON text), `regex`, `choice` (a list of strings), `grammar`
  (Lark or GBNF), `json_object`: true} (one of them), with the options `disable_any_whitespace` and
  `disable_additional_properties`. Its `whitespace_pattern` and `structural_tag` are refused (400
  `unsupported_parameter`: the engine takes neither). Other keys are ignored, as vLLM's dataclass ignores them.
- OpenAI's `response_format`: `{"type": "text"}` asks for nothing, `{"type": "json_object"}` is `json_object`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}` is `json` (its `schema`; the
  grammar is always strict, so `strict` changes nothing); `structural_tag` is refused. It overrides the constraint of
  `structured_outputs` of its own kind (a `json` schema) and keeps that object's options; with a constraint of
  another kind the request is a 400, as vLLM's `replace` then holds two.
- vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`, removed in vLLM 0.12, are taken as
  the fields of `structured_outputs` they became: a client written for an older vLLM gets the constraint it asks for
  (vLLM < 0.12 took them, and vLLM >= 0.12 ignores them, a silent unconstrained answer). `guided_whitespace_pattern`
  is refused as `whitespace_pattern` is; `guided_decoding_backend` is ignored (one backend here).

Where this differs from vLLM: an old field beside a constraint in `structured_outputs` is a 400 (vLLM < 0.12 silently
preferred `structured_outputs`); `structured_outputs` holding only options is taken where another field gives the
constraint (`response_format`, a `guided_*` field, chat's forced tool call: vLLM < 0.12's merge; vLLM >= 0.12 refuses
an object without a constraint); a `json_schema` without `schema` is a 400 (vLLM's result too, but beside a
`structured_outputs` constraint of another kind, which it then applies). Every refusal is a 400 whose `param` names
the field the client sent.

Before a request is admitted, the engine compiles its grammar (`check_grammar`: `AsyncEngine.check_sampling_params`,
into the cache the request's run takes it from), and refuses an invalid schema, regex or grammar, a model without a
tokenizer and a tokenizer llguidance cannot read (a sentencepiece model): a 400 too, before any byte of a stream, as
vLLM's front end checks the grammar before it queues the request. A valid request's stream (`stream: true`) opens at
once, as an unconstrained one's. Structured outputs with streaming input (`X-Streaming-Input`, Mode B sessions) are
refused: a grammar cannot span chunks that each end anywhere in it.
"""
import dataclasses

from jaxstream.engine.requests import STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutputsParams
from jaxstream.errors import EngineError, InvalidRequestError
from jaxstream.serving.http_errors import RequestError, engine_request_error

OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
# vLLM's options the engine does not take, in structured_outputs (whitespace_pattern also as an old top-level field).
_UNSUPPORTED = ("whitespace_pattern", "structural_tag")
# vLLM < 0.12's top-level fields -> the structured_outputs field each became.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_NOT_BOTH = "You can only either use constraints for structured outputs or tools, not both."  # vLLM's words


@dataclasses.dataclass
class Requested:
    """The structured outputs a body asks for: the `StructuredOutputsParams` fields it gave (a constraint at most, and
    options) and the body field the constraint came from (`param`: what an error names)."""

    fields: dict
    param: str | None = None

    @property
    def constraint(self) -> str | None:
        return next((kind for kind in STRUCTURED_OUTPUT_KINDS if kind in self.fields), None)

    def params(self, **extra) -> StructuredOutputsParams | None:
        """The engine's parameters (with `extra` fields, such as `reasoning_end_token_id`), None when nothing was
        asked; RequestError 400 when the engine's checks refuse them (no constraint, a choice that is no list, ...)."""
        if not self.fields:
            return None
        try:
            return StructuredOutputsParams(**self.fields, **extra)
        except InvalidRequestError as exc:
            raise RequestError(400, "invalid_request", str(exc), self.param or "structured_outputs") from None

    def forcing(self, schema: dict) -> "Requested":
        """The request with a forced tool call's JSON schema (chat's `tool_choice` "required" or a named function) as
        its constraint; 400 when the body asked for one itself (vLLM refuses it with a named function)."""
        if self.constraint is not None:
            raise RequestError(400, "invalid_request", _NOT_BOTH, "tool_choice")
        return Requested({**self.fields, "json": schema}, "tool_choice")


def requested(body: dict) -> Requested:
    """The structured outputs `body` asks for (see the module docstring); RequestError 400 for a malformed field."""
    fields, param = _structured_outputs(body.get("structured_outputs")), None
    if fields:
        param = "structured_outputs"
    if body.get("guided_whitespace_pattern") is not None:
        raise _unsupported("guided_whitespace_pattern")
    guided = [name for name in GUIDED if body.get(name) is not None]
    if guided:
        if len(guided) > 1:
            raise RequestError(400, "invalid_request", "You can only use one kind of guided decoding "
                               f"({', '.join(map(repr, guided))}).", guided[1])
        if any(kind in fields for kind in STRUCTURED_OUTPUT_KINDS):
            raise RequestError(400, "invalid_request", f"`{guided[0]}` is the old name of a `structured_outputs` "
                               "field: send one of them", guided[0])
        fields[GUIDED[guided[0]]], param = body[guided[0]], guided[0]
    override = _response_format(body.get("response_format"))
    if override:
        (kind, value), = override.items()
        given = Requested(fields).constraint
        if given not in (None, kind):
            raise RequestError(400, "invalid_request", "You can only use one kind of structured outputs constraint: "
                               f"response_format asks for {kind}, {param} for {given}", "response_format")
        fields[kind], param = value, "response_format"
    return Requested(fields, param)


def _structured_outputs(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(400, "invalid_request", "structured_outputs must be an object of vLLM's "
                           "StructuredOutputsParams fields", "structured_outputs")
    for name in _UNSUPPORTED:
        if value.get(name) is not None:
            raise _unsupported(f"structured_outputs.{name}")
    return {name: value[name] for name in (*STRUCTURED_OUTPUT_KINDS, *OPTIONS) if value.get(name) is not None}


def _response_format(value) -> dict:
    """The constraint OpenAI's `response_format` asks for, as {field: value} (empty for text)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "structural_tag":
        raise RequestError(400, "unsupported_parameter", "`response_format` of type structural_tag is not supported "
                           "by this server", "response_format")
    if kind not in RESPONSE_FORMATS:
        raise RequestError(400, "invalid_request", "response_format must be an object whose type is one of "
                           f"{', '.join(RESPONSE_FORMATS)}", "response_format")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if spec is None:  # vLLM's words
        raise RequestError(400, "invalid_request", "When response_format type is 'json_schema', the 'json_schema' "
                           "field must be provided.", "response_format")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError(400, "invalid_request", "response_format.json_schema must be an object with a `name` "
                           "string and a `schema` object", "response_format.json_schema")
    if not isinstance(spec.get("schema"), dict):
        raise RequestError(400, "invalid_request", "response_format.json_schema.schema must be a JSON schema (an "
                           "object)", "response_format.json_schema.schema")
    return {"json": spec["schema"]}


def _unsupported(name: str) -> RequestError:
    return RequestError(400, "unsupported_parameter", f"`{name}` is not supported by this server", name)


async def check_grammar(engine, params: SamplingParams, param: str | None) -> None:
    """The engine's check of the structured outputs of `params`, asked for in the body field `param`: RequestError
    naming that field when it refuses them (the only check of the engine's the server has not made itself)."""
    if params.structured_outputs is None:
        return
    try:
        await engine.check_sampling_params(params)
    except EngineError as exc:
        refused = engine_request_error(exc)
        refused.param = param or "structured_outputs"
        raise refused from None
