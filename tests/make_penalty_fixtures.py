"""Generate the transformers reference tests/test_engine_penalties.py reads: what vLLM's repetition_penalty,
logit_bias and min_p do, as transformers' own processors do it.

Run by hand from the repository root (CI never runs it; it reads the committed file):

    pip install torch==2.13.0 transformers
    python tests/make_penalty_fixtures.py

It reads the committed tiny models (tests/fixtures/mistral_tiny, llama_tiny; make_reference_fixtures.py) and writes
tests/fixtures/penalties_reference.npz, float32, CPU, eager attention:

for each model M in (mistral_tiny, llama_tiny):
    M_prompt          (6,)       random ids in [3, 256)
    M_plain           (24,)      greedy generate(prompt, max_new_tokens=24), EOS stopping off: the new tokens
    M_repetition      (24,)      the same with repetition_penalty=1.3 (RepetitionPenaltyLogitsProcessor: the logits
                                 of every id in prompt + output divided by 1.3 when positive, multiplied when not,
                                 vLLM's formula)
    M_bias_ids        (3,)       token ids: plain's first and third new tokens, and one the model does not pick
    M_bias_values     (3,)       their biases: -100, -3.5 and +2.5
    M_bias            (24,)      greedy generate with sequence_bias {(id,): bias} (SequenceBiasLogitsProcessor over
                                 single tokens: vLLM's logit_bias)
minp_logits           (3, 256)   random logits (std 3)
minp_values           (4,)       min_p values
minp_kept             (4, 3, 256)  the ids MinPLogitsWarper(min_p) keeps (finite scores) of each row
versions              ()         JSON string of the library versions

Every greedy path is checked to have a top-1/top-2 margin of at least 1e-3 on the processed scores, so f32
re-implementations reproduce the argmax tokens exactly.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, MinPLogitsWarper

FIXTURES = Path(__file__).parent / "fixtures"
NEW_TOKENS = 24
MIN_GREEDY_MARGIN = 1e-3


def greedy(model, prompt: torch.Tensor, **kwargs) -> tuple[list[int], float]:
    """The new tokens of greedy generate, and the smallest top-1/top-2 margin of the scores they came from."""
    out = model.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **kwargs)
    scores = torch.cat(out.scores, dim=0).numpy()
    top2 = np.sort(scores, axis=-1)[:, -2:]
    return out.sequences[0, prompt.shape[1]:].tolist(), float((top2[:, 1] - top2[:, 0]).min())


def model_cases(name: str, seed: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompt = torch.from_numpy(np.random.default_rng(seed).integers(3, 256, (1, 6)))
    with torch.no_grad():
        plain, margin_plain = greedy(model, prompt)
        repetition, margin_rep = greedy(model, prompt, repetition_penalty=1.3)
        unpicked = next(t for t in range(3, 256) if t not in plain and t not in prompt[0].tolist())
        bias = {(plain[0],): -100.0, (plain[2],): -3.5, (unpicked,): 2.5}
        biased, margin_bias = greedy(model, prompt, sequence_bias=bias)
    for what, tokens, margin in (("repetition", repetition, margin_rep), ("bias", biased, margin_bias),
                                 ("plain", plain, margin_plain)):
        if margin < MIN_GREEDY_MARGIN:
            raise SystemExit(f"{name} {what}: greedy margin {margin:.2e} < {MIN_GREEDY_MARGIN}; pick another seed")
        print(f"{name} {what}: margin {margin:.2e}, {tokens}")
    assert repetition != plain and biased != plain, "the processors must change the greedy tokens"
    return {f"{name}_prompt": prompt[0].numpy().astype(np.int32), f"{name}_plain": np.array(plain, np.int32),
            f"{name}_repetition": np.array(repetition, np.int32),
            f"{name}_bias_ids": np.array([ids[0] for ids in bias], np.int32),
            f"{name}_bias_values": np.array(list(bias.values()), np.float32),
            f"{name}_bias": np.array(biased, np.int32)}


def min_p_cases() -> dict:
    logits = (np.random.default_rng(7).standard_normal((3, 256)) * 3).astype(np.float32)
    values = np.array([0.01, 0.1, 0.5, 1.0], np.float32)
    kept = [np.isfinite(MinPLogitsWarper(float(min_p))(None, torch.from_numpy(logits.copy())).numpy())
            for min_p in values]
    return {"minp_logits": logits, "minp_values": values, "minp_kept": np.stack(kept)}


def main() -> None:
    torch.set_num_threads(1)
    arrays = {**model_cases("mistral_tiny", seed=31), **model_cases("llama_tiny", seed=32), **min_p_cases()}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
                "python": sys.version.split()[0]}
    arrays["versions"] = np.array(json.dumps(versions, sort_keys=True))
    path = FIXTURES / "penalties_reference.npz"
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
