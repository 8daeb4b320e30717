"""Writes tests/fixtures/byte_bpe: a byte-level BPE tokenizer.json (GPT-2's alphabet, as Llama 3's and Qwen's) of
320 ids, <unk> <s> </s> first, trained on JSON objects and English words, and its tokenizer_config.json. Text LMs of
that vocabulary (random weights) test structured outputs, whose grammar engine reads the tokenizer.json itself.

    python tests/make_byte_bpe_fixture.py
"""
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DIRECTORY = Path(__file__).parent / "fixtures" / "byte_bpe"
VOCAB_SIZE = 320
WORDS = ("the quick brown fox jumps over a lazy dog name age city true false null yes no red green blue alice bob "
         "carol positive negative neutral hello world goodbye weather sunny rainy").split()


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(2000):
        value = lambda: rng.choice([rng.choice(WORDS), rng.randint(0, 999), rng.random() < 0.5, None])  # noqa: E731
        obj = {rng.choice(WORDS): value() for _ in range(rng.randint(1, 4))}
        texts += [json.dumps(obj), json.dumps(obj, indent=2), " ".join(rng.choice(WORDS) for _ in range(8)) + "."]
    return texts


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(DIRECTORY / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (DIRECTORY / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
