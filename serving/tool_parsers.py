"""Tool-call parsers for /v1/chat/completions (vLLM's `--tool-call-parser`): the calls a model writes in its text,
as OpenAI's `tool_calls`, whole (`extract`) or streamed (`feed` / `finish`).

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more;
  the content is the text before the first. Arguments the model wrote as a JSON string of an object are that object.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calls): `{"name": ..., "parameters": {...}}` (or `arguments`),
  several separated by `;`. Whole, every such object in the text is a call and the content is dropped, as vLLM's;
  streamed, only an output that starts with one (or with `<|python_tag|>`) is read as calls, as vLLM's.
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls (`[{"name": ..., "arguments": {...}}]`), or, as tekken
  tokenizers from v11 write them, `[TOOL_CALLS]name{arguments}` for each call (arguments as written). Ids are
  Mistral's: 9 letters and digits, which its templates check.

A call's id is vLLM's `chatcmpl-tool-<32 hex>` (mistral's own above). Arguments are the JSON text
`json.dumps(value, ensure_ascii=False)` gives, whole or streamed (json_stream.py): streamed, each delta carries what
the model completed since the last, and the deltas of a call add up to its whole arguments. A call streams once its
name is whole and its arguments began (its first delta: `index`, `id`, `type`, `function.name`); text the parser
holds back (a tag that may be starting, an object that may be a call) goes out as content once it turns out not to
be one. When a stream's first call is not valid JSON the text it held goes out as content and the rest of the
output is content, as the whole text gives it; after a call streamed, what follows a broken call is dropped.
"""
import dataclasses
import json
import logging
import random
import re
import string
import uuid

from jaxstream.serving.json_stream import JsonError, JsonReader, normal_text

logger = logging.getLogger(__name__)

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
_WHITESPACE = " \t\n\r"


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's make_tool_call_id


