"""Generate the chat-template fixtures tests/test_chat_completions.py reads: transformers' `apply_chat_template` is
the oracle for how jaxstream finds, renders and tokenizes a checkpoint's chat template.

Run by hand from the repository root (CI never runs it; it reads the committed files):

    pip install transformers jinja2 tokenizers      # no torch needed: templates are rendered and tokenized only
    python tests/make_chat_fixtures.py

Files under tests/fixtures/chat/:

tokenizer.json       a word-level tokenizer.json whose ids fit the tiny Llama's 256-id vocabulary: <unk> <s> </s>,
                     the control tokens of the templates below as special added tokens (Llama 3's <|begin_of_text|>,
                     <|start_header_id|>, <|eot_id|>, ..., Mistral's [INST] [/INST], ChatML's <|im_start|>
                     <|im_end|>), the words the templates write ("user", "Cutting", "Knowledge", ...) and "w<id>"
                     for every other id. Whitespace is dropped by its pre-tokenizer, as it splits words.
templates/*.jinja    the templates, copied from public tokenizer_config.json contents (read with the search tools):
                     llama3.jinja      Meta-Llama-3-8B-Instruct's
                     llama3_1.jinja    Llama 3.1 / 3.3 Instruct's (tools, builtin_tools, date_string "26 Jul 2024")
                     mistral_v3.jinja  Mistral-7B-Instruct-v0.3's ([INST], tool calls, raise_exception on a bad
                                       role order)
                     chatml.jinja      ChatML, the "default" of a list of named templates (as Hermes 2 Pro ships)
                     qwen3.jinja       Qwen3's (tools in <tools>, <tool_call> JSON, reasoning_content in <think>,
                                       enable_thinking)
                     variables.jinja   not a checkpoint's: what transformers defines besides the messages
                                       (`tools` and `documents` None, vLLM's `documents` when given)
cases.json           {"versions": {...}, "cases": [...]}; a case names its checkpoint `layout` (how the template is
                     stored beside the tokenizer: `config` = tokenizer_config.json's chat_template string, `named` = a
                     list [{name: default, ...}, {name: tool_use, ...}], `jinja_file` = chat_template.jinja, which
                     wins over the config's), the `special_tokens` of its tokenizer_config.json, the `messages`, the
                     flags and `kwargs` (template variables; `documents` is apply_chat_template's own argument,
                     which jaxstream takes as a variable), and transformers' answer: `text` and `ids`
                     (`apply_chat_template(tokenize=False)` / `(tokenize=True)`), or the `error` it raised.
tool_cases.json      {"versions": {...}, "cases": [...]}: chats with tools, assistant tool calls, tool results and
                     reasoning, as a client sends them (OpenAI's shapes: `tools`, `tool_calls` with JSON-string
                     arguments, `reasoning_content`) in `messages`, `tools` and `kwargs` (chat_template_kwargs), and
                     transformers' `text` for what vLLM gives the template from them (`vllm_template_inputs`). Text
                     only: the word-level vocabulary has no words for JSON, so their ids would be <unk>.
"""
import json
import shutil
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
TEMPLATES = FIXTURES / "templates"
VOCAB_SIZE = 256  # the tiny Llama's
SPECIALS = ["<unk>", "<s>", "</s>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "[INST]", "[/INST]", "<|im_start|>",
            "<|im_end|>", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]"]
WORDS = ["user", "assistant", "system", "developer", "tool", "ipython", "Cutting", "Knowledge", "Date", "December",
         "2023", "Today", "26", "Jul", "2024", "01", "Jan", "2025", ":", ",", ".", "?", "!", "Be", "brief",
         "Hello", "Hi", "there", "Who", "are", "you", "I", "am", "an", "Sure"]
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHATML = {"bos_token": "<s>", "eos_token": "<|im_end|>"}

