"""Chat's forced tool calls: `tool_choice` "required" or a named function, served as vLLM serves them (its protocol's
JSON schema from the tools, tool_parsers/utils.py's `get_json_schema_from_tools`, and serving_chat.py's named and
required branches).

The request: the call is forced with structured outputs (structured_output_fields.py), a JSON schema built from the
tools, with or without `--enable-auto-tool-choice` (only "auto" needs it and a tool-call parser, as in vLLM):
- a named function (`{"type": "function", "function": {"name": ...}}`): the function's `parameters`; the output is the
  call's arguments;
- "required": an array of at least one `{"name": <a tool's name>, "parameters": <its parameters>}` (an `anyOf` of one
  object schema a tool), the tools' `$defs` gathered at the top (one name defined two ways is a 400, as in vLLM); the
  output is the list of calls.
A tool without `parameters` takes an empty object. `structured_outputs` may add its options (`disable_any_whitespace`,
`disable_additional_properties`) but no constraint of its own: vLLM's 400 "You can only either use constraints for
structured outputs or tools, not both".

The answer: `message.tool_calls` (ids `chatcmpl-tool-<32 hex>`, or Mistral's 9 letters and digits with a Mistral
tokenizer, whose templates check them, as vLLM's `MistralToolCall`; type function, the name, the arguments as JSON text)
with content "" (vLLM's), and finish reason "tool_calls" for "required" when the model stopped by itself, the engine's
("stop") for a named function (OpenAI's rule, vLLM's). Streamed, each call's first `delta.tool_calls` entry carries its
index, id, type and name, then its arguments come in pieces as the model completes them. Arguments are the text
`json.dumps(value, ensure_ascii=False)` gives (json_stream.py), whole or streamed, so the deltas add up to the whole
answer's. With `--reasoning-parser` the grammar starts after the reasoning (chat_parsing.py), whose text the parser
takes first.

Where this differs from vLLM: a named call's arguments are that normal JSON text too (vLLM passes on the model's text,
with whatever whitespace the grammar allowed); `parallel_tool_calls: false` with "required" adds `maxItems: 1` to the
schema, so one call is generated rather than several of which all but the first are dropped; a named function without
`parameters` is held to an object (vLLM leaves it unconstrained); an output cut short (`max_tokens`) gives the calls
begun, with the arguments read so far (vLLM's whole answer fails on it).
"""
import copy

from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.json_stream import JsonError, JsonReader, normal_text
from jaxstream.serving.tool_parsers import ToolCall, ToolParser, mistral_tool_call_id

_NO_PARAMETERS = {"type": "object", "properties": {}}


def forced_name(tool_choice) -> str | None:
    """The function a named tool choice forces (None for any other choice)."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def is_forced(tool_choice) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, dict)


def schema(tool_choice, tools: list[dict], *, parallel_tool_calls: bool) -> dict:
    """The JSON schema the output of a forced `tool_choice` ("required" or named) follows, over the request's `tools`
    (as chat_parsing.parse_tools shapes them)."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    name = forced_name(tool_choice)
    if name is not None:
        return copy.deepcopy(functions[name]["parameters"] or _NO_PARAMETERS)
    calls, definitions = [], {}
    for function in functions.values():
        parameters = copy.deepcopy(function["parameters"] or _NO_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if definitions.setdefault(key, value) != value:
                raise RequestError(400, "invalid_request", f"Tool definition '{key}' has multiple schemas, which is "
                                   "not supported.", "tools")  # vLLM's words
        calls.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters}, "required": ["name", "parameters"]})
    forced = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel_tool_calls:
        forced["maxItems"] = 1
    if definitions:
        forced["$defs"] = definitions
    return forced


def finish_reason(tool_choice, reason: str, called: bool) -> str:
    """A forced choice's finish reason: "tool_calls" for "required" calls the model ended itself, else the engine's."""
    return "tool_calls" if tool_choice == "required" and called and reason == "stop" else reason


def parser(tool_choice, *, mistral_ids: bool = False) -> ToolParser:
    """The reader of one choice's output under a forced `tool_choice` (`mistral_ids`: a Mistral tokenizer's)."""
    name = forced_name(tool_choice)
    return RequiredCallsParser(mistral_ids) if name is None else NamedCallParser(name, mistral_ids)


class _ForcedParser(ToolParser):
    """The whole output read as the stream reads it, so that both give the same calls."""

    def __init__(self, mistral_ids: bool):
        super().__init__()
        self._mistral_ids = mistral_ids

    def new_id(self) -> str:
        return mistral_tool_call_id() if self._mistral_ids else super().new_id()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, deltas = self.feed(text)
        more, final = self.finish()
        calls: dict[int, ToolCall] = {}
        for delta in deltas + final:
            if "id" in delta:
                calls[delta["index"]] = ToolCall(delta["function"]["name"], "", delta["id"])
            calls[delta["index"]].arguments += delta["function"].get("arguments", "")
        return content + more, list(calls.values())


class RequiredCallsParser(_ForcedParser):
    """"required": the output is a JSON list of `{"name", "parameters"}` objects, each a call."""

    argument_keys = ("parameters",)

    def _read(self, final: bool) -> bool:
        if self._state == "content":
            return self._open_json("[", 1, "calls", "the tool calls start")
        if self._state == "calls" and self._read_json():
            self._state = "done"
            return True
        return False


class NamedCallParser(_ForcedParser):
    """A named function: the output is the arguments of one call of it, which opens at once (an empty output is a
    call with empty arguments, as vLLM's)."""

    def __init__(self, name: str, mistral_ids: bool):
        super().__init__(mistral_ids)
        self._name = name

    def _read(self, final: bool) -> bool:
        if self._state == "content":
            self._reader = JsonReader()
            self._start_named_call(self._name)
            self._stream_call()
            self._state = "arguments"
            return True
        events, end = self._reader.feed(self._buffer)
        self._take(len(self._buffer) if end is None else end)
        if final and end is None and self._reader.depth == 0 and not self._reader.done:
            try:
                events += self._reader.finish()  # a bare number ends with the text
            except JsonError:
                pass  # nothing began, or the output was cut short: the arguments read so far
        self._call.arguments += [normal_text(event) for event in events]
        self._stream_call()
        if end is not None or final:
            self._state = "done"
        return False
