"""Chat templates: a conversation (OpenAI-style messages) to the prompt an instruct model was trained on.

A Hugging Face checkpoint's template is found as transformers finds it: `chat_template.jinja` beside the tokenizer,
else `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}` of which "default" is used;
a list without one has no usable template, as vLLM then finds none). It is rendered as transformers'
`apply_chat_template` renders it: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
`loopcontrols` extension, transformers' `tojson`, `raise_exception`, `strftime_now`, `namespace` and `dict`, the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as variables, and `tools` and `documents` (None
unless the request gives them). The rendered text is tokenized without adding BOS or EOS (the template writes
them), as transformers and vLLM do.

A Mistral tekken tokenizer has no jinja template: `MistralChatTemplate` encodes the conversation with
mistral-common's own `encode_chat_completion`, as vLLM's `--tokenizer-mode mistral` does.

Both raise `ChatTemplateError` (a ValueError) with a message for the client when the conversation cannot be
rendered: the template's own `raise_exception` message (a bad role order), mistral-common's validation message.

A message's `content` reaches a jinja template as vLLM gives it (its `--chat-template-content-format auto`): a string
(a list of text parts joined with newlines) for most templates, the list of parts (`{"type": "text", "text": ...}`)
for a template that loops over a message's content (`content_format`, read from the template's syntax tree).
"""
import abc
import dataclasses
import datetime
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from jaxstream.models.errors import UserError

logger = logging.getLogger(__name__)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# vLLM's answer to a chat request for a model without a template (its ChatCompletionRequest documents it too).
NO_TEMPLATE_MESSAGE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
                       "chat template if the tokenizer does not define one.")
# vLLM's test for a --chat-template value that is the template itself rather than a file's path.
_JINJA_CHARS = "{}\n"
# transformers' marker for `continue_final_message`: appended to the final message, the render is cut where it lands.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A conversation the template (or mistral-common) refuses; the message is for the client."""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered conversation
    token_ids: list[int]  # its ids, with no BOS added beyond what the template wrote


class ChatTemplate(abc.ABC):
    """Renders and tokenizes a conversation: `messages` are dicts with `role` and `content` (and, where the client sent
    them, `name`, `tool_calls`, `tool_call_id`), the content in the template's `content_format`: "string", or
    "openai": a list of parts, `{"type": "text", "text": ...}` (vLLM's names)."""

    content_format = "string"

    @abc.abstractmethod
    def encode(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: dict | None = None) -> ChatPrompt:
        """`add_generation_prompt`: end with the header of an assistant turn; `continue_final_message`: end inside the
        final message, for the model to continue it (not both); `variables`: extra template variables (vLLM's
        `chat_template_kwargs`, and its `documents`)."""

    def prepare(self) -> None:
        """Loads now what the first conversation would load, so that it does not stall a server's event loop."""


