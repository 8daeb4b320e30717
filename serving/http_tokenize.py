"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP, so that a client can
count a prompt's tokens against `max_model_len` or read the ids a completion returned (`return_token_ids`).

`/tokenize` takes `prompt` (a string) with `add_special_tokens` (default true: what the engine puts before a
completion's prompt, the tokenizer's `prompt_prefix`: BOS for most, nothing for Qwen's), or vLLM's chat form:
`messages` with `add_generation_prompt` (default true), `continue_final_message`, `chat_template_kwargs` and
`add_special_tokens` (default false: the template writes its own BOS), rendered and tokenized as
`/v1/chat/completions` takes them (http_chat.py), for a text LM. It answers
`{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (with `return_token_strs: true`) is the text each
id stands for (a piece of a UTF-8 character shows as U+FFFD, a special token its name, as logprobs show them),
where vLLM gives the tokenizer's own piece names. `/detokenize` takes `tokens` and answers `{"prompt": text}` with the
special tokens (BOS, EOS, control tokens) written by name, as vLLM's (its tokenizers decode with
skip_special_tokens=False by default; a completion's text leaves them out). `model` is optional, as in vLLM; named,
it must be the served one. Any served model with a tokenizer answers, the transcription model included (its
`max_model_len` is null).
"""
import functools

from aiohttp import web

from jaxstream.serving.http_chat import render_chat
from jaxstream.serving.completion_fields import parse_flag
from jaxstream.serving.http_errors import (
    RequestError, check_kind, check_model_name, check_ready, read_json, server_state,
)


def _served(body: dict, state):
    """The engine's tokenizer, once the body names the served model or none (400/404 otherwise)."""
    check_model_name(state, body.get("model"))
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise RequestError(400, "invalid_request", f"{state.model_id!r} has no tokenizer")
    return tokenizer


async def _answer(request: web.Request, answer) -> web.Response:
    """The JSON `answer(body, state, tokenizer)` gives for the request's body, or its RequestError."""
    state = server_state(request)
    try:
        check_ready(state)
        body = await read_json(request)
        return web.json_response(answer(body, state, _served(body, state)))
    except RequestError as exc:
        return exc.response()


def _tokenized(body: dict, state, tokenizer) -> dict:
    if "messages" in body:
        ids = _chat_ids(body, state)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "invalid_request", "prompt must be a string (or send messages)", "prompt")
        special = parse_flag(body, "add_special_tokens", True)
        try:
            ids = [*(tokenizer.prompt_prefix if special else ()), *tokenizer.encode(prompt)]
        except ValueError as exc:  # a lone surrogate
            raise RequestError(400, "invalid_request", f"prompt: {exc}", "prompt") from None
    strs = [tokenizer.token_string(i) for i in ids] if parse_flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": strs}


def _chat_ids(body: dict, state) -> list[int]:
    """vLLM's TokenizeChatRequest: the ids the chat route would give the engine for these messages."""
    check_kind(state, "text")
    if body.get("tools"):
        raise RequestError(400, "unsupported_parameter", "`tools` is not supported by this server", "tools")
    return render_chat(body, state, add_special_tokens=parse_flag(body, "add_special_tokens")).token_ids


def _detokenized(body: dict, state, tokenizer) -> dict:
    tokens = body.get("tokens")
    vocab = tokenizer.vocab_size
    if not (isinstance(tokens, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
        raise RequestError(400, "invalid_request", f"tokens must be a list of token ids below {vocab}", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", functools.partial(_answer, answer=_tokenized))
    app.router.add_post("/detokenize", functools.partial(_answer, answer=_detokenized))