SYSTEM = {"role": "system", "content": "Be brief ."}
USER = {"role": "user", "content": "Hello w60 w61 ?"}
ANSWER = {"role": "assistant", "content": "Hi there w70 !"}
USER2 = {"role": "user", "content": "Who are you ?"}
PARTIAL = {"role": "assistant", "content": "I am "}  # continue_final_message: trailing space trimmed by `| trim`


def case(name, template, layout, special_tokens, messages, *, add_generation_prompt=True,
         continue_final_message=False, kwargs=None) -> dict:
    return {"name": name, "template": template, "layout": layout, "special_tokens": special_tokens,
            "messages": messages, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "kwargs": kwargs or {}}


CASES = [
    case("llama3_user", "llama3", "config", LLAMA3, [USER]),
    case("llama3_chat", "llama3", "config", LLAMA3, [SYSTEM, USER, ANSWER, USER2]),
    case("llama3_no_generation_prompt", "llama3", "config", LLAMA3, [USER, ANSWER], add_generation_prompt=False),
    case("llama3_continue", "llama3", "config", LLAMA3, [USER, PARTIAL], add_generation_prompt=False,
         continue_final_message=True),
    case("llama3_1_user", "llama3_1", "config", LLAMA3, [USER]),
    case("llama3_1_system", "llama3_1", "config", LLAMA3, [SYSTEM, USER, ANSWER, USER2]),
    case("llama3_1_developer", "llama3_1", "config", LLAMA3, [{"role": "developer", "content": "Be brief"}, USER]),
    case("llama3_1_date_kwarg", "llama3_1", "config", LLAMA3, [USER], kwargs={"date_string": "01 Jan 2025"}),
    case("llama3_1_continue", "llama3_1", "config", LLAMA3, [SYSTEM, USER, PARTIAL], add_generation_prompt=False,
         continue_final_message=True),
    case("mistral_user", "mistral_v3", "config", MISTRAL, [USER]),
    case("mistral_system", "mistral_v3", "config", MISTRAL, [SYSTEM, USER, ANSWER, USER2]),
    case("mistral_continue", "mistral_v3", "config", MISTRAL, [USER, PARTIAL], add_generation_prompt=False,
         continue_final_message=True),
    case("mistral_bad_order", "mistral_v3", "config", MISTRAL, [USER, USER2]),
    case("mistral_bad_role", "mistral_v3", "config", MISTRAL, [USER, {"role": "developer", "content": "Be brief"}]),
    case("named_default", "chatml", "named", CHATML, [SYSTEM, USER, ANSWER, USER2]),
    case("jinja_file_wins", "llama3", "jinja_file", LLAMA3, [SYSTEM, USER]),
    case("variables", "variables", "config", CHATML, [USER]),
    case("variables_documents", "variables", "config", CHATML, [USER],
         kwargs={"documents": [{"title": "Hi", "text": "there w70"}, {"title": "Who", "text": "am I"}]}),
]


QWEN3 = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
BARE_TOOL = {"type": "function", "function": {"name": "now"}}  # vLLM fills description and parameters with null
CALL = {"id": "abc123XYZ", "type": "function",  # a 9-character id, which Mistral's template requires
        "function": {"name": "get_weather", "arguments": '{"city":"Paris", "unit" :"c"}'}}
ASK = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 C, sunny"}


def tool_case(name, template, special_tokens, messages, tools, kwargs=None) -> dict:
    return {"name": name, "template": template, "layout": "config", "special_tokens": special_tokens,
            "messages": messages, "tools": tools, "kwargs": kwargs or {}}


