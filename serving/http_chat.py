"""OpenAI's `POST /v1/chat/completions` over a served text LM, as vLLM's serving_chat.py serves it.

`messages` (roles system, developer, user, assistant, tool, or any the template takes; `content` a string, or a
list of text parts: `{"type": "text", "text": ...}`, vLLM's `input_text` / `output_text` / `refusal` or a bare string;
other part types are a 400: the model reads text only) are rendered with the model's chat template
(models/chat_templates.py: the tokenizer's, or the server's `--chat-template`) and tokenized without another BOS,
since templates write their own. The content reaches the template as vLLM's `--chat-template-content-format auto`
gives it: a template that loops over a message's content gets a list of `{"type": "text", "text": ...}` parts (a
string content is one), any other a string (the parts' texts joined with newlines). A model without a template
answers vLLM's 400, a speech model the completions route's. `add_generation_prompt` (default true),
`continue_final_message` (not both, as vLLM), `chat_template_kwargs` (template variables) and vLLM's `documents` (RAG
documents, a list of objects of strings, for the templates that read them) shape the prompt; vLLM's
`add_special_tokens` (default false) puts the tokenizer's `prompt_prefix` (BOS for most) before it. A `chat_template`
in the request is refused, as vLLM refuses it without --trust-request-chat-template.

Sampling and stopping are the completions route's (http_completions.py: `temperature`, `top_p`, `top_k`, `min_p`,
`seed`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `stop`, `stop_token_ids`, `n`
(a stream opens each choice with its role delta), `min_tokens`, `ignore_eos`, `include_stop_str_in_output`,
`return_token_ids`, `stream`, `stream_options.include_usage`), but the length: `max_completion_tokens` (OpenAI's
newer name, first) or `max_tokens`, and with neither the completion may run to the end of the context, as vLLM's
chat. What the server cannot honour is refused (`NEUTRAL`: the completions route's, and chat's legacy `functions`,
audio output, predicted outputs, ...). `logprobs: true` with `top_logprobs: N` (up to 20) gives each
choice, and each streamed chunk for its own tokens, `logprobs.content`: every token's string, logprob and bytes
with its step's N most likely tokens (token strings as http_completions.py makes them). vLLM's `prompt_logprobs: N`
(not with `stream: true`) adds the body's `prompt_logprobs`, in the completions route's shape.

Structured outputs (`structured_outputs`, `response_format`, the old `guided_*` fields: structured_output_fields.py)
constrain the answer as on the completions route; with `--reasoning-parser`, once the reasoning ends.

Tools (chat_parsing.py): `tools` reach the template; `tool_choice` "auto" (the default with tools; the server needs
`--enable-auto-tool-choice --tool-call-parser`), "none", or "required" and named functions, forced with structured
outputs (forced_tool_calls.py: no flags needed); `parallel_tool_calls`. Assistant messages carry `tool_calls` (their
JSON arguments parsed, as vLLM gives them to templates) and `reasoning` / `reasoning_content` (both, to templates that
read either); a tool message's text parts are one string. With a tool-call parser a choice's calls are its
`message.tool_calls` (streamed as `delta.tool_calls`) and its finish reason "tool_calls" (a stream's when the model
stopped by itself, as vLLM's); with `--reasoning-parser` its reasoning is `reasoning` and `reasoning_content`, apart
from its content.

The answer is a `chat.completion` (`choices[0].message` {role: assistant, content}, vLLM's `stop_reason`, usage;
with `return_token_ids` the choice's `token_ids` and the body's `prompt_token_ids`, vLLM's chat layout), or SSE
`chat.completion.chunk` events: a first delta {role: assistant, content: ""}, the content deltas, the finish
reason's chunk, the usage chunk with `include_usage`, then `data: [DONE]`. A piece of output the parsers hold back
(a tag that may be starting) makes no chunk, unless its logprobs or token ids must go out. Without a generation
prompt the role is the last message's, which the answer continues (vLLM's). Streaming input (`X-Streaming-Input`)
is served on /v1/completions and the Mode B sessions only: vLLM has no chat form of it.
"""
import dataclasses
import json

