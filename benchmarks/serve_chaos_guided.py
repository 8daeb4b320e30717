"""The text-model behaviours of serve_chaos.py that constrain what may be generated: structured outputs on
/v1/completions and /v1/chat/completions (every spelling of serving/structured_output_fields.py, and chat's forced
`tool_choice`: serving/forced_tool_calls.py), vLLM's `allowed_token_ids` and `bad_words`, the refusals of invalid
constraints, and clients that drop a constrained stream. They need a model whose tokenizer llguidance reads: the soak's
text model (serve_chaos_text.py) has one.

"As expected": an answer that ended by itself ("stop", or "tool_calls") satisfies its constraint (a full match of the
regex, or of the regex the grammar describes; one of the choices; json.loads and jsonschema for a schema; an object for
json_object); one cut short has exactly max_tokens tokens and begins as its constraint's texts do (a partial match of
the regex; the start of a choice; JSON text's "{" or "[" after any whitespace); a greedy answer equals every earlier
answer to the same constraint, whichever field spelled it, streamed or not. Allowed ids: every generated id is one of
them (and, the EOS id not among them, the answer runs to its max_tokens). Bad words: no generated run of ids is one of
the words' tokenizations, as vLLM tokenizes them. An invalid constraint is a JSON 4xx with the documented code and
`param` (the field the client sent), before any stream byte.
"""
import json

import jsonschema
import regex  # (whisper-normalizer's dependency) partial matches: the start of a text a regex matches

from serve_chaos_clients import Bad, Chaos, behaviour
from serve_chaos_http import SESSIONS, sse_events
from serve_chaos_text import PROMPTS, answer, check_counts, chunk_objects

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 999},
    "colour": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age"], "additionalProperties": False}
