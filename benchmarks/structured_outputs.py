"""What structured outputs cost (engine/structured_outputs.py), at a real vocabulary size.

1. Host: llguidance's bitmask of one request at each step of a JSON document and of a regex, on a byte-level BPE
   tokenizer of `--vocab` ids trained here on WordNet's and the fortune files' text (Debian's wordnet-base and
   fortunes; no download), median and 90th percentile microseconds a mask.
2. Engine: `--requests` sessions decoding `--max-tokens` tokens each, free and under a regex that never ends
   (`[a-z ]*`, EOS banned by min_tokens so both make the same tokens), alternated A B A B in one run on one random
   model; wall time per token of each and their ratio, and the share of the guided run spent computing and writing
   masks.

    python benchmarks/structured_outputs.py                   # 32k vocabulary, 16 requests of 64 tokens
    python benchmarks/structured_outputs.py --vocab 131072 --requests 64

On a CPU read the ratio and the host microseconds, not the absolute step times.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from flax import nnx

from jaxstream.engine import structured_outputs
from jaxstream.engine.builders import build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.requests import SamplingParams, StructuredOutputsParams
from jaxstream.models import TextLM
from jaxstream.models.config import TextConfig
from jaxstream.models.tokenizers import load_tokenizer
from jaxstream.synth.sentences import sentence_pools

EOS = 2
DOCUMENT = {"name": "a quick brown fox", "tags": ["lazy", "dog", "jumps"], "count": 12, "nested": {"ok": True,
            "note": "the weather is sunny and the wind is calm"}}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "count": {"type": "integer"}, "nested": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "note": {"type": "string"}}, "required": ["ok", "note"]}},
    "required": ["name", "tags", "count", "nested"]}


def train_tokenizer(vocab: int, directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [text for pool in sentence_pools().values() for text in pool]
    texts += [json.dumps(DOCUMENT), json.dumps(SCHEMA, indent=2)] * 100
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def mask_times(grammars, tokenizer, params, text: str) -> np.ndarray:
    """Microseconds of each step's mask while a matcher follows `text`'s tokens."""
    guide = grammars.guide(params)
    row = np.empty(guide.words, np.int32)
    times = []
    for token in [*tokenizer.encode(text), EOS]:
        start = time.perf_counter()
        guide.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        times.append((time.perf_counter() - start) * 1e6)
        assert (row[token // 32] >> (token % 32)) & 1, "the text leaves the grammar"
        guide.matcher.consume_token(token)
    return np.asarray(times)


def decode_run(core, grammars, args, rng, guided: bool) -> float:
    """Seconds for `--requests` sessions of `--max-tokens` tokens each."""
    regex = StructuredOutputsParams(regex="[a-z ]*")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            structured_outputs=regex if guided else None)
    start = time.perf_counter()
    for i in range(args.requests):
        prompt = rng.integers(3, args.vocab, 16).tolist()
        core.add_chunk(f"{'g' if guided else 'f'}{time.perf_counter()}-{i}", prompt, params, first=True,
                       resumable=False, sink=lambda _: None, guide=grammars.guide(regex) if guided else None)
    while core.has_work():
        core.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        train_tokenizer(args.vocab, Path(directory))
        tokenizer = load_tokenizer(directory)
        print(f"tokenizer: {tokenizer.vocab_size} ids, trained in {time.perf_counter() - start:.1f} s")
    grammars = structured_outputs.Grammars(tokenizer, args.vocab, {EOS})
    start = time.perf_counter()
    grammars.guide(StructuredOutputsParams(regex="a"))
    print(f"llguidance tokenizer and a first grammar: {time.perf_counter() - start:.2f} s")
    for name, params, text in [("json schema", StructuredOutputsParams(json=SCHEMA), json.dumps(DOCUMENT)),
                               ("regex [a-z ]*", StructuredOutputsParams(regex="[a-z ]*"), DOCUMENT["nested"]["note"])]:
        times = mask_times(grammars, tokenizer, params, text)
        print(f"mask, {name}: {len(times)} steps, median {np.median(times):.0f} us, p90 "
              f"{np.percentile(times, 90):.0f} us")

    heads = args.hidden // 64
    cfg = TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                     num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=64,
                     max_positions=512)
    engine_cfg = EngineConfig(max_sessions=args.requests, batch_buckets=(args.requests,),
                              prefill_buckets=((args.requests, 16),), max_model_len=512)
    core = build_text_core(TextLM(cfg, rngs=nnx.Rngs(0)), engine_cfg, eos_token_id=EOS)
    written = [0.0]
    write_masks = structured_outputs.write_masks

    def timed_write_masks(*a, **k):
        start = time.perf_counter()
        write_masks(*a, **k)
        written[0] += time.perf_counter() - start

    structured_outputs.write_masks = timed_write_masks
    rng = np.random.default_rng(0)
    decode_run(core, grammars, args, rng, False)  # first runs of these shapes
    decode_run(core, grammars, args, rng, True)
    seconds = {False: [], True: []}
    for guided in (False, True, False, True):
        written[0] = 0.0
        seconds[guided].append(decode_run(core, grammars, args, rng, guided))
    tokens = args.requests * args.max_tokens
    free, guided = (min(seconds[kind]) / tokens * 1e3 for kind in (False, True))
    print(f"decode, {args.requests} requests x {args.max_tokens} tokens: free {free:.3f} ms a token, guided "
          f"{guided:.3f} ms ({guided / free:.2f}x); masks in the last guided run: {written[0]:.2f} s of "
          f"{seconds[True][-1]:.2f} s")


if __name__ == "__main__":
    main()