from aiohttp import web

from jaxstream.engine.requests import MAX_LOGPROBS
from jaxstream.models.chat_templates import NO_TEMPLATE_MESSAGE, ChatPrompt, ChatTemplateError
from jaxstream.serving import forced_tool_calls, sse, structured_output_fields
from jaxstream.serving.chat_parsing import ChatParsing, parse_tool_choice, parse_tools
from jaxstream.serving.completion_fields import (
    NEUTRAL as COMPLETION_NEUTRAL, check_context_length, parse_flag, parse_stream, sampling_params,
)
from jaxstream.serving.http_completions import Choice, TextInput, finite_logprob, serve_one_shot
from jaxstream.serving.http_errors import RequestError, check_kind, check_model
from jaxstream.serving.http_prompt_logprobs import prompt_logprobs_field
from jaxstream.serving.limits import holds_stream
from jaxstream.serving.structured_output_fields import Requested

ROUTE = "/v1/chat/completions"
# The part types whose text a message's content takes (vLLM's MM_PARSER_MAP: OpenAI's chat and Responses text types).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
# What chat cannot honour, with its "not used" value: the completions route's (but its prompt-only fields) and
# chat's own.
_PROMPT_ONLY = ("suffix", "add_special_tokens")  # chat takes add_special_tokens (default false)
NEUTRAL = {**{name: unused for name, unused in COMPLETION_NEUTRAL.items() if name not in _PROMPT_ONLY},
           "echo": False, "functions": None, "function_call": "none", "audio": None, "modalities": ["text"],
           "prediction": None, "web_search_options": None}
_UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.")  # vLLM's words


