"""OpenAI's `POST /v1/completions` over a served text LM (specs/realtime_protocols.md §7.1, §8).

A JSON body as OpenAI's SDK sends it: `model`, `prompt` (a string, or token ids; a list of one of either),
`max_tokens` (default 16, as OpenAI), `temperature`, `top_p`, `seed`, `stop` (a string or a list of up to 64, each
up to 1,000 characters), `n` (up to 128 choices: the engine's children, choice i seeded seed + i, as vLLM; streamed,
each chunk is one choice's, by its `index`), `presence_penalty` and `frequency_penalty` (in [-2, 2]), `logit_bias`
(up to 300 {"token id": bias in [-100, 100]}, ids in the model's vocabulary), `stream`,
`stream_options.include_usage`, and vLLM's `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `return_token_ids`, with vLLM's meanings (SamplingParams), and
`echo` (the prompt's text before the completion's; a stream sends it first, in a chunk of its own). `stream: true`
answers with SSE `text_completion` chunks and `data: [DONE]`; `stream_options` without it is refused, as vLLM refuses
it. Structured outputs (vLLM's guided decoding: `structured_outputs`, OpenAI's `response_format`, the old `guided_*`
fields) constrain the text to a JSON schema, regex, choice or grammar (structured_output_fields.py). OpenAI's fields it
cannot honour (`best_of`, `suffix`, ...) and vLLM's (`truncate_prompt_tokens`, `logits_processors`, ...: `NEUTRAL`)
are refused, 400 `unsupported_parameter`, unless they hold their "not used" value: served and ignored, they would give
other output than the client asked for. Other unknown fields are ignored, as vLLM ignores them. The fields are read
in completion_fields.py.

A plain request is one engine request (`generate` over its prompt), so stop strings work as in vLLM: the text
ends before the first one generated (or after it with `include_stop_str_in_output`), the choice says
`finish_reason: "stop"` and `stop_reason` the string, and a stream holds back the characters a stop string
could still cut. They need the model's tokenizer (400 without one). Every choice carries vLLM's `stop_reason`:
the stop string or stop token id that ended the completion, else null. Streaming input refuses stop strings,
as vLLM does.

`logprobs: N` (up to 20, vLLM's default max_logprobs) gives each choice, and each streamed chunk for its own tokens,
OpenAI's legacy `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (the N most likely tokens of each step and
the sampled one) and `text_offset`, from the engine's `CompletionOutput.logprobs` / `top_logprobs`. A token's
string is its bytes as UTF-8, a piece of a character as U+FFFD, a control token by its name (vLLM's
`return_tokens_as_token_ids`: "token_id:<id>", as always for a model without a tokenizer); -inf is -9999.0. With
`echo`, the prompt's tokens come first (the engine's prompt logprobs, vLLM's: the first token's logprob and
`top_logprobs` null; streamed, in the echo's chunk, which then waits for the first output). vLLM's `prompt_logprobs: N`
(up to 20; not with `stream: true`, as vLLM) gives each choice its `prompt_logprobs` (http_prompt_logprobs.py: null,
then {token id: {logprob, rank, decoded_token}} a prompt token); `n` > 1 choices share the prompt's.

`return_token_ids` (vLLM's) adds the engine's ids to the choice: `prompt_token_ids` (the prompt as the engine
took it, BOS included) and `token_ids` (the generated ids). Streamed, `prompt_token_ids` comes in the first
chunk only (null after it; with streaming input, each later input's ids in the first chunk after them) and each
chunk's `token_ids` are its own, so a client of a model served without a tokenizer, whose text is empty, still
gets its output.

With `X-Streaming-Input: true` the body is Mode A's NDJSON (streaming_input.py): an optional parameters
line, then chunks of base64 UTF-8 text; each chunk applied after the start is one `StreamingInput` of the
engine's session, so the engine's cumulative-prompt rule (every output but the last sampled token of a
chunk joins the context before the next chunk) applies chunk by chunk, and `max_tokens` is per chunk. The
answer is an SSE stream (`stream: false` in the line is refused, 422).

`TextInput` is the engine side of a text stream for plain requests, Mode A and Mode B (http_sessions.py).
"""
import asyncio
import codecs
import dataclasses
import logging
import time
import uuid

from aiohttp import web

