"""Training recipes as TOML (`configs/tiny.toml`): model shape, tokenizer size, optimizer, schedule."""
import dataclasses
import tomllib
from pathlib import Path

from jaxstream.models.audio import n_delay_from_ms
from jaxstream.models.config import EncoderConfig, TextConfig, VoxtralConfig
from jaxstream.models.tokenizers import NUM_CONTROL_IDS
from jaxstream.training.spm import MODEL_TYPES
from jaxstream.training.step import OptimizerConfig
from jaxstream.training.vtlp import ALPHA_LIMITS

CTC_TARGETS = ("characters", "phonemes")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: VoxtralConfig
    optimizer: OptimizerConfig
    spm_vocab_size: int = 1536  # an upper bound: the decoder vocabulary is sized from the trained tokenizer
    spm_model_type: str = "bpe"
    batch_size: int = 16
    delays_ms: tuple[int, ...] = (160, 240, 320, 400, 480, 560, 640, 720, 800, 880, 960)
    eval_every: int = 250
    eval_utterances: int = 64
    eval_delay_ms: int = 480
    checkpoint_every: int = 100
    seed: int = 0
    # Start whole-word embedding rows from their spelling (`jaxstream/training/spelling.py`).
    spelling_init: bool = False
    # (low, high): warp each training utterance's frequency axis by a factor drawn from this range
    # (`jaxstream/training/vtlp.py`); empty for no warping.
    vtlp_range: tuple[float, ...] = ()
    # What the auxiliary CTC (`[optimizer] ctc_weight`) predicts: the transcript's "characters", or the
    # "phonemes" espeak-ng spoke in each utterance's accent (`jaxstream/training/phonemes.py`).
    ctc_targets: str = "characters"
    # A share of the batches whose rows are several utterances back to back, up to long_stream_seconds of audio,
    # from step long_streams_from_step on (`jaxstream/training/data.py`, `LongStreams`); 0 for none.
    long_stream_fraction: float = 0.0
    long_stream_seconds: float = 24.0
    long_streams_from_step: int = 0


def load_train_config(path: str | Path) -> TrainConfig:
    """Parses a recipe; the decoder vocabulary is the 1000 control ids + the sentencepiece pieces."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    model, train = raw.get("model", {}), raw.get("train", {})
    tokenizer = raw.get("tokenizer", {})
    spm_vocab_size = int(tokenizer.get("vocab_size", 1536))
    encoder = EncoderConfig(**model.get("encoder", {}))
    text = TextConfig(vocab_size=NUM_CONTROL_IDS + spm_vocab_size, tie_embeddings=True, ada_t_cond_dim=32,
                      **model.get("text", {}))
    optimizer = OptimizerConfig(**raw.get("optimizer", {}))
    train = {key: tuple(value) if isinstance(value, list) else value for key, value in train.items()}
    delays = train.get("delays_ms", TrainConfig.delays_ms)
    # Checked here, not when the first batch or evaluation needs them (after the tokenizer, or 1000 steps, in).
    if not isinstance(delays, tuple) or not delays:
        raise ValueError(f"[train] delays_ms must be a non-empty list of delays, got {delays!r}")
    eval_delay = train.get("eval_delay_ms", TrainConfig.eval_delay_ms)
    for key, values in (("delays_ms", delays), ("eval_delay_ms", (eval_delay,))):
        for delay_ms in values:
            try:
                n_delay_from_ms(delay_ms)
            except ValueError as exc:
                raise ValueError(f"[train] {key}: {exc}") from None
    seed = train.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"[train] seed must be an integer >= 0, got {seed!r}")
    voxtral = VoxtralConfig(encoder=encoder, text=text, default_delay_ms=int(model.get("default_delay_ms", 480)),
                            trained_delays_ms=(min(delays), max(delays)))
    model_type = str(tokenizer.get("model_type", "bpe"))
    if model_type not in MODEL_TYPES:
        raise ValueError(f"[tokenizer] model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    vtlp_range = train.get("vtlp_range", ())
    lowest, highest = ALPHA_LIMITS
    if vtlp_range and not (len(vtlp_range) == 2 and lowest <= vtlp_range[0] <= vtlp_range[1] <= highest):
        raise ValueError(f"[train] vtlp_range must be [low, high] with {lowest} <= low <= high <= {highest}, "
                         f"got {list(vtlp_range)}")
    if train.get("ctc_targets", "characters") not in CTC_TARGETS:
        raise ValueError(f"[train] ctc_targets must be one of {CTC_TARGETS}, got {train['ctc_targets']!r}")
    fraction = train.get("long_stream_fraction", 0.0)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"[train] long_stream_fraction must be a share between 0 and 1, got {fraction!r}")
    if fraction and train.get("ctc_targets", "characters") != "characters":
        raise ValueError("[train] long_stream_fraction needs ctc_targets = \"characters\"")
    if train.get("long_stream_seconds", TrainConfig.long_stream_seconds) <= 0:
        raise ValueError(f"[train] long_stream_seconds must be > 0, got {train['long_stream_seconds']!r}")
    from_step = train.get("long_streams_from_step", 0)
    if isinstance(from_step, bool) or not isinstance(from_step, int) or from_step < 0:
        raise ValueError(f"[train] long_streams_from_step must be an integer >= 0, got {from_step!r}")
    return TrainConfig(model=voxtral, optimizer=optimizer, spm_vocab_size=spm_vocab_size, spm_model_type=model_type,
                       **train)


def with_vocab_size(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """The recipe with the decoder vocabulary set to the trained tokenizer's (control ids included)."""
    text = dataclasses.replace(cfg.model.text, vocab_size=vocab_size)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, text=text))


def with_total_steps(cfg: TrainConfig, total_steps: int) -> TrainConfig:
    """The recipe run for `total_steps` instead. Warmup and cooldown keep their lengths in steps: the phase
    between them absorbs the change (the peak lr held for longer or shorter, or without a cooldown the cosine
    decay after warmup stretched or shrunk), so a run moved while it still holds the peak lr has followed the
    new schedule all along. ValueError when a cooldown no longer fits after the warmup (`total_steps` <
    warmup_steps + cooldown_steps)."""
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, total_steps=total_steps))
