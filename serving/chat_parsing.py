"""Chat's tools and the server's output parsers, as vLLM's serving_chat.py applies them (serving/http_chat.py's).

The request: `tools` (a non-empty list of `{"type": "function", "function": {"name", "description", "parameters"}}`)
reach the chat template whenever given, in the shape vLLM's pydantic models give them (a function's `description` and
`parameters` null when left out), `tool_choice: "none"` included (vLLM's --exclude-tools-when-tool-choice-none is off
by default). `tool_choice` defaults to "auto" with tools and "none" without; "auto" needs the server's
`--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's 400 otherwise, but for a Mistral tokenizer, which vLLM
lets through unparsed). "required" and a named function force the call with structured outputs, as vLLM does, flags
or not (forced_tool_calls.py). `parallel_tool_calls: false` keeps a choice's first call only.

The output (`ChoiceOutput`, one per choice): the text as the engine decoded it, with the control tokens the parsers
read written in by name (a tokenizer that holds `[TOOL_CALLS]` or `<tool_call>` as special tokens skips them when
decoding; vLLM decodes those with skip_special_tokens=False), goes through the reasoning parser (`--reasoning-parser`:
reasoning_parsers.py), then its content through the tool-call parser when the request parses calls (tool_parsers.py),
or the forced call's reader (forced_tool_calls.py). A request's structured outputs (a forced call's too) apply once the
reasoning ends, as vLLM applies them with a reasoning parser: from the parser's `</think>` id on (`grammar_start_id`).
Reasoning is sent as `reasoning` (vLLM's field) and `reasoning_content` (its older name, which it sent alongside while
deprecating it); `include_reasoning: false` (vLLM's) leaves it out, with the logprobs and token ids that would show it.
"""
import contextlib
import functools

from jaxstream.models.chat_templates import MistralChatTemplate
from jaxstream.models.tokenizers import NUM_CONTROL_IDS
from jaxstream.serving import forced_tool_calls
from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.reasoning_parsers import THINK_END, reasoning_parser
from jaxstream.serving.tool_parsers import TOOL_PARSERS