from jaxstream.engine.requests import SamplingParams, StreamingInput
from jaxstream.errors import EngineError, InvalidRequestError
from jaxstream.serving import sse, streaming_input, structured_output_fields
from jaxstream.serving.completion_fields import (
    check_context_length, check_tokenizer, parse_flag, parse_prompt, parse_stream, prompt_ids, sampling_params,
)
from jaxstream.serving.http_errors import (
    RequestError, check_model, check_ready, engine_request_error, error_response, read_json, server_state,
)
from jaxstream.serving.http_prompt_logprobs import (
    echoed_logprobs, finite_logprob, joined_logprobs, prompt_logprobs_field,
)
from jaxstream.serving.limits import drain_truncation, holds_stream

logger = logging.getLogger(__name__)

_END = object()  # ends a TextInput's chunk queue


class TextInput(streaming_input.EngineInput):
    """The engine side of one text completion: a `generate` session fed `StreamingInput` chunks as they
    are appended (`one_shot`: one `generate` over the one prompt appended), its output kept and, when `log`
    is given, streamed as `text_completion` chunks (see streaming_input.py for the interface)."""

    modality = "text"

    def __init__(self, state, params: SamplingParams, log: sse.EventLog | None = None, *,
                 include_usage: bool = False, return_token_ids: bool = False, tokens_as_ids: bool = False,
                 one_shot: bool = False, echo: str = "", structured_param: str | None = None):
        super().__init__(state, log)
        self.structured_param = structured_param  # the body field that asked for `params.structured_outputs`
        self.echo = echo  # OpenAI's `echo`: the prompt's text, before the completion's in the choice
        self.params = params
        # One prompt, one engine request (what stop strings need); else a session of StreamingInput chunks.
        self.one_shot = one_shot
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (always, without a tokenizer).
        self.tokens_as_ids = tokens_as_ids
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [Choice(index) for index in range(params.n)]  # n > 1: one-shot requests only
        self.prompt_token_ids: list[int] = []  # the engine's: the chunk prompts so far
        self.prompt_logprobs = None  # the engine's, every choice's (`params.prompt_logprobs`), from the first output
        self._prompt_streamed = 0  # how many of them the stream carried
        self.error: EngineError | None = None
        self.aborted = False
        self._chunks: asyncio.Queue = asyncio.Queue()
        # Chunks are bytes cut anywhere: a character may span two of them, so the input is decoded as one.
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    @property
    def started(self) -> bool:
        return self._pump is not None

    @property
    def failure(self) -> EngineError | None:
        return self.error

    @property
    def succeeded(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None and not self.aborted

    # The first choice's, what a streaming-input session (one choice) reports.
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def decode(self, payload: str) -> bytes:
        """The payload's bytes, refused when they are not UTF-8 apart from a character cut at either end
        (checked on arrival: Mode B holds chunks that arrive early, and applies them in order later)."""
        data = streaming_input.decode_base64(payload)
        cut = 0
        while cut < min(3, len(data)) and 0x80 <= data[cut] < 0xC0:  # the end of a character begun before
            cut += 1
        try:
            codecs.getincrementaldecoder("utf-8")().decode(data[cut:])
        except UnicodeDecodeError as exc:
            raise _invalid_text(f"payload is not UTF-8 text: {exc}") from None
        return data

    @staticmethod
    def measure(data: bytes) -> tuple[int, float]:
        return len(data), 0.0

    @staticmethod
    def join(pieces: list[bytes]) -> bytes:
        return b"".join(pieces)

    async def start(self) -> None:
        self._pump = asyncio.create_task(self._run())

    async def append(self, prompt) -> None:
        """A prompt: a one-shot request's text or ids, or the next streaming-input bytes (their complete
        characters; one cut at the end waits for the next chunk)."""
        if isinstance(prompt, bytes):
            try:
                prompt = self._utf8.decode(prompt)
            except UnicodeDecodeError as exc:
                raise _invalid_text(f"the input is not UTF-8 text: {exc}") from None
            if not prompt:
                return
        self._chunks.put_nowait(prompt)  # bounded by the payload cap; the engine queues chunks FIFO anyway

    async def finish(self) -> None:
        self._chunks.put_nowait(_END)
        try:
            self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise _invalid_text("the input ends inside a UTF-8 character") from None

    async def _inputs(self):
        while (prompt := await self._chunks.get()) is not _END:
            yield StreamingInput(prompt, self.params)

    async def _run(self) -> None:
        finished = False
        try:
            # A one-shot request's prompt is its one append (its `finish` follows).
            prompt = await self._chunks.get() if self.one_shot else self._inputs()
            # The prompt's text, in a chunk of its own before the first; with logprobs, once the engine gave the
            # prompt's (with the first output).
            echo = bool(self.echo) and self.log is not None
            if echo and self.params.logprobs is None:
                self._log_echo()
                echo = False
            async for out in self.state.engine.generate(prompt, self.params, request_id=self.id):
                self.prompt_token_ids = out.prompt_token_ids
                self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs  # DELTA's come once
                if echo:
                    self._log_echo()
                    echo = False
                finished = out.finished
                for completion in out.outputs:
                    choice = self.choices[completion.index]
                    choice.add(completion)
                    # A streaming-input chunk's finish is not the session's; a one-shot request's choice ends there.
                    choice.ended = finished or (self.one_shot and completion.finish_reason is not None)
                    if self.log is not None:
                        if choice.ended:
                            self._log_end(choice, completion.text, completion.token_ids)
                        elif self._carries(completion.text, completion.token_ids):
                            self.log.append(self.streamed_chunk(choice, completion.text, None, completion.token_ids))
            if self.log is not None:
                for choice in self.choices:
                    if not choice.ended:  # the input closed while the session was parked: no final output came
                        self._log_end(choice, "", [], choice.finish_reason or "stop")
                if self.include_usage:
                    self.log.append({**self.chunk("", None), "choices": [], "usage": self.usage()})
        except (EngineError, ValueError, TypeError) as exc:  # generate re-raises a chunk's own error
            self.error = exc if isinstance(exc, EngineError) else InvalidRequestError(str(exc))
            sse.close_with_error(self.log, self.error.code, str(self.error), self.state.metrics)
        finally:
            if self.log is not None:
                self.log.close()
            self._done.set()

    def _log_echo(self) -> None:
        for choice in self.choices:
            chunk = self.streamed_chunk(choice, self.echo, None, [])
            chunk["choices"][0]["logprobs"] = self.echo_logprobs()[0]
            self.log.append(chunk)

    def _carries(self, text: str, token_ids: list[int]) -> bool:
        # Ids that decode to no text yet (or a model without a tokenizer) still make a chunk for a client that asked
        # for them or for their logprobs.
        return bool(text or ((self.return_token_ids or self.params.logprobs is not None) and token_ids))

    def _log_end(self, choice: "Choice", text: str, token_ids: list[int], finish_reason: str | None = None) -> None:
        """The stream's final chunk, the one with the finish reason. When the drain ended the input, the drain's notice
        goes right before it, after the last text (output that came with the finish goes out first, in a chunk of its
        own), and the final chunk carries `truncated` and `truncation`, as a drained transcript's done does."""
        fields = self.truncation()
        if fields:
            if self._carries(text, token_ids):
                self.log.append(self.streamed_chunk(choice, text, None, token_ids))
                text, token_ids = "", []
            sse.log_error(self.log, "server_draining", self.drained, self.state.metrics)
        self.log.append({**self.streamed_chunk(choice, text, finish_reason or choice.finish_reason, token_ids),
                         **fields})

    def truncation(self) -> dict:
        """`truncated` and `truncation` (the bytes of text received, as the notice counts them) when the drain ended
        the input (`drained`), else nothing."""
        return {} if self.drained is None else drain_truncation(self.drained, self.drained_at, "text")

    async def abort(self, reason: str) -> None:
        """Stops the generation: cancelling `generate`'s consumer aborts the engine request."""
        if self._pump is not None:
            if not self._pump.done():
                self.aborted = True
                logger.info("completion %s aborted: %s", self.id, reason)
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        if self.log is not None:
            self.log.close()
        self._done.set()

    async def wait(self, timeout: float | None = None) -> None:
        await self._wait_done(timeout)

    async def close(self) -> None:
        await self.abort("request_ended")

    # -- OpenAI shapes ------------------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def usage(self) -> dict:
        generated = sum(len(choice.token_ids) for choice in self.choices)  # the prompt is counted once, as vLLM
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                "total_tokens": self.prompt_tokens + generated}

    def chunk(self, text: str, finish_reason: str | None, prompt_ids: list[int] | None = None,
              token_ids: list[int] | None = None, logprobs: dict | None = None, choice: "Choice | None" = None,
              ) -> dict:
        """A `text_completion` body of one choice (default the first), with the ids when the client asked for them
        (vLLM's `return_token_ids`: both fields, the prompt's null where it has none to carry). `stop_reason` is
        vLLM's: null until the choice finishes."""
        return self._body([self._text_choice(choice or self.choices[0], text, finish_reason, prompt_ids, token_ids,
                                             logprobs)])

    def _text_choice(self, choice: "Choice", text: str, finish_reason: str | None, prompt_ids: list[int] | None,
                     token_ids: list[int] | None, logprobs: dict | None) -> dict:
        body = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason if finish_reason is not None else None}
        if self.return_token_ids and token_ids is not None:
            body.update(prompt_token_ids=prompt_ids, token_ids=token_ids)
        return body

    def _body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.model_id,
                "choices": choices}

    def streamed_chunk(self, choice: "Choice", text: str, finish_reason: str | None, token_ids: list[int]) -> dict:
        """A stream's chunk: `token_ids` are its own; `prompt_token_ids` are the prompt's ids no chunk carried
        yet (null when none): the whole prompt in the first chunk, as vLLM; with streaming input, each later
        input's ids in the first chunk after them, so the chunks' prompt ids add up to the engine's prompt."""
        prompt = self.prompt_token_ids[self._prompt_streamed:]
        self._prompt_streamed = len(self.prompt_token_ids)
        end = len(choice.token_ids)  # the chunk's ids are the last ones received
        logprobs = self.logprobs_body(choice, end - len(token_ids), end, choice.text_streamed)
        choice.text_streamed += len(text)
        return self.chunk(text, finish_reason, list(prompt) or None, list(token_ids), logprobs, choice)

    def completion(self) -> dict:
        echoed, offset = self.echo_logprobs()
        choices = [self._text_choice(choice, self.echo + choice.text, choice.finish_reason or "stop",
                                     list(self.prompt_token_ids), choice.token_ids,
                                     joined_logprobs(echoed, self.logprobs_body(choice, 0, len(choice.token_ids),
                                                                                offset)))
                   for choice in self.choices]
        if self.params.prompt_logprobs is not None:  # vLLM's field, on each choice (the same: one prompt)
            field = prompt_logprobs_field(self.prompt_logprobs)
            for choice in choices:
                choice["prompt_logprobs"] = field
        return {**self._body(choices), "usage": self.usage()}

    def echo_logprobs(self) -> tuple[dict | None, int]:
        """The echoed prompt's legacy `logprobs` (None without echo or logprobs) and the text offset after it."""
        if not self.echo or self.params.logprobs is None:
            return None, 0
        return echoed_logprobs(self.prompt_token_ids, self.prompt_logprobs, self.token_string)

    def logprobs_body(self, choice: "Choice", first: int, end: int, text_offset: int) -> dict | None:
        """OpenAI's legacy `logprobs` of generated tokens first..end, as vLLM gives them: each token's string and
        logprob, its step's most likely tokens (with the sampled one, which may make N + 1) and where its text starts
        (from `text_offset`, counting the token strings); None when not asked for or without tokens."""
        if self.params.logprobs is None or first >= end:
            return None
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, (logprob, top) in zip(choice.token_ids[first:end], choice.logprobs[first:end]):
            token = self.token_string(token_id)
            tokens.append(token)
            token_logprobs.append(finite_logprob(logprob))
            others = {self.token_string(i): finite_logprob(value) for i, value in top.items() if i != token_id}
            top_logprobs.append({token: finite_logprob(logprob), **others})
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    @property
    def tokenizer(self):
        """The tokenizer that names tokens in logprobs; None: they are named by id."""
        return None if self.tokens_as_ids else self.state.engine.tokenizer

    def token_string(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.token_string(token_id)

    def result(self) -> dict:
        """A Mode B session's result; with `logprobs` asked, the completion route's legacy `logprobs` of its tokens (a
        session took the field and its result dropped them)."""
        first = self.choices[0]
        logprobs = {} if self.params.logprobs is None else {"logprobs": self.logprobs_body(first, 0,
                                                                                         len(first.token_ids), 0)}
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                **logprobs, "usage": self.usage(), **self.truncation()}


