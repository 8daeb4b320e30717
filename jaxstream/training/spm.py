"""Trains the sentencepiece tokenizer of a small streaming model on its corpus text."""
import io

import sentencepiece


def train_sentencepiece(texts: list[str], model_path: str, vocab_size: int) -> None:
    """BPE model with byte fallback (any text encodes), spm ids unk 0 / bos 1 / eos 2 and no pad.

    `SentencePieceTokenizer` maps those onto Voxtral's control ids 0/1/2 and every piece i onto 1000 + i.
    """
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", num_threads=1, minloglevel=2,
    )
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