def chat_template(state):
    """The template the server renders chats with: 400 for a model without a tokenizer or a template."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise RequestError(400, "invalid_request", f"{state.model_id!r} has no tokenizer: chats need one")
    template = tokenizer.chat_template_for(state.config.chat_template)
    if template is None:
        raise RequestError(400, "invalid_request", f"{NO_TEMPLATE_MESSAGE} Start the server with --chat-template "
                           "FILE to give this model one.")
    return template


def parse_messages(body: dict, content_format: str = "string") -> list[dict]:
    """The conversation as a template takes it: role, content in the template's `content_format` (ChatTemplate), and
    what else a message carries for templates (`name`, `tool_call_id`, an assistant's `tool_calls` with their JSON
    arguments parsed and its reasoning as both `reasoning` and `reasoning_content`, as vLLM)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "invalid_request", "messages must be a non-empty list of messages", "messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise RequestError(400, "invalid_request", f"messages[{i}] must be an object with a role", f"messages[{i}]")
        parts = _text_parts(message.get("content"), f"messages[{i}].content")
        # A tool message's parts are one string whatever the template loops over (vLLM's: templates print tool
        # results as text).
        as_parts = content_format == "openai" and message["role"] != "tool"
        parsed = {"role": message["role"], "content": parts if as_parts else "\n".join(
            part if isinstance(part, str) else part["text"] for part in parts)}
        parsed.update({key: message[key] for key in ("name", "tool_call_id") if isinstance(message.get(key), str)})
        if message["role"] == "assistant":
            if isinstance(message.get("tool_calls"), list) and message["tool_calls"]:
                parsed["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if isinstance(reasoning, str):
                parsed["reasoning"] = parsed["reasoning_content"] = reasoning
        conversation.append(parsed)
    return conversation


def _text_parts(content, param: str) -> list:
    """A message's content as vLLM's "openai" content format holds it: `{"type": "text", "text": ...}` for each text
    part (a string content is one; none, an assistant's tool calls, is none), a bare string part kept as it came."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(400, "invalid_request", f"{param} must be a string or a list of content parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(kind, str) and kind in _TEXT_PARTS and isinstance(part.get(_TEXT_PARTS[kind]), str):
            parts.append({"type": "text", "text": part[_TEXT_PARTS[kind]]})
        else:
            raise RequestError(400, "invalid_request", f"Unsupported content part type {kind!r}: this server serves "
                               "a text model, whose messages hold text parts only", f"{param}[{j}]")
    return parts


def _tool_call(call):
    """vLLM's `_postprocess_messages`: templates take a tool call's arguments as an object, not its JSON text."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    elif not isinstance(arguments, (dict, list)):
        arguments = {}
    return {**call, "function": {**call["function"], "arguments": arguments}}


def render_chat(body: dict, state, *, add_special_tokens: bool) -> ChatPrompt:
    """The body's conversation (and its `tools`) rendered and tokenized with the served template (the chat route's and
    /tokenize's); RequestError 400 for what the template or the body refuses. `add_special_tokens`: the tokenizer's
    prompt prefix before the template's."""
    template = chat_template(state)
    messages = parse_messages(body, template.content_format)
    add_generation_prompt = parse_flag(body, "add_generation_prompt", True)
    continue_final_message = parse_flag(body, "continue_final_message")
    if add_generation_prompt and continue_final_message:
        raise RequestError(400, "invalid_request", "Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.", "continue_final_message")
    variables = body.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise RequestError(400, "invalid_request", "chat_template_kwargs must be an object", "chat_template_kwargs")
    documents = body.get("documents")
    if documents is not None:  # vLLM's RAG documents, for the templates that take them
        if not isinstance(documents, list) or not all(
                isinstance(document, dict) and all(isinstance(value, str) for value in document.values())
                for document in documents):
            raise RequestError(400, "invalid_request", "documents must be a list of objects of strings", "documents")
        variables = {**(variables or {}), "documents": documents}
    tools = parse_tools(body)
    if tools is not None:
        variables = {**(variables or {}), "tools": tools}
    if body.get("chat_template") is not None:
        raise RequestError(400, "invalid_request", _UNTRUSTED_TEMPLATE, "chat_template")
    try:
        prompt = template.encode(messages, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, variables=variables)
    except ChatTemplateError as exc:
        raise RequestError(400, "invalid_request", str(exc), "messages") from None
    except ValueError as exc:  # the tokenizer's: text it cannot encode
        raise RequestError(400, "invalid_request", str(exc), "messages") from None
    prefix = state.engine.tokenizer.prompt_prefix
    if add_special_tokens and prefix:
        return ChatPrompt(prompt.text, [*prefix, *prompt.token_ids])
    return prompt


class _ChatEventLog(sse.EventLog):
    """A chat stream's events: a chunk of output the parsers held back entirely is None, and makes no event."""

    def append(self, data: dict | str | None) -> int | None:
        return None if data is None else super().append(data)


class ChatInput(TextInput):
    """A completion answered in chat's shapes (`chat.completion`, `chat.completion.chunk`); its stream starts each
    choice with its role's delta (the first carries the prompt's ids when the client asked for ids). With `parsing`
    (chat_parsing.py), each choice's output goes through the server's reasoning and tool-call parsers."""

    def __init__(self, state, params, log: sse.EventLog | None, prompt_ids: list[int], *, role: str = "assistant",
                 parsing: ChatParsing | None = None, **options):
        super().__init__(state, params, log, one_shot=True, **options)
        self.id = f"chatcmpl-{self.id.removeprefix('cmpl-')}"
        self._prompt_ids = prompt_ids
        self._role = role
        self.parsing = parsing
        self._outputs = [parsing.output(prompt_ids) for _ in self.choices] if parsing is not None else []

    async def start(self) -> None:
        if self.log is not None:
            for choice in self.choices:  # each choice's stream starts with its role
                first = self._body([self._choice(choice, {"role": self._role, "content": ""}, None, [])])
                if self.return_token_ids and choice.index == 0:
                    first["prompt_token_ids"] = list(self._prompt_ids)
                self.log.append(first)
        await super().start()

    def _body(self, choices: list[dict], kind: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_id,
                "choices": choices}

    def _choice(self, choice: Choice, delta: dict, finish_reason: str | None, token_ids: list[int] | None,
                logprobs: dict | None = None) -> dict:
        body = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason if finish_reason is not None else None}
        if self.return_token_ids and token_ids is not None:
            body["token_ids"] = token_ids
        return body

    def chunk(self, text: str, finish_reason: str | None, prompt_ids: list[int] | None = None,
              token_ids: list[int] | None = None, logprobs: dict | None = None, choice: Choice | None = None) -> dict:
        """A `chat.completion.chunk` of one choice (its delta's content; none in a finish chunk without text). The
        prompt's ids went out with the role's delta."""
        delta = {"content": text} if text or finish_reason is None else {}
        return self._body([self._choice(choice or self.choices[0], delta, finish_reason, token_ids, logprobs)])

    def streamed_chunk(self, choice: Choice, text: str, finish_reason: str | None, token_ids: list[int]) -> dict | None:
        """A stream's chunk of a choice's output; through the parsers, None for a piece they hold back entirely when
        no logprobs or token ids must go out with it. A choice that streamed a tool call and stopped by itself
        finishes with "tool_calls" (vLLM's)."""
        if self.parsing is None:
            return super().streamed_chunk(choice, text, finish_reason, token_ids)
        output = self._outputs[choice.index]
        delta = output.delta(text, token_ids, final=finish_reason is not None)
        shown = not self.parsing.hides_metadata
        end = len(choice.token_ids)
        logprobs = self.logprobs_body(choice, end - len(token_ids), end, 0) if shown else None
        ids = list(token_ids) if shown else None
        if finish_reason is None and not delta and logprobs is None and not (self.return_token_ids and ids):
            return None
        if self.parsing.forced is not None and finish_reason is not None:
            finish_reason = forced_tool_calls.finish_reason(self.parsing.forced, finish_reason, output.called)
        elif finish_reason == "stop" and output.called:
            finish_reason = "tool_calls"
        return self._body([self._choice(choice, delta, finish_reason, ids, logprobs)])

    def completion(self) -> dict:
        choices = []
        for choice in self.choices:
            message = {"role": self._role, "content": choice.text, "refusal": None}
            finish_reason, shown = choice.finish_reason or "stop", True
            if self.parsing is not None:  # vLLM's: a choice that called tools finishes with "tool_calls"
                fields, called = self._outputs[choice.index].message(choice.text, choice.token_ids)
                message = {"role": self._role, "content": fields.pop("content"), "refusal": None, **fields}
                if self.parsing.forced is not None:
                    finish_reason = forced_tool_calls.finish_reason(self.parsing.forced, finish_reason, called)
                elif called:
                    finish_reason = "tool_calls"
                shown = not self.parsing.hides_metadata
            choices.append({"index": choice.index, "message": message,
                            "logprobs": self.logprobs_body(choice, 0, len(choice.token_ids), 0) if shown else None,
                            "finish_reason": finish_reason, "stop_reason": choice.stop_reason})
            if self.return_token_ids and shown:
                choices[-1]["token_ids"] = choice.token_ids
        body = self._body(choices, "chat.completion")
        if self.return_token_ids:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:  # vLLM's chat puts them on the body
            body["prompt_logprobs"] = prompt_logprobs_field(self.prompt_logprobs)
        return {**body, "usage": self.usage()}

    def logprobs_body(self, choice: Choice, first: int, end: int, text_offset: int) -> dict | None:
        """Chat's `logprobs` of a choice's generated tokens first..end: for each, its token, logprob and bytes, and
        its step's `top_logprobs` most likely tokens, most likely first (OpenAI's; vLLM lists the sampled one
        first)."""
        if self.params.logprobs is None or first >= end:
            return None
        return {"content": [{**self._entry(token_id, logprob),
                             "top_logprobs": [self._entry(i, value) for i, value in top.items()]}
                            for token_id, (logprob, top) in zip(choice.token_ids[first:end],
                                                                choice.logprobs[first:end])]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        data = b"" if self.tokenizer is None else self.tokenizer.token_bytes(token_id)
        token = self.token_string(token_id)
        # `bytes`: what the token stands for, so that a client joins the pieces of a character split over tokens.
        return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(data or token.encode("utf-8"))}


