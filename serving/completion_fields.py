"""The request fields /v1/completions reads (and chat, Mode A and Mode B sessions with it): sampling parameters with
vLLM's defaults and refusals (`sampling_params`, vLLM's extras `allowed_token_ids` and `bad_words` among them,
structured outputs through structured_output_fields.py), the prompt, the context-length check, boolean flags and
`stream_options` (http_completions.py documents the fields)."""
from jaxstream.engine.requests import SamplingParams
from jaxstream.engine.sample_masks import bad_word_sequences
from jaxstream.errors import InvalidRequestError
from jaxstream.serving import structured_output_fields
from jaxstream.serving.http_errors import RequestError
from jaxstream.serving.structured_output_fields import Requested

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The fields a request that leaves them out takes from the model's sampling defaults. Not max_tokens: vLLM's
# CompletionRequest makes an omitted or null one 16 before any default applies (a generation config's
# max_new_tokens caps completions only under a --generation-config folder, which jaxstream does not take).
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Fields jaxstream cannot honour, OpenAI's and then vLLM's sampling extras, with the value that means "not used"
# (an empty list or object is not used either). vLLM honours them all: taking one and ignoring it would give a
# client other output than it asked for, without a word.
NEUTRAL = {"suffix": None, "best_of": 1, "length_penalty": 1, "use_beam_search": False, "truncate_prompt_tokens": None,
           "add_special_tokens": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
           "logits_processors": None}


def sampling_params(body: dict, defaults: SamplingParams, *, streaming: bool = True, neutral: dict = NEUTRAL,
                    default_max_tokens: int | None = DEFAULT_MAX_TOKENS, vocab_size: int | None = None,
                    structured: Requested | None = None, tokenizer=None) -> SamplingParams:
    """SamplingParams from OpenAI completion fields (and vLLM's extras) for a streaming-input session, or a
    one-shot request (`streaming=False`: stop strings allowed); RequestError 400 when invalid, and when
    `logit_bias` or `allowed_token_ids` names an id outside a `vocab_size` given, or `bad_words` that the model's
    `tokenizer` given (with `vocab_size`) tokenizes as vLLM refuses (else the engine refuses the request). A field of
    `DEFAULTED` the body omits or sends as null takes its value in `defaults` (the engine's
    `default_sampling_params()`), as vLLM's `to_sampling_params` merges the model's generation config. The fields
    of `neutral` are refused unless they hold their "not used" value; `max_tokens` omitted or null is
    `default_max_tokens` (None: up to the end of the context). Structured outputs are the body's
    (structured_output_fields.py), or `structured` when the caller read them (chat's forced tool calls)."""
    for name, unused in neutral.items():
        value = body.get(name)
        if value is not None and value != unused and value not in ({}, []):
            raise RequestError(400, "unsupported_parameter", f"`{name}` is not supported by this server", name)
    structured = structured_output_fields.requested(body) if structured is None else structured
    fields = {"n": 1, **{name: getattr(defaults, name) for name in DEFAULTED}, "min_tokens": 0, "ignore_eos": False,
              "include_stop_str_in_output": False}
    fields.update({name: body[name] for name in (*fields, "seed", "stop", "stop_token_ids", "logprobs",
                                                 "prompt_logprobs", "presence_penalty", "frequency_penalty",
                                                 "logit_bias", "allowed_token_ids", "bad_words")
                   if body.get(name) is not None})
    # null is the default too, as in vLLM: OpenAI's SDK sends null for an argument given as None.
    fields["max_tokens"] = default_max_tokens if body.get("max_tokens") is None else body["max_tokens"]
    fields["structured_outputs"] = structured.params()
    if streaming and structured.fields:  # the engine's refusal, naming the field the client sent
        raise RequestError(400, "invalid_request", "structured outputs are not supported with streaming input",
                           structured.param or "structured_outputs")
    try:
        params = SamplingParams(**fields)
        params.check_supported(streaming=streaming)
        if vocab_size is not None:
            params.check_vocabulary(vocab_size)
    except InvalidRequestError as exc:
        raise RequestError(400, "invalid_request", str(exc), _field_named(str(exc), fields)) from None
    if tokenizer is not None and vocab_size is not None and params.bad_words:
        try:  # what the engine refuses once it tokenizes them
            bad_word_sequences(params.bad_words, tokenizer, vocab_size)
        except InvalidRequestError as exc:
            raise RequestError(400, "invalid_request", str(exc), "bad_words") from None
    if params.prompt_logprobs and body.get("stream") is True:  # vLLM's: a stream's choices have no such field
        raise RequestError(400, "invalid_request", "`prompt_logprobs` are not available when `stream=True`.",
                           "prompt_logprobs")
    return params