# name -> (kind, value, oracle): the structured_outputs field, its value, and what a text that satisfies it matches
# (a regex, fully; a list of choices; a JSON schema).
CONSTRAINTS = {
    "word": ("regex", r"[a-z]{1,8}", r"[a-z]{1,8}"),
    "phone": ("regex", r"\d{3}-\d{4}", r"\d{3}-\d{4}"),
    "colours": ("regex", r"(red|green|blue)( (red|green|blue)){0,3}", r"(red|green|blue)( (red|green|blue)){0,3}"),
    "sentiment": ("choice", ["positive", "negative", "neutral"], ["positive", "negative", "neutral"]),
    "person": ("json", PERSON, PERSON),
    "object": ("json_object", True, {"type": "object"}),
    "lark": ("grammar", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/', r"yes|no|maybe [0-9]{1,3}"),
    "gbnf": ("grammar", 'root ::= "yes" | "no" | "maybe " [0-9] [0-9]?', r"yes|no|maybe [0-9][0-9]?"),
}
GUIDED = {"regex": "guided_regex", "choice": "guided_choice", "json": "guided_json", "grammar": "guided_grammar"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["paris", "rome", "oslo"]}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def spelled(kind: str, value, rng) -> dict:
    """The body fields that ask for the constraint (`kind`, `value`), one of the spellings the server takes at
    random: vLLM's `structured_outputs`, its old `guided_*` field, OpenAI's `response_format`."""
    spellings = [{"structured_outputs": {kind: value}}]
    if kind in GUIDED:
        spellings.append({GUIDED[kind]: value})
    if kind == "json":
        spellings += [{"structured_outputs": {"json": json.dumps(value)}},
                      {"response_format": {"type": "json_schema", "json_schema": {
                          "name": "person", "schema": value, "strict": rng.random() < 0.5}}}]
    if kind == "json_object":
        spellings.append({"response_format": {"type": "json_object"}})
    return rng.choice(spellings)


def compacted(fields: dict, compact: bool) -> dict:
    """`fields` with structured_outputs' `disable_any_whitespace` when `compact`: in its object, or alone beside
    another field's constraint."""
    if not compact:
        return fields
    return {**fields, "structured_outputs": {**fields.get("structured_outputs", {}), "disable_any_whitespace": True}}


def satisfies(oracle, text: str) -> bool:
    """Whether `text` is one of the texts CONSTRAINTS' `oracle` describes."""
    if isinstance(oracle, str):
        return regex.fullmatch(oracle, text) is not None
    if isinstance(oracle, list):
        return text in oracle
    try:
        jsonschema.validate(json.loads(text), oracle)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def begins(oracle, text: str) -> bool:
    """Whether `text` is the start of one of the texts `oracle` describes (JSON's: opens its value or has not yet)."""
    if isinstance(oracle, str):
        return regex.fullmatch(oracle, text, partial=True) is not None
    if isinstance(oracle, list):
        return any(choice.startswith(text) for choice in oracle)
    return opens_json(text, "{")


def opens_json(text: str, bracket: str) -> bool:
    """Whether `text` is JSON whitespace, then `bracket` first if anything."""
    return text.lstrip(" \t\n\r")[:1] in ("", bracket)


def request_of(rng, path: str) -> tuple[dict, str]:
    """A prompt (completions) or messages (chat), and its text for the keys of `Chaos.same`."""
    prompt = rng.choice(PROMPTS)
    return ({"prompt": prompt} if path == COMPLETIONS else {"messages": [{"role": "user", "content": prompt}]}), prompt


def sampling(rng) -> tuple[dict, tuple]:
    """Greedy or seeded sampling: (its fields, what of it goes into a `Chaos.same` key)."""
    if rng.random() < 0.7:
        return {"temperature": 0}, ("greedy",)
    seed = rng.randint(0, 3)
    return {"temperature": 1.0, "seed": seed}, ("seed", seed)


@behaviour(kind="text")
async def text_structured(c, rng):
    """A constrained completion or chat, streamed or not, greedy or seeded: a "stop" answer satisfies its
    constraint, a "length" one has max_tokens tokens and begins as the constraint's texts do, and the tokens equal
    every run of the same constraint, however spelled."""
    name = rng.choice(sorted(CONSTRAINTS))
    kind, value, oracle = CONSTRAINTS[name]
    path, max_tokens = rng.choice((COMPLETIONS, CHAT)), rng.choice((8, 32, 64))
    prompt_fields, prompt = request_of(rng, path)
    compact = kind in ("json", "json_object") and rng.random() < 0.7  # a random model's JSON may be all whitespace
    fields, how = sampling(rng)
    body = {**prompt_fields, **compacted(spelled(kind, value, rng), compact), "max_tokens": max_tokens, **fields}
    result = await answer(c, path, body, rng.random() < 0.5)
    check_counts(path, result, max_tokens)
    if not (satisfies if result["finish_reason"] == "stop" else begins)(oracle, result["text"]):
        raise Bad(f"{path} {name} ({kind}), finish {result['finish_reason']}: {result['text']!r} does not "
                  f"{'satisfy' if result['finish_reason'] == 'stop' else 'begin as'} {value!r}")
    c.same(("structured", path, prompt, name, compact, max_tokens, how), json.dumps(result["token_ids"]))


def check_call(call: dict, forced: str | None, whole: bool) -> None:
    """A tool call of one of TOOLS (the `forced` one, when named), its arguments JSON of its parameters (`whole`), or
    the start of a JSON object (a call cut short)."""
    if call["name"] not in PARAMETERS or forced not in (None, call["name"]):
        raise Bad(f"a call of {call['name']!r} (forced: {forced})")
    if not whole:
        if not opens_json(call["arguments"], "{"):
            raise Bad(f"{call['name']} arguments cut short: {call['arguments']!r}")
        return
    try:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    except (ValueError, jsonschema.ValidationError) as exc:
        raise Bad(f"{call['name']} arguments {call['arguments']!r}: {str(exc).splitlines()[0]}") from None


@behaviour(kind="text")
async def text_tool_choice(c, rng):
    """A chat forced to call tools (`tool_choice` "required", or a named function), streamed or not: no content; a
    named call ends "stop" with one call of that function, "required" ends "tool_calls" with one call or more (one
    without parallel_tool_calls), each of a tool given, its arguments valid JSON of the tool's parameters; one cut
    short has max_tokens tokens and the calls begun (a named one at once), their arguments an object's start, or,
    "required" having begun none, content that starts the array of calls. Greedy calls equal every run of the same
    request's."""
    forced = rng.choice((None, *PARAMETERS))
    parallel, compact, max_tokens = rng.random() < 0.5, rng.random() < 0.7, rng.choice((16, 64))
    prompt = rng.choice(PROMPTS)
    body = {"messages": [{"role": "user", "content": prompt}], "tools": TOOLS, "max_tokens": max_tokens,
            "tool_choice": "required" if forced is None else {"type": "function", "function": {"name": forced}},
            "parallel_tool_calls": parallel, "temperature": 0, **compacted({}, compact)}
    result = await answer(c, CHAT, body, rng.random() < 0.5)
    check_counts(CHAT, result, max_tokens)
    reason, calls, content = result["finish_reason"], result["tool_calls"], result["text"]
    whole = reason != "length"
    if whole and reason != ("stop" if forced else "tool_calls"):
        raise Bad(f"tool_choice {forced or 'required'}: finish {reason}")
    if content and (whole or calls or not opens_json(content, "[")):  # (vLLM fails a cut "required" answer)
        raise Bad(f"tool_choice {forced or 'required'}, finish {reason}: content {content!r} beside {calls}")
    if (not calls and (whole or forced)) or (len(calls) > 1 and (forced or not parallel)):
        raise Bad(f"tool_choice {forced or 'required'} (parallel {parallel}), finish {reason}: {len(calls)} calls")
    for call in calls:
        check_call(call, forced, whole)
    c.same(("tools", prompt, forced, parallel, compact, max_tokens), json.dumps(calls))


SAY = {"prompt": "w60", "max_tokens": 4}
ASK = {"messages": [{"role": "user", "content": "w60"}], "max_tokens": 4}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
# (route, body, status, code, param): what structured_output_fields.py and completion_fields.py document; `model` is
# added. Each is refused before the engine runs it, streamed or not.
CONSTRAINT_REFUSALS = (
    (COMPLETIONS, {**SAY, "structured_outputs": {"regex": "[a-z"}}, 400, "invalid_request", "structured_outputs"),
    (COMPLETIONS, {**SAY, "guided_regex": "(unclosed"}, 400, "invalid_request", "guided_regex"),
    (CHAT, {**ASK, "guided_json": {"type": "nonsense"}}, 400, "invalid_request", "guided_json"),
    (COMPLETIONS, {**SAY, "structured_outputs": {"grammar": "start: (("}}, 400, "invalid_request",
     "structured_outputs"),
    (CHAT, {**ASK, "guided_grammar": 'root ::= "yes" | nowhere'}, 400, "invalid_request", "guided_grammar"),
    (CHAT, {**ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "invalid_request", "response_format"),
    (COMPLETIONS, {**SAY, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "invalid_request", "response_format.json_schema.schema"),
    (COMPLETIONS, {**SAY, "response_format": {"type": "xml"}}, 400, "invalid_request", "response_format"),
    (CHAT, {**ASK, "response_format": {"type": "structural_tag"}}, 400, "unsupported_parameter", "response_format"),
    (COMPLETIONS, {**SAY, "guided_choice": "yes"}, 400, "invalid_request", "guided_choice"),
    (COMPLETIONS, {**SAY, "guided_regex": "a", "guided_choice": ["a"]}, 400, "invalid_request", "guided_choice"),
    (COMPLETIONS, {**SAY, "structured_outputs": {"regex": "a"}, "guided_regex": "b"}, 400, "invalid_request",
     "guided_regex"),
    (CHAT, {**ASK, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, 400,
     "invalid_request", "response_format"),
    (COMPLETIONS, {**SAY, "structured_outputs": {"whitespace_pattern": " "}}, 400, "unsupported_parameter",
     "structured_outputs.whitespace_pattern"),
    (CHAT, {**ASK, "guided_whitespace_pattern": " "}, 400, "unsupported_parameter", "guided_whitespace_pattern"),
    (CHAT, {**ASK, "tools": TOOLS, "tool_choice": WEATHER, "guided_regex": "a"}, 400, "invalid_request",
     "tool_choice"),
    (COMPLETIONS, {**SAY, "allowed_token_ids": [3, 10**6]}, 400, "invalid_request", "allowed_token_ids"),
    (CHAT, {**ASK, "allowed_token_ids": [-1]}, 400, "invalid_request", "allowed_token_ids"),
    (COMPLETIONS, {**SAY, "bad_words": [""]}, 400, "invalid_request", "bad_words"),
)


async def check_refusal(response, status: int, code: str, param: str) -> None:
    """`response` is the JSON error `code` naming `param`, with `status`: no stream opened."""
    body = await response.read()
    if response.status != status or response.content_type != "application/json":
        raise Bad(f"expected a JSON {status} {code} ({param}), got HTTP {response.status} {response.content_type}: "
                  f"{body[:200]!r}")
    error = json.loads(body).get("error", {})
    if (error.get("code"), error.get("param")) != (code, param):
        raise Bad(f"expected {code} naming {param!r}, got {error}")


@behaviour(kind="text")
async def text_constraint_refusals(c, rng):
    """Invalid constraints and sample masks (one to three, streamed or not), a constraint on a Mode A request (400)
    or a Mode B session (422: its creation's refusals), each refused with its code and the field it came in."""
    for path, body, status, code, param in rng.sample(CONSTRAINT_REFUSALS, rng.randint(1, 3)):
        async with c.http.post(c.url + path, json={"model": c.model, **body, "stream": rng.random() < 0.5}) as r:
            await check_refusal(r, status, code, param)
    guided = rng.choice((("guided_regex", "[a-z]+"), ("structured_outputs", {"choice": ["a", "b"]})))
    if rng.random() < 0.5:
        lines = [{"model": c.model, "max_tokens": 4, guided[0]: guided[1]}, *chunk_objects(["w60 "])]
        async with c.http.post(c.url + COMPLETIONS, data="".join(json.dumps(line) + "\n" for line in lines),
                               headers={"X-Streaming-Input": "true"}) as r:
            await check_refusal(r, 400, "invalid_request", guided[0])
    else:
        async with c.http.post(c.url + SESSIONS, json={"model": c.model, "modality": "text", "params": {
                "max_tokens": 4, guided[0]: guided[1]}}) as r:
            await check_refusal(r, 422, "invalid_request", f"params.{guided[0]}")


async def tokenized(c: Chaos, text: str) -> list[int]:
    return json.loads(await c.call("POST", "/tokenize", 200, json={
        "model": c.model, "prompt": text, "add_special_tokens": False}))["tokens"]


@behaviour(kind="text")
async def text_allowed_tokens(c, rng):
    """`allowed_token_ids` (the ids of a few words, not the EOS id) on either route, streamed or not, greedy or
    seeded: every generated id is an allowed one, so the answer runs to max_tokens; the same ids as every run of
    it."""
    words = rng.sample(("the quick brown fox", "lazy dog", "red green blue", "hello world", "yes no"),
                       rng.randint(1, 2))
    allowed = sorted({token for word in words for token in await tokenized(c, word)})
    path, max_tokens = rng.choice((COMPLETIONS, CHAT)), rng.choice((1, 6, 24))
    prompt_fields, prompt = request_of(rng, path)
    fields, how = sampling(rng)
    result = await answer(c, path, {**prompt_fields, "max_tokens": max_tokens, "allowed_token_ids": allowed, **fields},
                          rng.random() < 0.5)
    check_counts(path, result, max_tokens)
    if not set(result["token_ids"]) <= set(allowed) or result["finish_reason"] != "length":
        raise Bad(f"allowed {allowed}: {result['token_ids']}, finish {result['finish_reason']}")
    c.same(("allowed", path, prompt, tuple(words), max_tokens, how), json.dumps(result["token_ids"]))


async def bad_sequences(c: Chaos, words: list[str]) -> list[list[int]]:
    """The ids vLLM bans for `words`: each word's tokenization, and after a space when that starts with another
    token and has as many (vLLM's update_from_tokenizer)."""
    sequences = []
    for word in words:
        alone, spaced = await tokenized(c, word.lstrip()), await tokenized(c, " " + word.lstrip())
        sequences += [alone, spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [alone]
    return sequences


def holds(ids: list[int], sequence: list[int]) -> bool:
    return any(ids[i:i + len(sequence)] == sequence for i in range(len(ids) - len(sequence) + 1))


@behaviour(kind="text")
async def text_bad_words(c, rng):
    """`bad_words` taken from what the same greedy request generates without them (one or two of its tokens' text,
    or a word it may write): on either route, streamed or not, no generated run of ids is a banned tokenization;
    the same ids as every run of it."""
    path, max_tokens = rng.choice((COMPLETIONS, CHAT)), rng.choice((6, 24))
    prompt_fields, prompt = request_of(rng, path)
    body = {**prompt_fields, "max_tokens": max_tokens, "temperature": 0}
    free = await answer(c, path, body, False)
    pieces = [json.loads(await c.call("POST", "/detokenize", 200, json={"model": c.model, "tokens": [token]}))["prompt"]
              for token in sorted(set(free["token_ids"]))]
    written = sorted({piece.strip() for piece in pieces if piece.strip() and "\ufffd" not in piece})
    words = rng.sample(written, min(len(written), rng.randint(1, 2))) or ["dog"]
    sequences = await bad_sequences(c, words)
    result = await answer(c, path, {**body, "bad_words": words}, rng.random() < 0.5)
    check_counts(path, result, max_tokens)
    if banned := [sequence for sequence in sequences if holds(result["token_ids"], sequence)]:
        raise Bad(f"bad words {words} (ids {sequences}): {banned} in {result['token_ids']}")
    c.same(("bad words", path, prompt, tuple(words), max_tokens), json.dumps(result["token_ids"]))


@behaviour(kind="text")
async def text_guided_drops(c, rng):
    """A client that goes away from a long constrained stream (a regex, a JSON object with any whitespace, a forced
    tool call) after one to three events: the server frees its session and grammar (each round's end checks)."""
    constraint = rng.choice(({"structured_outputs": {"regex": "[a-z ]{1,400}"}}, {"response_format": {
        "type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"}))
    path = CHAT if "tools" in constraint or rng.random() < 0.5 else COMPLETIONS
    prompt_fields, _ = request_of(rng, path)
    async with c.http.post(c.url + path, json={"model": c.model, **prompt_fields, **constraint, "max_tokens": 150,
                                               "temperature": 0, "stream": True}) as r:
        await sse_events(r, rng.randint(1, 3))
        r.close()  # drops the connection mid-stream