# vLLM's words
_AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def parse_tools(body: dict) -> list[dict] | None:
    """The request's tools as a template takes them (vLLM's ChatCompletionToolsParam dumped: type, function with name,
    description and parameters first, the client's other keys after); None without tools."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "invalid_request", "tools must be a list of tools", "tools")
    if not tools:
        raise RequestError(400, "invalid_request", "`tools` must not be an empty array. Either provide at least one "
                           "tool or omit the field entirely.", "tools")
    shaped = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("description"), str | None)
                or not isinstance(function.get("parameters"), dict | None)):
            raise RequestError(400, "invalid_request", f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": string, \"description\": string, \"parameters\": JSON schema object}}",
                               f"tools[{i}]")
        function = {"name": function["name"], "description": function.get("description"),
                    "parameters": function.get("parameters"), **function}
        shaped.append({"type": "function", **tool, "function": function})
    return shaped


def parse_tool_choice(body: dict, tools: list[dict] | None, state, template) -> str | dict | None:
    """The request's tool choice, checked as vLLM checks it: "none", "auto", "required", a named function (the body's
    object), or None (an explicit null with tools, which vLLM parses as "auto" without asking for the flags).
    RequestError 400 otherwise."""
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none" or choice is None:
        return choice
    if tools is None:
        raise RequestError(400, "invalid_request", "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise RequestError(400, "invalid_request", f"Invalid value for `function`: `{function}` in `tool_choice`! "
                               f"{_NAMED_USAGE}", "tool_choice.function")
        if "name" not in function:
            raise RequestError(400, "invalid_request", "Expected field `name` in `function` in `tool_choice`! "
                               f"{_NAMED_USAGE}", "tool_choice.function.name")
        if not isinstance(function["name"], str) or function["name"] not in {tool["function"]["name"]
                                                                               for tool in tools}:
            raise RequestError(400, "invalid_request", "The tool specified in `tool_choice` does not match any of "
                               "the specified `tools`", "tool_choice")
    elif choice not in ("auto", "required"):
        raise RequestError(400, "invalid_request", f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                           "\"none\", \"auto\" or \"required\" are supported.", "tool_choice")
    if choice != "auto":
        return choice
    config = state.config
    if not (config.enable_auto_tool_choice and config.tool_call_parser) and not isinstance(
            template, MistralChatTemplate):
        raise RequestError(400, "invalid_request", _AUTO_NEEDS_FLAGS, "tool_choice")
    return choice


class ChatParsing:
    """A request's output parsing: what each of its choices' `ChoiceOutput` needs. `active` says whether any parser
    applies (else a choice's text is its content, as without parsers)."""

    def __init__(self, state, template, body: dict, tool_choice: str | None, prompt_text: str, variables: dict | None,
                 *, include_reasoning: bool, parallel_tool_calls: bool):
        config = state.config
        self.reasoning_name = config.reasoning_parser
        self.tool_name = config.tool_call_parser if (
            config.enable_auto_tool_choice and body.get("tools") and tool_choice in ("auto", None)) else None
        self.forced = tool_choice if forced_tool_calls.is_forced(tool_choice) else None
        self.mistral = isinstance(template, MistralChatTemplate)
        self.v11 = self.mistral and template.version >= 11
        self.prompt_text = prompt_text
        self.variables = variables
        self.include_reasoning = include_reasoning
        self.parallel_tool_calls = parallel_tool_calls
        self.tokenizer = state.engine.tokenizer
        self.active = bool(self.reasoning_name or self.tool_name or self.forced)

    @property
    def hides_metadata(self) -> bool:
        """vLLM's: without the reasoning, no logprobs or token ids either (they would show it)."""
        return self.reasoning_name is not None and not self.include_reasoning

    def grammar_start_id(self) -> int | None:
        """The id after which the request's structured outputs apply: the reasoning parser's `</think>` when the
        output starts with reasoning (vLLM's rule: a grammar applies once the reasoning ends), None when they apply
        from the first token (no parser, thinking off, a tokenizer without `</think>` as one token)."""
        if not self.reasoning_name or reasoning_parser(self.reasoning_name, self.variables,
                                                       self.prompt_text).reasoning is None:
            return None
        ids = self.tokenizer.encode(THINK_END)
        return ids[0] if len(ids) == 1 else None

    def output(self, prompt_ids: list[int]) -> "ChoiceOutput":
        reasoning = (reasoning_parser(self.reasoning_name, self.variables, self.prompt_text)
                     if self.reasoning_name else None)
        if self.forced is not None:
            tools = forced_tool_calls.parser(self.forced, mistral_ids=self.mistral)
        else:
            tools = TOOL_PARSERS[self.tool_name](self.v11) if self.tool_name else None
        markers = tuple(marker for parser in (reasoning, tools) if parser is not None for marker in parser.markers)
        return ChoiceOutput(self, reasoning, tools, control_markers(self.tokenizer, markers), prompt_ids)


class ChoiceOutput:
    """One choice's output through the parsers: `delta` for each streamed piece, `message` for the whole."""

    def __init__(self, parsing: ChatParsing, reasoning, tools, markers: dict[int, str], prompt_ids: list[int]):
        self._parsing = parsing
        self._reasoning = reasoning
        self._tools = tools
        self._markers = markers
        self._ids = list(prompt_ids)  # the ids before the next piece: where the decoder that places markers starts

    @property
    def called(self) -> bool:
        """Whether a tool call streamed."""
        return self._tools is not None and self._tools.called

    def delta(self, text: str, token_ids: list[int], *, final: bool) -> dict:
        """A stream chunk's delta for the next piece of output (the last one when `final`): its content, reasoning and
        tool-call deltas, as far as the parsers settled them."""
        text = self._with_markers(text, token_ids)
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        if final and self._reasoning:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls = []
        if self._tools:
            content, calls = self._tools.feed(content)
            if final:
                more_content, more_calls = self._tools.finish()
                content, calls = content + more_content, _merged(calls + more_calls)
        delta = {}
        if content:
            delta["content"] = content
        if reasoning and self._parsing.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if not self._parsing.parallel_tool_calls:
            calls = [call for call in calls if call["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self, text: str, token_ids: list[int]) -> tuple[dict, bool]:
        """The whole output's message fields (content, reasoning, tool_calls) and whether it called tools."""
        text = self._with_markers(text, token_ids)
        fields, content = {}, text
        if self._reasoning:
            self._reasoning.feed(text)
            self._reasoning.finish()
            content = self._reasoning.content or None
            reasoning = self._reasoning.reasoning if self._parsing.include_reasoning else None
            fields = {"reasoning": reasoning, "reasoning_content": reasoning}
        calls = []
        if self._tools and content is not None:
            content, calls = self._tools.extract(content)
            if calls and content is not None and not content.strip():
                content = "" if self._parsing.forced is not None else None  # vLLM's
        if not self._parsing.parallel_tool_calls:
            calls = calls[:1]
        message = {"content": content, **fields}
        if calls:
            message["tool_calls"] = [call.body() for call in calls]
        return message, bool(calls)

    def _with_markers(self, text: str, token_ids: list[int]) -> str:
        """`text` with the control tokens among `token_ids` that the parsers read written in where they came: after
        the text the ids before them decode to (a decoder primed with the ids before this piece places them)."""
        if not self._markers:
            return text
        if self._markers.keys().isdisjoint(token_ids):
            self._ids.extend(token_ids)
            return text
        before = list(self._ids)
        self._ids.extend(token_ids)
        pieces, position, decoder, decoded = [], 0, None, 0
        for k, token_id in enumerate(token_ids):
            if token_id not in self._markers:
                continue
            if k > decoded:
                if decoder is None:
                    decoder = self._parsing.tokenizer.stream_decoder()
                    decoder.prime(before)
                end = position + len(decoder.push_many(token_ids[decoded:k]))
                decoded = k
                if end > len(text):  # past what the text kept (a stop string cut it): the marker is not in it
                    break
                pieces.append(text[position:end])
                position = end
            pieces.append(self._markers[token_id])
        pieces.append(text[position:])
        return "".join(pieces)


def _merged(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas of one chunk, one per call (a call's header and its arguments together)."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        if delta["index"] not in merged:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
            continue
        function = merged[delta["index"]]["function"]
        if "arguments" in delta["function"]:
            function["arguments"] = function.get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


@functools.lru_cache(maxsize=8)
def control_markers(tokenizer, names: tuple[str, ...]) -> dict[int, str]:
    """The control ids of `tokenizer` named one of `names` -> their names (a tokenizer that has them as text has
    none: their text is in the output already). Control ids are those below NUM_CONTROL_IDS in the Voxtral layout
    (tekken, sentencepiece), and a tokenizer.json's special tokens, which it reads in text as their ids."""
    if not names or tokenizer is None:
        return {}
    candidates = set(range(min(NUM_CONTROL_IDS, tokenizer.vocab_size)))
    for name in names:
        with contextlib.suppress(ValueError):  # a vocabulary without its characters has no such token either
            candidates.update(tokenizer.encode(name))
    return {token_id: name for token_id in sorted(candidates)
            if tokenizer.is_control(token_id) and (name := tokenizer.token_string(token_id)) in names}
