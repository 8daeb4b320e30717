"""The rules of vLLM's `generate` that need no engine state, which `AsyncEngine.generate` applies on the event
loop (specs/streaming_semantics.md): a prompt's token ids, a streaming-input chunk checked against its
session, a slow consumer's queued outputs merged into one, and the abort of a session whose first chunk never
came."""
import asyncio
import dataclasses

from jaxstream.engine.requests import CompletionOutput, RequestOutput, SamplingParams, StreamingInput
from jaxstream.errors import InvalidRequestError


def prompt_token_ids(tokenizer, prompt, *, first: bool) -> list[int]:
    """The ids of `prompt`: token ids, text (tokenized; a session's first text starts with the tokenizer's
    `prompt_prefix`, BOS for most) or vLLM's {"prompt_token_ids": ...} / {"prompt": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids instead")
        return [*(tokenizer.prompt_prefix if first else ()), *tokenizer.encode(prompt)]
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        return [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")


def checked_chunk(chunk, session_params: SamplingParams) -> tuple[object, SamplingParams]:
    """(prompt, sampling parameters) of a streaming-input chunk (a `StreamingInput` or a bare prompt); its
    parameters default to the session's. Raises for what a streaming session cannot take."""
    if not isinstance(chunk, StreamingInput):
        chunk = StreamingInput(chunk)
    params = chunk.sampling_params or session_params
    params.check_supported(streaming=True)
    if params.output_kind is not session_params.output_kind:
        # `generate` merges a slow consumer's queued outputs by the session's kind: chunks of another kind
        # would lose tokens (deltas merged as totals) or repeat them.
        raise InvalidRequestError(f"a chunk's output_kind ({params.output_kind.name}) must be the "
                                  f"session's ({session_params.output_kind.name})")
    if isinstance(chunk.prompt, dict) and "prompt_embeds" in chunk.prompt:
        raise ValueError("prompt_embeds are not supported with streaming input")
    return chunk.prompt, params


def merge_pending(item: RequestOutput, outputs: asyncio.Queue, *, delta: bool) -> RequestOutput:
    """A slow consumer gets the outputs queued behind `item` merged into one, never across a chunk end."""
    while item.outputs[0].finish_reason is None and not outputs.empty():
        following = outputs._queue[0]  # noqa: SLF001 - peek; asyncio.Queue has no public peek
        if not isinstance(following, RequestOutput):
            break
        outputs.get_nowait()
        item = _merged(item, following) if delta else following  # a cumulative output contains the earlier
    return item


def _merged(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    a, b = first.outputs[0], second.outputs[0]
    logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
    top = a.top_logprobs + b.top_logprobs if a.top_logprobs is not None and b.top_logprobs is not None else None
    completion = dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                                     logprobs=logprobs, top_logprobs=top)
    # A DELTA request's prompt logprobs come once: the later output's empty list must not hide them.
    return dataclasses.replace(second, outputs=[completion], prompt_logprobs=first.prompt_logprobs or
                               second.prompt_logprobs)


def aborted_before_start(request_id: str) -> RequestOutput:
    """The final output of a streaming request aborted before its first chunk: nothing was prompted or generated."""
    aborted = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                               finish_reason="abort")
    return RequestOutput(request_id, [], [aborted], finished=True)
