"""Training of small streaming speech models (the embedded tiny model's recipe): delayed-streams targets,
a sentencepiece tokenizer, an optax train step through the model's own streaming code path, Orbax
checkpoints with resume and a held-out WER hook."""
from jaxstream.training.config import TrainConfig, load_train_config
from jaxstream.training.decode import transcribe_batch, transcribe_corpus, word_error_rate
from jaxstream.training.loop import evaluate, train
from jaxstream.training.targets import StreamTokens, loss_mask, num_stream_slots, stream_tokens, word_end_slot

__all__ = [
    "StreamTokens", "TrainConfig", "evaluate", "load_train_config", "loss_mask", "num_stream_slots",
    "stream_tokens", "train", "transcribe_batch", "transcribe_corpus", "word_end_slot", "word_error_rate",
]
