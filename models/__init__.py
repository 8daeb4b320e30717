"""Flax NNX model definitions, the audio front end, tokenizers and checkpoint loaders."""
from jaxstream.models.config import (
    VOXTRAL_MINI_4B, EncoderConfig, TextConfig, VoxtralConfig, config_from_hf, config_from_mistral_params,
)
from jaxstream.models.hf_weights import (
    CheckpointMismatchError, expected_shapes, hf_name_map, load_hf_weights, state_from_hf,
)
from jaxstream.models.layers import contiguous_page_table, init_kv_cache, num_parameters, rope_angles
from jaxstream.models.text_lm import TextLM
from jaxstream.models.voxtral import ConvState, VoxtralRealtime, init_conv_state
from jaxstream.models.loading import BUILTIN_MODELS, LoadedModel, load_model, save_checkpoint