@dataclasses.dataclass
class Choice:
    """One completion of a request (`n` > 1: one of several, its `index`): what came so far."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    # With `params.logprobs`, each generated token's logprob and its step's most likely ids -> logprobs.
    logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    text_streamed: int = 0  # characters of text the stream carried: where the next chunk's text_offset starts
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # with finish_reason: the stop string or id that ended it
    ended: bool = False  # its final chunk went out (or the request's result holds it)

    def add(self, completion) -> None:
        """A `CompletionOutput` of this choice (its delta)."""
        self.text += completion.text
        self.token_ids += completion.token_ids
        if completion.logprobs is not None:
            self.logprobs += zip(completion.logprobs, completion.top_logprobs)
        if completion.finish_reason is not None:
            self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason


def _invalid_text(message: str) -> RequestError:
    return RequestError(422, "invalid_text", message, "payload")


async def serve_one_shot(request: web.Request, prepare, on_streaming_input) -> web.StreamResponse:
    """One text request, one engine request: `prepare(body, state)` checks the JSON body and gives its `TextInput`
    and prompt ids (RequestError otherwise); the input is admitted, run, and answered as an SSE stream or one JSON
    body. A request sent with `X-Streaming-Input: true` is `on_streaming_input(request, state)`'s."""
    state = server_state(request)
    try:
        check_ready(state)
        if streaming_input.is_streaming_input(request):
            return await on_streaming_input(request, state)
        text_input, prompt = prepare(await read_json(request), state)
        # Refused before the request waits for its turn, and before any answer: a stream then opens at once.
        await structured_output_fields.check_grammar(state.engine, text_input.params, text_input.structured_param)
        handle = streaming_input.DrainHandle(text_input)
        await streaming_input.admit_in_turn(state, handle, request)
    except RequestError as exc:
        state.metrics.errors.labels(code=exc.code).inc()
        return exc.response()
    try:
        await text_input.start()
        await text_input.append(prompt)
        await text_input.finish()
        response = await text_input.serve_output(request)
        if response is not None:
            return response
        if text_input.error is not None:
            return engine_request_error(text_input.error).response()
        if text_input.finish_reason is None:
            return error_response(500, "aborted", "The completion produced no output")
        return web.json_response(text_input.completion())
    finally:
        await asyncio.shield(streaming_input.end_request(state, handle))


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve_one_shot(request, _completion, _streaming_input)


