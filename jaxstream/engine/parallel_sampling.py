"""vLLM's parallel sampling: `generate` with `SamplingParams(n > 1)` runs n child requests of the one prompt and
yields their outputs as the parent's, each `CompletionOutput` with its `index`.

Child i is the request `{i}_{request_id}` with the parent's params but n = 1 and, when the parent is seeded, seed + i
(vLLM's ParentRequest), so a seeded request gives the same n completions whatever runs beside it. As vLLM's, an
output of a DELTA or CUMULATIVE request carries the one child that moved, and the parent is `finished` with the last
child's last output; a FINAL_ONLY request gets one output holding all n, in index order. Aborting the parent's id
aborts every child; the first child's error ends the parent (the others are aborted). Streaming input takes n = 1
only, as vLLM's.

The children share one prompt, and so its prompt logprobs (`SamplingParams.prompt_logprobs`): child 0 alone computes
them (the others may take the prompt's KV from the prefix cache), and the parent's first output carries them (the
others' outputs wait for child 0's first), as a request's first output does.
"""
import asyncio
import dataclasses

from jaxstream.engine.requests import RequestOutput, RequestOutputKind, SamplingParams

_SEED_SPAN = 2**64  # a child seed past the 64-bit range wraps into it (the engine keeps 32 bits of any seed)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= _SEED_SPAN:
            seed -= _SEED_SPAN
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def child_ids(request_id: str, n: int) -> list[str]:
    return [f"{index}_{request_id}" for index in range(n)]


async def generate_n(generate, prompt_ids: list[int], params: SamplingParams, request_id: str):
    """The parent's outputs from `generate(prompt, params, request_id=...)` (the engine's one-request generate) run
    for each child at once."""
    outputs: asyncio.Queue = asyncio.Queue()

    async def child(index: int, child_id: str) -> None:
        try:
            async for out in generate(prompt_ids, child_params(params, index), request_id=child_id):
                outputs.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - the parent raises it
            outputs.put_nowait((index, exc))
        outputs.put_nowait((index, None))

    tasks = [asyncio.create_task(child(index, child_id))
             for index, child_id in enumerate(child_ids(request_id, params.n))]
    final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
    finals, finished, running = {}, 0, params.n
    # With prompt logprobs: child 0's, and the other children's outputs held until child 0's first came (streamed).
    prompt_logprobs, held, shown = None, [] if params.prompt_logprobs is not None and not final_only else None, False
    try:
        while running:
            index, out = await outputs.get()
            if isinstance(out, Exception):
                raise out
            ready = [(index, out)]
            if held is not None:
                if index != 0:
                    held.append((index, out))
                    continue
                ready, held = ready + held, None  # child 0's first output (or its end) comes first
            for index, out in ready:
                if out is None:
                    running -= 1
                    continue
                if index == 0 and out.prompt_logprobs:
                    prompt_logprobs = out.prompt_logprobs
                completions = [dataclasses.replace(completion, index=index) for completion in out.outputs]
                finished += out.finished
                if final_only:
                    finals[index] = completions
                    if finished == params.n:
                        yield RequestOutput(request_id, out.prompt_token_ids,
                                            [c for i in sorted(finals) for c in finals[i]], True, out.prompt,
                                            prompt_logprobs)
                    continue
                carried = prompt_logprobs
                if params.output_kind is RequestOutputKind.DELTA and prompt_logprobs is not None:
                    carried, shown = [] if shown else prompt_logprobs, True
                yield RequestOutput(request_id, out.prompt_token_ids, completions, finished == params.n, out.prompt,
                                    carried)
    finally:
        for task in tasks:
            task.cancel()  # a child still running (the consumer stopped, or another child failed) is aborted
        await asyncio.gather(*tasks, return_exceptions=True)