def _field_named(message: str, fields: dict) -> str | None:
    """The field an engine refusal is about (its messages start with the name, but vLLM's "Too many bad words"
    ones), for the error's `param`."""
    name = message.split(" ", 1)[0].split("=", 1)[0]
    if name not in fields and "bad word" in message:
        return "bad_words"
    return name if name in fields else None


def parse_prompt(body: dict, state):
    """The prompt: a string or a list of token ids (or a list holding one of either: one prompt a request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        check_tokenizer(state)
        return prompt
    vocab = state.engine.model_config.vocab_size
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)):
        return prompt
    raise RequestError(400, "invalid_request", f"prompt must be a non-empty string or a non-empty list of token "
                       f"ids below {vocab} (one prompt per request)", "prompt")


def prompt_ids(prompt, state) -> list[int]:
    """A one-shot prompt as the engine's ids (its first chunk: the tokenizer's `prompt_prefix`, BOS
    for most, then the text's ids)."""
    if not isinstance(prompt, str):
        return prompt
    tokenizer = state.engine.tokenizer
    try:
        return [*tokenizer.prompt_prefix, *tokenizer.encode(prompt)]
    except ValueError as exc:  # a lone surrogate
        raise RequestError(400, "invalid_request", f"prompt: {exc}", "prompt") from None


def check_context_length(ids: list[int], params: SamplingParams, state, param: str = "prompt") -> None:
    """vLLM's 400 for a one-shot request that cannot fit: its prompt, or prompt + max_tokens, is over
    `max_model_len` (the engine would end it at once with 'length' and no text). Streaming-input sessions
    keep the engine's session rule instead: their context grows past any one request."""
    limit = state.engine.max_model_len
    if params.max_tokens is None and len(ids) >= limit:
        message = (f"This model's maximum context length is {limit} tokens. However, you requested {len(ids)} "
                   f"tokens in the prompt. Please reduce the length of the prompt.")
    elif params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        message = (f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in "
                   f"the completion). Please reduce the length of the prompt or completion.")
    else:
        return
    raise RequestError(400, "context_length_exceeded", message, param)


def check_tokenizer(state, param: str = "prompt", instead: str = "send token ids") -> None:
    """400 on `param` when the model has no tokenizer (a text prompt, stop strings), saying what to do `instead`."""
    if state.engine.tokenizer is None:
        raise RequestError(400, "invalid_request", f"{state.model_id!r} has no tokenizer: {instead}", param)


def parse_flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field; null is its default: OpenAI documents its flags as boolean or null (its SDK sends null for a
    None argument), and vLLM's `return_token_ids` is one too."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(400, "invalid_request", f"{name} must be true, false or null", name)
    return default if value is None else value


def parse_stream(body: dict, *, implied: bool = False) -> tuple[bool, bool]:
    """(stream, include_usage). `stream_options` (other than null or empty) without `stream: true` is refused
    with vLLM's message (its CompletionRequest validator), unless the answer is a stream anyway (`implied`:
    Mode A)."""
    stream, options = parse_flag(body, "stream"), body.get("stream_options")
    if options and not (stream or implied):
        raise RequestError(400, "invalid_request", "Stream options can only be defined when `stream=True`.",
                           "stream_options")
    options = options or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage"), bool | None):
        raise RequestError(400, "invalid_request", "stream_options must be {\"include_usage\": bool}",
                           "stream_options")
    if options.get("continuous_usage_stats"):  # vLLM's usage in every chunk
        raise RequestError(400, "unsupported_parameter", "`stream_options.continuous_usage_stats` is not supported "
                           "by this server", "stream_options")
    return stream, bool(options.get("include_usage"))