def _completion(body: dict, state) -> tuple["TextInput", list[int]]:
    check_model(state, body.get("model"), "text")
    given = parse_prompt(body, state)
    prompt = prompt_ids(given, state)
    structured = structured_output_fields.requested(body)
    params = sampling_params(body, state.engine.default_sampling_params(), streaming=False,
                             vocab_size=state.engine.model_config.vocab_size,
                             tokenizer=state.engine.tokenizer, structured=structured)
    echo = _echoed(body, given, state)
    if echo and params.logprobs is not None and params.prompt_logprobs is None:  # vLLM's: the echoed tokens' too
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    if params.stop:
        check_tokenizer(state, "stop", "stop strings need one; use stop_token_ids")
    check_context_length(prompt, params, state)
    stream, include_usage = parse_stream(body)
    text_input = TextInput(state, params, sse.EventLog() if stream else None, include_usage=include_usage,
                           return_token_ids=parse_flag(body, "return_token_ids"),
                           tokens_as_ids=parse_flag(body, "return_tokens_as_token_ids"), one_shot=True,
                           echo=echo, structured_param=structured.param)
    return text_input, prompt


def _echoed(body: dict, prompt: str | list[int], state) -> str:
    """OpenAI's `echo`: the prompt's text (`prompt` as given: text, or ids decoded with special tokens skipped, as
    vLLM) to put before the completion's; "" without echo."""
    if not parse_flag(body, "echo"):
        return ""
    if isinstance(prompt, str):
        return prompt
    check_tokenizer(state, "echo", "a prompt of token ids is echoed as its text")
    return state.engine.tokenizer.decode(prompt)