def _logprobs(body: dict) -> int | None:
    """The engine's `logprobs` for chat's `logprobs` (a flag) and `top_logprobs` (how many likely tokens, 0-20)."""
    wanted, top = parse_flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(400, "invalid_request", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                           f"{top!r}", "top_logprobs")
    if top and not wanted:
        raise RequestError(400, "invalid_request", "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")  # vLLM's words
    return (top or 0) if wanted else None


def _chat(body: dict, state) -> tuple[ChatInput, list[int]]:
    check_model(state, body.get("model"), "text")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    structured = structured_output_fields.requested(body)
    try:  # structured outputs join once the tools and the prompt are known
        params = sampling_params({**body, "max_tokens": body.get(name), "logprobs": _logprobs(body)},
                                 state.engine.default_sampling_params(), streaming=False, neutral=NEUTRAL,
                                 default_max_tokens=None, vocab_size=state.engine.model_config.vocab_size,
                                 tokenizer=state.engine.tokenizer, structured=Requested({}))
    except RequestError as exc:
        if exc.param == "max_tokens":
            exc.param = name
        raise
    template = chat_template(state)
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body, tools, state, template)
    parallel_tool_calls = parse_flag(body, "parallel_tool_calls", True)
    if forced_tool_calls.is_forced(tool_choice):
        structured = structured.forcing(forced_tool_calls.schema(tool_choice, tools,
                                                                 parallel_tool_calls=parallel_tool_calls))
    include_reasoning = parse_flag(body, "include_reasoning", True)
    rendered = render_chat(body, state, add_special_tokens=parse_flag(body, "add_special_tokens"))
    prompt = rendered.token_ids
    if not prompt:
        raise RequestError(400, "invalid_request", "The chat template rendered an empty prompt", "messages")
    check_context_length(prompt, params, state, "messages")
    stream, include_usage = parse_stream(body)
    parsing = ChatParsing(state, template, body, tool_choice, rendered.text, body.get("chat_template_kwargs"),
                          include_reasoning=include_reasoning, parallel_tool_calls=parallel_tool_calls)
    if structured.fields:
        params = dataclasses.replace(params, structured_outputs=structured.params(
            reasoning_end_token_id=parsing.grammar_start_id()))
    # vLLM's answer role: the assistant's, or without a generation prompt the last message's, which it continues.
    role = "assistant" if parse_flag(body, "add_generation_prompt", True) else body["messages"][-1]["role"]
    chat_input = ChatInput(state, params, _ChatEventLog() if stream else None, prompt, role=role,
                           parsing=parsing if parsing.active else None, include_usage=include_usage,
                           return_token_ids=parse_flag(body, "return_token_ids"),
                           tokens_as_ids=parse_flag(body, "return_tokens_as_token_ids"),
                           structured_param=structured.param)
    return chat_input, prompt


async def _streaming_input(request: web.Request, state) -> web.StreamResponse:
    check_kind(state, "text")
    raise RequestError(400, "invalid_request", f"Streaming input (X-Streaming-Input: true) is not served on {ROUTE}: "
                       "send the chunks to /v1/completions, or to a session of /v1/streaming_input/sessions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_one_shot(request, _chat, _streaming_input)


def add_chat_routes(app: web.Application) -> None:
    app.router.add_post(ROUTE, holds_stream(chat_completions))

