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
                     variables.jinja   not a checkpoint's: what transformers defines besides the messages
                                       (`tools` and `documents` None, vLLM's `documents` when given)
cases.json           {"versions": {...}, "cases": [...]}; a case names its checkpoint `layout` (how the template is
                     stored beside the tokenizer: `config` = tokenizer_config.json's chat_template string, `named` = a
                     list [{name: default, ...}, {name: tool_use, ...}], `jinja_file` = chat_template.jinja, which
                     wins over the config's), the `special_tokens` of its tokenizer_config.json, the `messages`, the
                     flags and `kwargs` (template variables; `documents` is apply_chat_template's own argument,
                     which jaxstream takes as a variable), and transformers' answer: `text` and `ids`
                     (`apply_chat_template(tokenize=False)` / `(tokenize=True)`), or the `error` it raised.
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


if __name__ == "__main__":
    main()