class JinjaChatTemplate(ChatTemplate):
    """A jinja chat template, rendered as transformers renders it, and tokenized by `encode_text`."""

    def __init__(self, source: str, special_tokens: dict[str, str], encode_text: Callable[[str], list[int]]):
        self.source = source  # compiled at the first render: a checkpoint's broken template fails its chats only
        self._special_tokens = dict(special_tokens)
        self._encode_text = encode_text

    @property
    def content_format(self) -> str:
        return detect_content_format(self.source)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: dict | None = None) -> str:
        import jinja2

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        # transformers drops None-valued keys: templates test for a key (`'tool_calls' in message`), not for None.
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        if continue_final_message:
            messages[-1], final = _with_continue_tag(messages[-1] if messages else {})
        # The request's own fields win over its variables, which win over the special tokens (transformers, vLLM).
        # `tools` and `documents` are None, not undefined, unless given: transformers passes both, and templates
        # test `tools is defined` / `tools is not none`.
        context = {**self._special_tokens, "tools": None, "documents": None, **(variables or {}), "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            text = compile_template(self.source).render(**context)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            # A template's raise_exception (a bad role order) or its failure on this conversation: the client's to fix.
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None
        if continue_final_message:
            text = _cut_at_continue_tag(text, final)
        return text

    def encode(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: dict | None = None) -> ChatPrompt:
        text = self.render(messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, variables=variables)
        try:
            return ChatPrompt(text, self._encode_text(text))
        except ValueError as exc:  # the tokenizer's refusal of what the conversation holds (a lone surrogate)
            raise ChatTemplateError(f"the conversation cannot be tokenized: {exc}") from None


def _with_continue_tag(message: dict) -> tuple[dict, str]:
    """transformers' `continue_final_message`: the final message with the tag after its text (a list of parts: after
    its last text part's), and that text. ChatTemplateError for a message without text."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}, content
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                tagged = {**part, "text": part["text"] + _CONTINUE_TAG}
                return {**message, "content": [*content[:i], tagged, *content[i + 1:]]}, part["text"]
    raise ChatTemplateError("continue_final_message is set but the final message has no content to continue")


def _cut_at_continue_tag(text: str, final: str) -> str:
    """transformers' `continue_final_message`: the render ends where the final message's content does."""
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the chat "
                                "after applying the chat template")
    end = text.rindex(_CONTINUE_TAG.strip())
    if text[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:end]
    return text[:end].rstrip()  # the template trimmed the tag's trailing space, and maybe the message's own


class MistralChatTemplate(ChatTemplate):
    """A tekken tokenizer's chat encoding: mistral-common's `encode_chat_completion`, as vLLM serves Mistral
    checkpoints. Its format has no generation prompt to add or leave out (a conversation ending with a user turn
    ends with [/INST]); `continue_final_message` continues a final assistant message. Of the `variables`, it reads
    the request's `tools` only, as vLLM passes them to mistral-common."""

    def __init__(self, tekken_path: str | os.PathLike):
        self._path = Path(tekken_path)

    @functools.cached_property
    def _tokenizer(self):
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        return MistralTokenizer.from_file(self._path)

    def prepare(self) -> None:
        self._tokenizer  # noqa: B018 - mistral-common reads the whole vocabulary (0.6 s for tekken_240911)

    @property
    def version(self) -> int:
        """mistral-common's tokenizer version (11 for v11): from v11 its models write tool calls as `name{arguments}`
        after each [TOOL_CALLS], before as one JSON list."""
        return int(self._tokenizer.instruct_tokenizer.tokenizer.version.value.lstrip("v"))

    def encode(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: dict | None = None) -> ChatPrompt:
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        _check_unicode(messages)  # tiktoken panics on a lone surrogate (a BaseException, past every except below)
        try:
            request = ChatCompletionRequest.from_openai(messages, tools=(variables or {}).get("tools"),
                                                        continue_final_message=continue_final_message)
            tokenized = self._tokenizer.encode_chat_completion(request)
        except (MistralCommonException, ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ChatTemplateError(str(exc)) from None
        tokens = list(tokenized.tokens)
        return ChatPrompt(self._tokenizer.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP), tokens)


def _check_unicode(value, where: str = "messages") -> None:
    """ChatTemplateError naming the first string in `value` (nested lists and dicts) that holds a lone UTF-16
    surrogate: no Unicode character, so no tokenizer can encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ChatTemplateError(f"{where} holds a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X}): it is "
                                    "no Unicode character, so it cannot be tokenized") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


# -- finding a checkpoint's template ---------------------------------------------------------------------------------
def find_chat_template(directory: str | os.PathLike) -> str | None:
    """The template transformers would load from a tokenizer's `directory` (see the module docstring), or None."""
    directory = Path(directory)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return _read_text(directory / CHAT_TEMPLATE_FILE)
    template = _tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def named_special_tokens(directory: str | os.PathLike) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json in `directory` (a string, or an AddedToken object)."""
    config = _tokenizer_config(Path(directory))
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            tokens[name] = token
    return tokens


def _tokenizer_config(directory: Path) -> dict:
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_text(path))
    except ValueError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    return config if isinstance(config, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def load_chat_template(value: str) -> str:
    """A `--chat-template` value as vLLM takes it: a file's path (its text), else the template itself when it holds
    a jinja character (a brace or a newline). The template is compiled here, so a syntax error stops the server at
    start-up rather than failing every chat request. UserError otherwise."""
    path = Path(value)
    if path.is_file():
        source = _read_text(path)
    elif is_inline_template(value):
        source = value
    else:
        raise UserError(f"chat template {value!r} looks like a file path, but there is no such file")
    import jinja2

    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"chat template {value if path.is_file() else '(given inline)'}: line {exc.lineno}: "
                        f"{exc.message}") from None
    return source


def is_inline_template(value: str) -> bool:
    """Whether a `--chat-template` value that names no file is the template itself (vLLM's test)."""
    return any(c in value for c in _JINJA_CHARS)


# -- what a template takes as a message's content ---------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def detect_content_format(source: str) -> str:
    """vLLM's `_detect_content_format`: "openai" when the template loops over a message's content (`{% for part in
    message['content'] %}`, through filters, tests and slices, `message` being a loop over `messages` or over a
    variable set from it), else "string"; "string" too for a template that does not parse (its chats fail anyway)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists, assigns = {"messages"}, list(tree.find_all(nodes.Assign))
    grown = True
    while grown:  # `{% set loop_messages = messages[1:] %}` and what is set from that in turn
        named = {assign.target.name for assign in assigns
                 if isinstance(assign.target, nodes.Name) and _reads(assign.node, lists)}
        grown, lists = not named <= lists, lists | named
    loops = list(tree.find_all(nodes.For))
    messages = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)}
    return "openai" if any(_reads(loop.iter, messages, "content") for loop in loops) else "string"


def _reads(node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its item or attribute `key`), seen through filters, tests and
    slices (`messages | selectattr(...)`, `message['content'][1:]`)."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


# -- the jinja environment, as transformers builds it ----------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled template (cached: a server renders the same one for every request)."""
    return _environment().from_string(source)


@functools.cache
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` block (it marks assistant tokens for training masks): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        # transformers' TemplateNamespace: no underscore-prefixed attributes, a path towards CPython internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own escapes HTML characters, which a prompt must keep.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                               dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return environment
