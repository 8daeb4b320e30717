"""Reasoning parsers (serving/reasoning_parsers.py), on text: vLLM's `deepseek_r1` and `qwen3`.

The oracle is vLLM's own tests (tests/reasoning/test_deepseekr1_reasoning_parser.py and
test_qwen3_reasoning_parser.py): their model outputs and the reasoning and content they expect, whole. The same output
streamed in pieces of any size gives the same answer (the parser is one incremental reader), which vLLM's streaming
gives too but for whitespace before a leading <think> (kept there as reasoning, dropped here as in its whole parse).
The route's reasoning fields are tested with the tool calls (test_serve_tool_calls.py), over one scripted server."""
import pytest

from jaxstream.serving.reasoning_parsers import REASONING_PARSERS, ThinkingParser, reasoning_parser

CALL_XML = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"

# (output, reasoning, content), vLLM's cases for both parsers
CASES = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is content", "This is content", None),  # no </think>: cut off while reasoning
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("", "", None),
    ("\n<think>This is a reasoning section</think>\nThis is the rest", "This is a reasoning section",
     "\nThis is the rest"),
    ("<think>reasoning</think>", "reasoning", None),
]
# qwen3 only: a <tool_call> that opens Qwen3.5's XML call ends the reasoning; one merely mentioned does not.
QWEN3_CASES = [
    ("I need to read the file.\n\n" + CALL_XML, "I need to read the file.\n\n", CALL_XML),
    ("<think>I need to read the file.\n\n" + CALL_XML, "I need to read the file.\n\n", CALL_XML),
    ("Use a <tool_call> tag.</think>Done", "Use a <tool_call> tag.", "Done"),
]


def whole(parser: ThinkingParser, text: str) -> tuple[str | None, str | None]:
    parser.feed(text)
    parser.finish()
    return parser.reasoning, parser.content or None


def streamed(parser: ThinkingParser, text: str, size: int) -> tuple[str | None, str | None]:
    """The output fed `size` characters at a time: the reasoning and content the deltas add up to."""
    reasoning, content = [], []
    for start in range(0, len(text), size):
        pieces = parser.feed(text[start:start + size])
        reasoning.append(pieces[0])
        content.append(pieces[1])
    pieces = parser.finish()
    reasoning, content = "".join(reasoning) + pieces[0], "".join(content) + pieces[1]
    assert reasoning == (parser.reasoning or "") and content == parser.content
    return parser.reasoning, content or None


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("output, reasoning, content", CASES)
def test_vllms_outputs_split_as_vllm_splits_them(name, output, reasoning, content):
    assert whole(reasoning_parser(name, None, "<|im_start|>assistant\n"), output) == (reasoning, content)
    for size in (1, 2, 3, 7, 1000):
        assert streamed(reasoning_parser(name, None, "prompt"), output, size) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", QWEN3_CASES)
def test_qwen3_ends_reasoning_at_an_xml_tool_call(output, reasoning, content):
    for size in (1, 4, 1000):
        assert streamed(reasoning_parser("qwen3", {}, ""), output, size) == (reasoning, content)
    # deepseek_r1 knows no such call: it is reasoning, until </think>.
    assert whole(reasoning_parser("deepseek_r1", {}, ""), QWEN3_CASES[0][0]) == (QWEN3_CASES[0][0], None)


def test_whitespace_before_a_tag_is_held_only_so_far():
    """Whitespace that might precede a tag was held and rescanned with every delta: 200,000 spaces after <tool_call>,
    4 a delta, took 3.5 s of the event loop. Past MAX_SPACE_BEFORE_TAG no tag is read there, whole and streamed."""
    from jaxstream.serving.reasoning_parsers import MAX_SPACE_BEFORE_TAG

    spaces = " " * (MAX_SPACE_BEFORE_TAG + 1)
    for output in ("x <tool_call>" + spaces + CALL_XML[len("<tool_call>"):], spaces + "<think>r</think>c"):
        expected = (output.split("</think>")[0], "c" if output.endswith("c") else None)
        assert whole(reasoning_parser("qwen3", {}, ""), output) == expected
        assert streamed(reasoning_parser("qwen3", {}, ""), output, 4) == expected
    parser = reasoning_parser("qwen3", {}, "")
    parser.feed("x <tool_call>")
    for _ in range(1000):
        parser.feed("    ")
    assert len(parser._held) <= MAX_SPACE_BEFORE_TAG + len("<tool_call>")  # noqa: SLF001


@pytest.mark.parametrize("output", ["This is plain content", "I need to read the file.\n\n" + CALL_XML,
                                    "<think>not reasoning</think> either"])
def test_without_thinking_the_output_is_content(output):
    """qwen3 with chat_template_kwargs {"enable_thinking": false} (vLLM's test: all content), and either parser when
    the prompt closed the reasoning (Qwen3's template without thinking ends its prompt with <think>\\n\\n</think>)."""
    assert whole(reasoning_parser("qwen3", {"enable_thinking": False}, "assistant\n"), output) == (None, output)
    for name in REASONING_PARSERS:
        parser = reasoning_parser(name, {}, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert streamed(parser, output, 3) == (None, output)


def test_a_tag_split_over_pieces_is_held_until_it_is_whole():
    """No piece of `</think>` or of a leading `<think>` ever reaches the client as text."""
    parser = reasoning_parser("deepseek_r1", None, "")
    pieces = [parser.feed(piece) for piece in (" <th", "ink>Hm", "m.</th", "ink", ">", "\n\nYes.")]
    assert pieces == [("", ""), ("Hm", ""), ("m.", ""), ("", ""), ("", ""), ("", "\n\nYes.")]
    assert parser.finish() == ("", "")
    parser = reasoning_parser("deepseek_r1", None, "")
    assert parser.feed("Hmm</thi") == ("Hmm", "")
    assert parser.finish() == ("</thi", "")  # cut off there: it was reasoning