def mistral_tool_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag that may be arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _string_arguments(value: str) -> str:
    """Arguments a model wrote as a JSON string: the object it serializes (Granite 4's habit, vLLM's hermes), else
    the string itself as JSON."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    return json.dumps(parsed if isinstance(parsed, dict) else value, ensure_ascii=False)


class _Call:
    """A tool call read from the events of its JSON object `{"name": ..., "arguments": ...}` whose members are at
    `depth`: the name once whole, the arguments as json.dumps writes them."""

    def __init__(self, depth: int, argument_keys: tuple[str, ...], unwrap_strings: bool):
        self.depth = depth
        self._argument_keys = argument_keys
        self._unwrap = unwrap_strings
        self.name: str | None = None
        self.arguments_key: str | None = None
        self.arguments: list[str] = []
        self._member: str | None = None
        self._bad_name = False
        self.complete = False

    def event(self, event: tuple) -> None:
        kind, value, depth = event
        if depth == self.depth - 1:  # the object itself opens or closes
            self.complete = kind == "close"
        elif depth == self.depth and kind == "key":
            self._member = value
        elif depth == self.depth and kind in (",", ":"):
            pass
        elif self._member == "name":
            if depth == self.depth and kind == "string_end" and self.name is None:
                self.name = value
            elif depth == self.depth and kind in ("open", "scalar"):
                self._bad_name = True
        elif self._member in self._argument_keys and self.arguments_key in (None, self._member):
            self.arguments_key = self._member
            if self._unwrap and depth == self.depth and kind in ("string_start", "chars", "string_end"):
                if kind == "string_end":  # whether it serializes an object shows at its end only
                    self.arguments.append(_string_arguments(value))
            else:
                self.arguments.append(normal_text(event))

    @property
    def started(self) -> bool:
        """Name whole and arguments begun: the call streams from here."""
        return self.name is not None and self.arguments_key is not None and not self._bad_name

    @property
    def valid(self) -> bool:
        return self.complete and self.started


class ToolParser:
    """One output's tool calls. Whole: `extract(text)` -> (content or None, calls). Streamed: `feed(text)` and, at the
    end of the output, `finish()`, each -> (content, tool-call deltas in OpenAI's stream shape); `called` says
    whether a call streamed."""

    markers: tuple[str, ...] = ()  # control tokens the parser reads, written into the text where a tokenizer has them
    argument_keys: tuple[str, ...] = ("arguments",)
    unwrap_string_arguments = False

    def __init__(self):
        self._buffer = ""  # text not read yet
        self._state = "content"
        self._held: list[str] = []  # the raw text read since the first call began, until a call streams
        self._streamed: list[dict] = []  # per call index: the call, and how many pieces of its arguments went out
        self._reader: JsonReader | None = None
        self._call: _Call | None = None
        self._content: list[str] = []
        self._deltas: dict[int, dict] = {}

    @property
    def called(self) -> bool:
        return bool(self._streamed)

    def new_id(self) -> str:
        return tool_call_id()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> tuple[str, list[dict]]:
        self._content, self._deltas = [], {}
        try:
            self._step(final)
        except JsonError as exc:
            self._broken(f"a tool call is not valid JSON ({exc})")
        if final and self._state not in ("content", "passthrough", "done") and not self._streamed:
            self._broken("the output ends inside a tool call")
        content = "".join(self._content)
        return content, list(self._deltas.values())

    def _step(self, final: bool) -> None:
        """Reads the buffer state by state: the shared states here, the parser's own in its `_read`."""
        while self._buffer or final:
            if self._state == "passthrough":  # no call (any more): the rest is content
                self._emit(self._buffer)
                self._buffer = ""
            elif self._state == "done":  # after the calls: the rest is dropped
                self._buffer = ""
            elif self._read(final):
                continue
            break

    def _read(self, final: bool) -> bool:
        """Reads some of the buffer in one of the parser's own states; whether to read on."""
        raise NotImplementedError

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _take(self, size: int) -> str:
        """Consumes `size` characters of the buffer, kept while the parser may still give them back as content."""
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        if not self._streamed:
            self._held.append(taken)
        return taken

    def _broken(self, why: str) -> None:
        """What the parser read is no tool call: before any call streamed it was content, and the rest of the output
        is (as the whole text's parse gives it); after one, the rest is dropped."""
        logger.debug("tool call parser: %s", why)
        if self._streamed:
            self._state, self._buffer = "done", ""
        else:
            self._emit("".join(self._held) + self._buffer)
            self._held, self._buffer, self._state = [], "", "passthrough"
        self._reader = self._call = None

    def _skip_whitespace(self) -> bool:
        """Consumes leading whitespace; whether anything is left to read."""
        stripped = self._buffer.lstrip(_WHITESPACE)
        self._take(len(self._buffer) - len(stripped))
        return bool(self._buffer)

    def _open_json(self, opening: str, depth: int, state: str, what: str) -> bool:
        """Past whitespace, begins reading a JSON value that must open with `opening` (a call at `depth` 0, a list of
        calls at 1), in `state` from then on; False while only whitespace has come."""
        if not self._skip_whitespace():
            return False
        if self._buffer[0] != opening:
            raise JsonError(f"{what} with {self._buffer[0]!r}")
        self._start_json(depth)
        self._state = state
        return True

    def _start_json(self, depth: int) -> None:
        self._reader = JsonReader()
        if depth == 0:
            self._call = _Call(1, self.argument_keys, self.unwrap_string_arguments)

    def _start_named_call(self, name: str) -> None:
        """Begins a call whose name is known and whose arguments follow as text (`self._call.arguments`)."""
        self._call = _Call(1, (), False)
        self._call.name, self._call.arguments_key = name, "arguments"

    def _read_json(self) -> bool:
        """Feeds the buffer to the JSON value being read, streaming its calls; whether the value ended."""
        events, end = self._reader.feed(self._buffer)
        self._take(len(self._buffer) if end is None else end)
        for event in events:
            kind, value, depth = event
            if self._call is None and depth == 1 and kind != ",":  # a call in a list of calls
                if kind != "open" or value != "{":
                    raise JsonError("a list of tool calls holds something else than objects")
                self._call = _Call(2, self.argument_keys, self.unwrap_string_arguments)
            if self._call is not None:
                self._call.event(event)
                self._stream_call()
                if self._call.complete:
                    if not self._call.valid:
                        raise JsonError("an object that is no tool call (it needs a name and arguments)")
                    self._call = None
        return end is not None

    def _stream_call(self) -> None:
        call = self._call
        if not call.started:
            return
        if not self._streamed or self._streamed[-1]["call"] is not call:
            self._streamed.append({"call": call, "sent": 0})
            self._held = []
            index = len(self._streamed) - 1
            self._deltas[index] = {"index": index, "id": self.new_id(), "type": "function",
                                   "function": {"name": call.name}}
        record, index = self._streamed[-1], len(self._streamed) - 1
        arguments = "".join(call.arguments[record["sent"]:])
        record["sent"] = len(call.arguments)
        if arguments:
            delta = self._deltas.setdefault(index, {"index": index, "function": {}})
            delta["function"]["arguments"] = delta["function"].get("arguments", "") + arguments


class HermesToolParser(ToolParser):
    markers = (HERMES_START, HERMES_END)
    unwrap_string_arguments = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(HERMES_START)
        if start < 0:
            return text, []
        calls = []
        try:
            # vLLM's regions: from a start tag to the first end tag after it (or to the end of the text), so a start
            # tag inside a call's argument string is the argument's text.
            for match in _HERMES_CALL.finditer(text, start):
                call = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
                arguments = call["arguments"]
                arguments = (_string_arguments(arguments) if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False))
                if not isinstance(call["name"], str):
                    raise TypeError("the name is not a string")
                calls.append(ToolCall(call["name"], arguments, self.new_id()))
        except (ValueError, KeyError, TypeError) as exc:
            logger.debug("hermes tool call parser: no tool call in the output (%s)", exc)
            return text, []
        return text[:start] or None, calls

    def _read(self, final: bool) -> bool:
        if self._state in ("content", "between"):
            start = self._buffer.find(HERMES_START)
            if start >= 0:
                text = self._buffer[:start]
                self._buffer = self._buffer[start:]
                if self._state == "content":
                    self._emit(text)
                self._take(len(HERMES_START))
                self._state = "open"
                return True
            keep = 0 if final else partial_tag(self._buffer, HERMES_START)
            if self._state == "content":
                self._emit(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
        elif self._state == "open":
            return self._open_json("{", 0, "call", "a tool call starts")
        elif self._state == "call":
            if self._read_json():
                self._state = "close"
                return True
        elif self._state == "close":
            if not self._skip_whitespace():
                return False
            if self._buffer.startswith(HERMES_END):
                self._take(len(HERMES_END))
                self._state = "between"
                return True
            if final or not HERMES_END.startswith(self._buffer):
                raise JsonError(f"text after a tool call's JSON: {self._buffer[:20]!r}")
        return False


class Llama3JsonToolParser(ToolParser):
    argument_keys = ("arguments", "parameters")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if PYTHON_TAG not in text and "{" not in text:
            return text, []
        decoder, calls, end = json.JSONDecoder(), [], -1
        for start in (i for i, char in enumerate(text) if char == "{"):
            if start < end:
                continue  # inside an object read already
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                continue
            key = "arguments" if "arguments" in value else "parameters"
            if isinstance(value.get("name"), str) and key in value:
                calls.append(ToolCall(value["name"], json.dumps(value[key], ensure_ascii=False), self.new_id()))
        return (None, calls) if calls else (text, [])

    def _read(self, final: bool) -> bool:
        if self._state == "content":  # the output's start: a call, or content throughout
            if self._buffer.startswith(PYTHON_TAG):
                self._take(len(PYTHON_TAG))
                self._state = "next"
                return True
            if self._buffer.startswith("{"):
                self._state = "next"
                return True
            if not final and PYTHON_TAG.startswith(self._buffer):
                return False
            self._state = "passthrough"
            return True
        elif self._state in ("next", "separator"):
            if not self._skip_whitespace():
                return False
            if self._state == "separator" and self._buffer[0] == ";":
                self._take(1)
                self._state = "next"
                return True
            if self._buffer[0] != "{":
                if not self._streamed:
                    raise JsonError(f"a tool call starts with {self._buffer[0]!r}")
                self._state = "done"  # text after the calls: dropped, as the whole text's parse drops it
                return True
            self._start_json(0)
            self._state = "call"
            return True
        elif self._state == "call":
            if self._read_json():
                self._state = "separator"
                return True
        return False


class MistralToolParser(ToolParser):
    markers = (MISTRAL_TOOL_CALLS,)

    def __init__(self, *, v11: bool):
        super().__init__()
        self.v11 = v11  # [TOOL_CALLS]name{arguments} per call, else one JSON list after [TOOL_CALLS]
        self._name = ""
        self._arguments = ""

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if MISTRAL_TOOL_CALLS not in text:
            return text, []
        content, *raw_calls = text.split(MISTRAL_TOOL_CALLS)
        if self.v11:  # calls without arguments are left out; arguments are kept as written, valid JSON or not
            calls = [ToolCall(raw[:raw.index("{")], raw[raw.index("{"):], self.new_id())
                     for raw in raw_calls if "{" in raw]
            return content or None, calls
        listed = raw_calls[0].strip()
        try:
            if len(raw_calls) != 1:
                raise ValueError("more than one [TOOL_CALLS] in the output")
            try:
                values = json.loads(listed)
            except ValueError:  # vLLM's fallback: the first thing that looks like a list of objects
                start, end = listed.find("[{"), listed.rfind("}]")
                if start < 0 or end < start:
                    raise
                values = json.loads(listed[start:end + 2])
            calls = [ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False), self.new_id())
                     for value in values]
            if not all(isinstance(call.name, str) for call in calls):
                raise TypeError("a name is not a string")
        except (ValueError, KeyError, TypeError) as exc:
            logger.debug("mistral tool call parser: no tool call in the output (%s)", exc)
            # vLLM's content: the output without its [TOOL_CALLS] markers, stripped (its `tool_content`).
            return (content + "".join(raw_calls)).strip(), []
        return content or None, calls

    def _read(self, final: bool) -> bool:
        if self._state == "content":
            start = self._buffer.find(MISTRAL_TOOL_CALLS)
            if start >= 0:  # the tag is no content, even when what follows turns out to be
                self._emit(self._buffer[:start])
                self._buffer = self._buffer[start + len(MISTRAL_TOOL_CALLS):]
                self._state = "name" if self.v11 else "list"
                return True
            keep = 0 if final else partial_tag(self._buffer, MISTRAL_TOOL_CALLS)
            self._emit(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
        elif self._state == "list":
            return self._open_json("[", 1, "calls", "the tool calls start")
        elif self._state == "calls":
            if self._read_json():
                self._state = "passthrough"  # text after the list is content, as vLLM streams it
                return True
        elif self._state == "name":
            return self._v11_name(final)
        elif self._state == "arguments":
            return self._v11_arguments(final)
        return False

    def _v11_name(self, final: bool) -> bool:
        """Reads a call's name, up to its arguments' "{"; whether they began."""
        brace = self._buffer.find("{")
        self._name += self._take(len(self._buffer) if brace < 0 else brace)
        if brace < 0:
            if final:
                self._state = "done"  # a call without arguments is left out
            return False
        self._start_named_call(self._name)
        self._name, self._state = "", "arguments"
        return True

    def _v11_arguments(self, final: bool) -> bool:
        """Streams a call's arguments as written, up to the next call's tag; whether that came."""
        start = self._buffer.find(MISTRAL_TOOL_CALLS)
        keep = 0 if final or start >= 0 else partial_tag(self._buffer, MISTRAL_TOOL_CALLS)
        self._call.arguments.append(self._take(len(self._buffer) - keep if start < 0 else start))
        self._stream_call()
        if start < 0:
            if final:
                self._call, self._state = None, "done"
            return False
        self._take(len(MISTRAL_TOOL_CALLS))
        self._call, self._state = None, "name"
        return True


# vLLM's --tool-call-parser names -> the parser of one output, given whether the tokenizer is a Mistral one from v11.
TOOL_PARSERS = {"hermes": lambda v11: HermesToolParser(), "llama3_json": lambda v11: Llama3JsonToolParser(),
                "mistral": lambda v11: MistralToolParser(v11=v11)}
