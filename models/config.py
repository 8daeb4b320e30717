"""Static model configurations (frozen, hashable dataclasses passed to jit as static arguments).

Parsed from Hugging Face `config.json` (model_type voxtral_realtime, mistral, llama, qwen2, qwen3) or
Mistral-native `params.json`; `VOXTRAL_MINI_4B` is the real Voxtral-Mini-4B-Realtime-2602 configuration.
"""
import dataclasses
import math
import types
from typing import Any

from jaxstream.models.audio import DEFAULT_DELAY_MS, MEL_FRAMES_PER_SLOT, N_LEFT_PAD_TOKENS, SLOT_MS


def _check_fields(config, may_be_zero=frozenset(), any_sign=frozenset()) -> None:
    """Raises ValueError naming the first int / float field of the wrong type or sign, so that a config.json
    with `"num_hidden_layers": "2"` or `"rms_norm_eps": null` fails here in one line, not deep in the model.
    Fields in `any_sign` are only checked for their type."""
    for field in dataclasses.fields(config):
        value, kind = getattr(config, field.name), field.type
        if isinstance(kind, types.UnionType):  # `int | None`: None means "not set"
            if value is None:
                continue
            kind = next(t for t in kind.__args__ if t is not type(None))
        if kind not in (int, float):
            continue  # booleans and tuples come converted by the parsers; nested configurations check themselves
        number = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if number and field.name in any_sign:
            continue
        if not number or not math.isfinite(value) or value < 0 or (value == 0 and field.name not in may_be_zero):
            sign = "non-negative" if field.name in may_be_zero else "positive"
            expected = "integer" if kind is int else "number"
            raise ValueError(f"{type(config).__name__}.{field.name} must be a {sign} {expected}, got {value!r}")


