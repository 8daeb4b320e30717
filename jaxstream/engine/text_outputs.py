"""The `RequestOutput`s of a text session (text_scheduler.py): a chunk's tokens, their logprobs and most likely ids,
its text, as each output kind carries them."""
from jaxstream.engine.requests import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams


def session_output(session, tokens, logprobs, tops, reason, stop_reason, *, finished, text: str = "") -> RequestOutput:
    """A `TextSession`'s output for `tokens` (already pushed to its detokenizer, which gave `text`), their logprobs and
    most likely ids (`tops`); records them in the session, which CUMULATIVE outputs repeat."""
    session.streamed += tokens
    session.streamed_logprobs += logprobs
    session.streamed_top += tops
    session.text += text
    session.cumulative_logprob += sum(logprobs)
    params = session.params
    delta = params.output_kind is RequestOutputKind.DELTA
    if delta:
        ids, lps, tops = list(tokens), list(logprobs), list(tops)
    else:
        ids, lps, tops = list(session.streamed), list(session.streamed_logprobs), list(session.streamed_top)
        text = session.text
    if session.stop_text is not None:  # the text cut at a stop string, its tail held back until the end
        text = session.stop_text.visible(finished=finished, delta=delta)
    completion = CompletionOutput(
        index=0, text=text, token_ids=ids,
        cumulative_logprob=session.cumulative_logprob if params.logprobs is not None else None,
        logprobs=lps if params.logprobs is not None else None,
        finish_reason=reason, stop_reason=stop_reason,
        top_logprobs=tops if params.logprobs is not None else None)
    prompt_logprobs = session.prompt_logprobs
    if tokens and session.collecting is not None:  # the first token: every prompt position is computed
        prompt_logprobs = session.prompt_logprobs = session.collecting
        session.collecting = None
    elif prompt_logprobs is not None and delta:
        prompt_logprobs = []  # vLLM's DELTA outputs carry them once
    return RequestOutput(session.request_id, session.chunk_prompts, [completion], finished,
                         prompt_logprobs=prompt_logprobs)


_NOT_ASKED: dict = {}  # the most likely ids of a token whose request asked for none (shared: never changed)


def top_logprobs(params: SamplingParams, fetched: dict, row: int) -> dict[int, float]:
    """The `params.logprobs` most likely ids of `row`'s sampled position and their logprobs, most likely first."""
    if not params.logprobs:
        return _NOT_ASKED
    ids, values = fetched["top_ids"][row, :params.logprobs], fetched["top_logprobs"][row, :params.logprobs]
    return dict(zip(ids.tolist(), values.tolist()))

