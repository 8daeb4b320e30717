"""Trains the sentencepiece tokenizer of a small streaming model on its corpus text."""
import io

import sentencepiece

MODEL_TYPES = ("bpe", "unigram", "word")


def train_sentencepiece(texts: list[str], model_path: str, vocab_size: int, model_type: str = "bpe") -> None:
    """A sentencepiece model with byte fallback (any text encodes), spm ids unk 0 / bos 1 / eos 2 and no pad.

    `vocab_size` is an upper bound: a "word" model over a closed word list keeps one piece per word (+ the
    256 byte pieces), a BPE model stops merging once every word is whole. `SentencePieceTokenizer` maps the
    spm controls onto Voxtral's control ids 0/1/2 and every piece i onto 1000 + i.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"tokenizer model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        hard_vocab_limit=False, character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, normalization_rule_name="identity", num_threads=1, minloglevel=2,
    )
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