def _default_head_dim(hidden_size, num_heads):
    """hidden_size // num_heads when both are positive integers; else 0, which fails the checks after theirs."""
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden_size, num_heads))
    return hidden_size // num_heads if valid else 0


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """A Mistral/Llama-style decoder; `ada_t_cond_dim > 0` adds Voxtral's delay-conditioned FFN norm.

    Qwen2 adds biases to the q/k/v projections (`qkv_bias`); Qwen3 normalises each head's queries and keys
    (`qk_norm`: an RMSNorm over the head dimension, before RoPE); Llama's and Qwen3's `attention_bias` puts
    biases on all four projections (`qkv_bias` and `o_bias`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    sliding_window: int | None = None  # None: full attention up to max_positions
    max_positions: int = 131072
    tie_embeddings: bool = False
    ada_t_cond_dim: int = 0
    # Llama 3 style RoPE frequency scaling, as (factor, low_freq_factor, high_freq_factor,
    # original_max_positions); None for plain RoPE.
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        _check_fields(self, may_be_zero={"ada_t_cond_dim"})

    @property
    def attention_window(self) -> int:
        """The window the KV ring must cover: the sliding window, or all positions for full attention."""
        return self.sliding_window or self.max_positions


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Voxtral's causal audio encoder (MHA, biases on q/v/o and the MLP down projection)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_mel_bins: int = 128
    sliding_window: int = 750
    rope_theta: float = 1e6
    norm_eps: float = 1e-5

    def __post_init__(self):
        _check_fields(self)


@dataclasses.dataclass(frozen=True)
class VoxtralConfig:
    encoder: EncoderConfig
    text: TextConfig
    downsample_factor: int = 4  # encoder frames stacked into one decoder slot
    mel_frames_per_token: int = MEL_FRAMES_PER_SLOT  # 80 ms of 10 ms hops
    n_left_pad_tokens: int = N_LEFT_PAD_TOKENS
    default_delay_ms: int = DEFAULT_DELAY_MS
    # (lowest, highest) delay in ms the checkpoint was trained at, when its recipe records it (our trained
    # checkpoints); other delays run but transcribe worse, so the CLI and the engine warn (models/audio_checks.py).
    trained_delays_ms: tuple[int, int] | None = None
    bos_id: int = 1
    eos_id: int = 2
    streaming_pad_id: int = 32
    streaming_word_id: int = 33

    def __post_init__(self):
        pad = self.n_left_pad_tokens
        if isinstance(pad, int) and not isinstance(pad, bool) and pad < 1:
            # With no silent slot before the audio, the offline log-mel's centred STFT reflects the first real
            # samples where the streaming front end sees zeros, and the silent-prefix cache would span -1 slots.
            raise ValueError(f"VoxtralConfig.n_left_pad_tokens must be at least 1 (Voxtral Realtime pads each "
                             f"stream with 32 silent slots), got {pad!r}")
        # eos_id -1: no end-of-text id (`jaxstream bench` runs random weights' streams to their end).
        _check_fields(self, may_be_zero={"default_delay_ms", "bos_id", "streaming_pad_id", "streaming_word_id"},
                      any_sign={"eos_id"})


ModelConfig = TextConfig | VoxtralConfig  # a checkpoint's configuration: a text LM's or a Voxtral Realtime's


VOXTRAL_MINI_4B = VoxtralConfig(
    encoder=EncoderConfig(hidden_size=1280, intermediate_size=5120, num_layers=32, num_heads=32, head_dim=64),
    text=TextConfig(
        vocab_size=131072, hidden_size=3072, intermediate_size=9216, num_layers=26, num_heads=32,
        num_kv_heads=8, head_dim=128, sliding_window=8192, tie_embeddings=True, ada_t_cond_dim=32,
    ),
)


TEXT_MODEL_TYPES = ("mistral", "llama", "qwen2", "qwen3")  # Hugging Face model types TextLM serves


def _rope_theta(cfg: dict[str, Any], default: float) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", default)))


def _llama3_scaling(cfg: dict[str, Any]) -> tuple[float, float, float, int] | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    return (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]))


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The one attention window of every layer (None: full attention). Qwen2 / Qwen3 configs name each layer's
    kind (`layer_types`, or `use_sliding_window` for the layers from `max_window_layers` on, and a
    `sliding_window` that applies only then); one kind for some layers and another for the rest is refused."""
    if cfg.get("model_type") not in ("qwen2", "qwen3"):
        return cfg.get("sliding_window")
    layers = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is None and isinstance(layers, int):
        sliding_from = cfg.get("max_window_layers", layers) if cfg.get("use_sliding_window") else layers
        kinds = ["sliding_attention" if i >= sliding_from else "full_attention" for i in range(layers)]
    kinds = set(kinds or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(kinds)}; supported: full_attention, sliding_attention")
    if len(kinds) > 1:
        raise ValueError("config.json gives some layers a sliding window and others full attention, which "
                         "jaxstream's decoder (one window for every layer) does not support")
    return cfg.get("sliding_window") if kinds == {"sliding_attention"} else None


def text_config_from_hf(cfg: dict[str, Any], *, ada_t_cond_dim: int = 0) -> TextConfig:
    model_type = cfg.get("model_type")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json sets mlp_bias=true, which jaxstream's decoder does not support")
    # Mistral's projections never carry biases (transformers ignores the key); Llama's and Qwen3's carry them
    # when it is set, and Qwen2's q/k/v always do.
    attention_bias = bool(cfg.get("attention_bias")) and model_type in ("llama", "qwen3")
    if cfg.get("attention_bias") and not attention_bias:
        raise ValueError(f"config.json sets attention_bias=true, which a {model_type} decoder does not use")
    num_heads = cfg["num_attention_heads"]
    return TextConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or _default_head_dim(cfg["hidden_size"], num_heads),
        rope_theta=_rope_theta(cfg, 10000.0),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        sliding_window=_sliding_window(cfg),
        max_positions=cfg.get("max_position_embeddings", 131072),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        ada_t_cond_dim=ada_t_cond_dim,
        rope_llama3_scaling=_llama3_scaling(cfg),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias,
        qk_norm=model_type == "qwen3",
    )


