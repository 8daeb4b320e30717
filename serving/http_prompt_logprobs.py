"""The HTTP shapes of a prompt's logprobs (the engine's `RequestOutput.prompt_logprobs`), as vLLM's OpenAI server gives
them: vLLM's `prompt_logprobs` response field, and the echoed prompt's part of OpenAI's legacy completion `logprobs`
(`echo` with `logprobs`)."""


def finite_logprob(logprob: float) -> float:
    """-inf (a token the filters ruled out) as the finite floor OpenAI and vLLM send: JSON has no infinity."""
    return max(logprob, -9999.0)


def prompt_logprobs_field(prompt_logprobs) -> list | None:
    """vLLM's `prompt_logprobs` field: None for the first prompt token, then for each later one {token id: {logprob,
    rank, decoded_token}} (the token and the most likely ids at its position); None when the engine gave none."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else {
        token_id: {"logprob": finite_logprob(entry.logprob), "rank": entry.rank, "decoded_token": entry.decoded_token}
        for token_id, entry in entries.items()} for entries in prompt_logprobs]


def echoed_logprobs(prompt_ids: list[int], prompt_logprobs, token_string) -> tuple[dict, int]:
    """The legacy `logprobs` of an echoed prompt, and the `text_offset` after it (where the completion's start), as
    vLLM's `_create_completion_logprobs` makes them: each prompt token's string (`token_string`) and logprob, the
    ids at its position with theirs (the token first), null for the first token (it has none), and where each token's
    text starts, counting the token strings from 0."""
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for index, token_id in enumerate(prompt_ids):
        entries = prompt_logprobs[index] if prompt_logprobs else None
        token = token_string(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        token_logprobs.append(None if entries is None else finite_logprob(entries[token_id].logprob))
        top_logprobs.append(None if entries is None else {
            token_string(top_id): finite_logprob(entry.logprob) for top_id, entry in entries.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, offset


def joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy `logprobs` bodies of consecutive tokens as one (either may be None)."""
    if first is None or second is None:
        return first or second
    return {name: first[name] + second[name] for name in first}
