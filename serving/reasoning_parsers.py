"""Reasoning parsers for /v1/chat/completions (vLLM's `--reasoning-parser`): the reasoning a model writes between
`<think>` and `</think>` before its answer, split from the answer as the text streams.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the output is reasoning until `</think>`, whether or not the
  model wrote the `<think>` that opens it (R1's template opens it in the prompt); an output without `</think>` is all
  reasoning.
- `qwen3` (Qwen3, Qwen3.5, the thinking 2507 models): the same, unless the request turned thinking off
  (`chat_template_kwargs: {"enable_thinking": false}`): then the output is all content. As vLLM's, a `<tool_call>`
  followed by `<function` (Qwen3.5's XML tool calls) ends the reasoning too, the call being content.

For both, a prompt that ends with `</think>` (Qwen3's template without thinking writes `<think>\n\n</think>\n\n`) makes
the whole output content, as vLLM's serving layer decides from the prompt. A `<think>` that starts the output (after
any whitespace) is dropped; the rest of the reasoning is as written, and the content after `</think>` too.

`ThinkingParser` is one incremental reader for the streamed and the whole text alike, so a stream's deltas add up to
the answer the same output gets without streaming; it holds back the end of a delta that may begin a tag. (vLLM's
streamed reasoning keeps whitespace written before `<think>`, which its whole-text parse drops: here both drop it.)
"""
from jaxstream.serving.tool_parsers import partial_tag

THINK_START, THINK_END = "<think>", "</think>"
_TOOL_CALL, _FUNCTION = "<tool_call>", "<function"


# Whitespace a parser holds while it waits for a tag that may follow it (a <think> that opens the output, a
# <function after <tool_call>), at most: held text is rescanned with every delta, so an output of endless whitespace
# cost quadratic time on the event loop (200,000 spaces: 3.5 s). Beyond it, whole and streamed alike read no tag.
MAX_SPACE_BEFORE_TAG = 256


class ThinkingParser:
    """One output's reasoning and content. `feed(text)` -> (reasoning, content) the text settles; `finish()` at the
    end of the output. `reasoning` holds all of it so far: None when the output has no reasoning part."""

    markers = (THINK_START, THINK_END)  # the tags, written into the text where a tokenizer holds them as controls

    def __init__(self, *, reasoning_first: bool, tool_call_ends_reasoning: bool = False):
        self._state = "lead" if reasoning_first else "content"
        self._held = ""
        self._tool_call_ends = tool_call_ends_reasoning
        self.reasoning: str | None = "" if reasoning_first else None
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(self._held + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(self._held, final=True)

    def _step(self, text: str, *, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning, content = [], []
        while text:
            if self._state == "content":
                content.append(text)
                break
            if self._state == "lead":  # before the output's first words: a <think> there is dropped
                words = text.lstrip()
                if len(text) - len(words) > MAX_SPACE_BEFORE_TAG:
                    self._state = "reasoning"  # whitespace without end is held no longer (rescanned each delta)
                elif words.startswith(THINK_START):
                    text, self._state = words[len(THINK_START):], "reasoning"
                elif not final and (not words or THINK_START.startswith(words)):
                    self._held = text
                    break
                else:
                    self._state = "reasoning"
                continue
            end = text.find(THINK_END)
            call = text.find(_TOOL_CALL) if self._tool_call_ends else -1
            if end >= 0 and not 0 <= call < end:
                reasoning.append(text[:end])
                text, self._state = text[end + len(THINK_END):], "content"
                continue
            if call >= 0:
                rest = text[call + len(_TOOL_CALL):]
                after = rest.lstrip()
                if len(rest) - len(after) > MAX_SPACE_BEFORE_TAG:
                    after = rest  # no <function after this much whitespace: a tag mentioned in the reasoning
                if after.startswith(_FUNCTION):
                    reasoning.append(text[:call])
                    text, self._state = text[call:], "content"
                    continue
                if not final and _FUNCTION.startswith(after):  # its <function may still come
                    reasoning.append(text[:call])
                    self._held = text[call:]
                    break
                reasoning.append(text[:call + len(_TOOL_CALL)])  # a tag mentioned in the reasoning
                text = text[call + len(_TOOL_CALL):]
                continue
            cut = len(text) if final else len(text) - max(
                partial_tag(text, THINK_END), partial_tag(text, _TOOL_CALL) if self._tool_call_ends else 0)
            reasoning.append(text[:cut])
            self._held = text[cut:]
            break
        reasoning_text, content_text = "".join(reasoning), "".join(content)
        if reasoning_text:
            self.reasoning += reasoning_text
        self.content += content_text
        return reasoning_text, content_text


def prompt_ends_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt closes the reasoning block its generation prompt opened (a template that turns
    thinking off writes an empty one): the answer is content from its first token."""
    return prompt_text.rstrip().endswith(THINK_END)


def _deepseek_r1(variables: dict) -> ThinkingParser:
    return ThinkingParser(reasoning_first=True)


def _qwen3(variables: dict) -> ThinkingParser:
    return ThinkingParser(reasoning_first=variables.get("enable_thinking", True) is not False,
                          tool_call_ends_reasoning=True)


# vLLM's --reasoning-parser names -> the parser of one output, given the request's chat_template_kwargs.
REASONING_PARSERS = {"deepseek_r1": _deepseek_r1, "qwen3": _qwen3}


def reasoning_parser(name: str, variables: dict | None, prompt_text: str) -> ThinkingParser:
    """The parser `name` for one output of a request with template `variables` and rendered `prompt_text`."""
    if prompt_ends_reasoning(prompt_text):
        return ThinkingParser(reasoning_first=False)
    return REASONING_PARSERS[name](variables or {})
