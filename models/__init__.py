"""Flax NNX model definitions, the audio front end, tokenizers and checkpoint loaders.

The names below are imported on first use, so that importing one light module of this package (`errors`,
say, which `jaxstream.errors` re-exports) does not load jax and flax.
"""
import importlib

# Public name -> the module of this package that defines it.
_LAZY = {
    **dict.fromkeys(("VOXTRAL_MINI_4B", "EncoderConfig", "TextConfig", "VoxtralConfig", "config_from_hf",
                     "config_from_mistral_params"), "config"),
    **dict.fromkeys(("CheckpointMismatchError", "expected_shapes", "hf_name_map", "load_hf_weights",
                     "state_from_hf"), "hf_weights"),
    **dict.fromkeys(("contiguous_page_table", "init_kv_cache", "num_parameters", "rope_angles"), "layers"),
    "TextLM": "text_lm",
    **dict.fromkeys(("ConvState", "VoxtralRealtime", "init_conv_state"), "voxtral"),
    **dict.fromkeys(("BUILTIN_MODELS", "LoadedModel", "load_model"), "loading"),
    "save_checkpoint": "orbax_writer",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