def config_from_hf(cfg: dict[str, Any]) -> TextConfig | VoxtralConfig:
    """Parses a Hugging Face `config.json` dict (voxtral_realtime, mistral, llama, qwen2 or qwen3)."""
    model_type = cfg.get("model_type")
    if model_type in TEXT_MODEL_TYPES:
        return text_config_from_hf(cfg)
    if model_type != "voxtral_realtime":
        raise ValueError(f"unsupported model_type {model_type!r}; supported: voxtral_realtime, "
                         f"{', '.join(TEXT_MODEL_TYPES)}")
    audio, text = cfg["audio_config"], cfg["text_config"]
    encoder = EncoderConfig(
        hidden_size=audio["hidden_size"],
        intermediate_size=audio["intermediate_size"],
        num_layers=audio["num_hidden_layers"],
        num_heads=audio["num_attention_heads"],
        head_dim=audio.get("head_dim") or _default_head_dim(audio["hidden_size"], audio["num_attention_heads"]),
        num_mel_bins=audio.get("num_mel_bins", 128),
        sliding_window=audio.get("sliding_window") or 750,
        # The encoder config class defaults to 1e4 but the real model uses 1e6 (spec pitfall 1).
        rope_theta=_rope_theta(audio, 1e6),
        norm_eps=audio.get("rms_norm_eps", 1e-5),
    )
    text_cfg = text_config_from_hf({**text, "tie_word_embeddings": text.get(
        "tie_word_embeddings", cfg.get("tie_word_embeddings", True))}, ada_t_cond_dim=32)
    default_delay_tokens = cfg.get("default_num_delay_tokens", DEFAULT_DELAY_MS // SLOT_MS)
    return VoxtralConfig(
        encoder=encoder,
        text=text_cfg,
        downsample_factor=cfg.get("downsample_factor", 4),
        mel_frames_per_token=cfg.get("audio_length_per_tok", MEL_FRAMES_PER_SLOT),
        default_delay_ms=SLOT_MS * default_delay_tokens,
    )


def config_from_mistral_params(params: dict[str, Any]) -> TextConfig | VoxtralConfig:
    """Parses a Mistral-native `params.json` dict (a Voxtral Realtime model or a plain text model)."""
    text = TextConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["dim"],
        intermediate_size=params["hidden_dim"],
        num_layers=params["n_layers"],
        num_heads=params["n_heads"],
        num_kv_heads=params.get("n_kv_heads") or params["n_heads"],
        head_dim=params.get("head_dim") or _default_head_dim(params["dim"], params["n_heads"]),
        rope_theta=float(params.get("rope_theta", 1e6)),
        norm_eps=params.get("norm_eps", 1e-5),
        sliding_window=params.get("sliding_window"),
        max_positions=params.get("model_max_length", 131072),
        tie_embeddings=bool(params.get("tied_embeddings", False)),
        ada_t_cond_dim=params.get("ada_rms_norm_t_cond_dim", 32) if params.get("ada_rms_norm_t_cond") else 0,
    )
    whisper = (params.get("multimodal") or {}).get("whisper_model_args")
    if whisper is None:
        return text
    enc = whisper["encoder_args"]
    encoder = EncoderConfig(
        hidden_size=enc["dim"],
        intermediate_size=enc["hidden_dim"],
        num_layers=enc["n_layers"],
        num_heads=enc["n_heads"],
        head_dim=enc.get("head_dim") or _default_head_dim(enc["dim"], enc["n_heads"]),
        num_mel_bins=enc["audio_encoding_args"]["num_mel_bins"],
        sliding_window=enc.get("sliding_window") or 750,
        rope_theta=float(enc.get("rope_theta", 1e6)),
        norm_eps=enc.get("norm_eps", 1e-5),
    )
    downsample = whisper.get("downsample_args", {}).get("downsample_factor", 4)
    return VoxtralConfig(encoder=encoder, text=text, downsample_factor=downsample)