async def _streaming_input(request: web.Request, state) -> web.StreamResponse:
    """Mode A: the NDJSON body's text chunks feed one completion session, answered as SSE meanwhile. Its first
    line comes at the body's minimum rate (streaming_input.first_object), as the audio route's."""
    objects = streaming_input.ndjson_objects(request, state.config.limits)
    params, first_chunk = await streaming_input.first_object(request, objects)
    check_model(state, params.get("model"), "text")
    if streaming_input.parse_modality(params, "text") != "text":
        raise RequestError(422, "unsupported_modality", "/v1/completions takes text", "modality")
    if "prompt" in params:
        raise RequestError(422, "invalid_request", "With streaming input the prompt comes as chunks", "prompt")
    check_tokenizer(state)
    policy = streaming_input.parse_start_policy(params, "text")
    streaming_input.check_streamed(params)
    _, include_usage = parse_stream(params, implied=True)
    sampling = sampling_params(params, state.engine.default_sampling_params(),
                               vocab_size=state.engine.model_config.vocab_size,
                               tokenizer=state.engine.tokenizer)
    text_input = TextInput(state, sampling, sse.EventLog(), include_usage=include_usage,
                           return_token_ids=parse_flag(params, "return_token_ids"))
    return await streaming_input.serve_mode_a(request, state, text_input, policy, objects, first_chunk)


def add_completion_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", holds_stream(completions))