TOOL_CASES = [
    tool_case("qwen3_tools", "qwen3", QWEN3, [{"role": "system", "content": "Be brief."}, ASK], [WEATHER, BARE_TOOL]),
    tool_case("qwen3_tool_round", "qwen3", QWEN3, [
        ASK, {**CALLED, "content": "", "reasoning_content": "Paris is in France."}, RESULT], [WEATHER]),
    tool_case("qwen3_reasoning_field", "qwen3", QWEN3, [  # vLLM's newer name for reasoning_content
        ASK, {**CALLED, "content": "", "reasoning": "Looked it up."}, RESULT], None, {"enable_thinking": False}),
    tool_case("qwen3_no_thinking", "qwen3", QWEN3, [ASK], [WEATHER], {"enable_thinking": False}),
    tool_case("llama3_1_tools", "llama3_1", LLAMA3, [ASK, CALLED, RESULT], [WEATHER]),
    tool_case("mistral_tools", "mistral_v3", MISTRAL, [ASK, CALLED, RESULT, {"role": "assistant", "content": "Sunny."},
                                                       {"role": "user", "content": "And now?"}], [WEATHER]),
]


def vllm_template_inputs(case: dict) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools vLLM gives a chat template for the case's request: tools as its pydantic models dump
    them (ChatCompletionToolsParam: a function's description and parameters null when left out), an assistant's
    tool-call arguments parsed (chat_utils._postprocess_messages), its `reasoning` or `reasoning_content` under both
    names (_parse_chat_message_content)."""
    tools = None if case["tools"] is None else [
        {"type": "function", "function": {"name": tool["function"]["name"], "description": None, "parameters": None,
                                          **tool["function"]}}
        for tool in case["tools"]]
    messages = []
    for message in case["messages"]:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "function": {**call["function"],
                                                           "arguments": json.loads(call["function"]["arguments"])}}
                                     for call in message["tool_calls"]]
        reasoning = message.pop("reasoning", message.pop("reasoning_content", None))
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        messages.append(message)
    return messages, tools


def vocabulary() -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    return {**vocab, **{f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)}}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path))


def checkpoint(directory: Path, spec: dict) -> Path:
    """A tokenizer directory holding the case's template as its `layout` says (the tests build the same)."""
    directory.mkdir(parents=True)
    shutil.copy(FIXTURES / "tokenizer.json", directory / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["special_tokens"]}
    template = (TEMPLATES / f"{spec['template']}.jinja").read_text()
    if spec["layout"] == "config":
        config["chat_template"] = template
    elif spec["layout"] == "named":
        config["chat_template"] = [{"name": "default", "template": template},
                                   {"name": "tool_use", "template": (TEMPLATES / "llama3_1.jinja").read_text()}]
    else:  # jinja_file: the file wins over the config's template
        (directory / "chat_template.jinja").write_text(template)
        config["chat_template"] = (TEMPLATES / "chatml.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def main() -> None:
    import jinja2
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    write_tokenizer(FIXTURES / "tokenizer.json")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for spec in CASES:
            tokenizer = AutoTokenizer.from_pretrained(checkpoint(Path(scratch) / spec["name"], spec))
            options = {"add_generation_prompt": spec["add_generation_prompt"],
                       "continue_final_message": spec["continue_final_message"], **spec["kwargs"]}
            try:
                text = tokenizer.apply_chat_template(spec["messages"], tokenize=False, **options)
                ids = tokenizer.apply_chat_template(spec["messages"], tokenize=True, return_dict=False, **options)
                results.append({**spec, "text": text, "ids": list(ids)})
            except jinja2.TemplateError as exc:
                results.append({**spec, "error": str(exc)})
            assert 0 not in results[-1].get("ids", []), f"{spec['name']}: a word the vocabulary lacks"
    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "jinja2": jinja2.__version__}
    (FIXTURES / "cases.json").write_text(json.dumps({"versions": versions, "cases": results}, indent=1) + "\n")
    tool_results = []
    with tempfile.TemporaryDirectory() as scratch:
        for spec in TOOL_CASES:
            tokenizer = AutoTokenizer.from_pretrained(checkpoint(Path(scratch) / spec["name"], spec))
            messages, tools = vllm_template_inputs(spec)
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                 **spec["kwargs"])
            tool_results.append({**spec, "text": text})
    (FIXTURES / "tool_cases.json").write_text(json.dumps({"versions": versions, "cases": tool_results}, indent=1)
                                              + "\n")


if __name__ == "__main__":
    main()
