"""Models shared by engine test modules (tests/test_engine_*.py)."""
import dataclasses
import json
from pathlib import Path

from flax import nnx

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.builders import load_pretrained
from jaxstream.engine.config import EngineConfig
from jaxstream.models import TextLM, config_from_hf
from jaxstream.models.voxtral import VoxtralRealtime

FIXTURES = Path(__file__).parent / "fixtures"
BYTE_BPE = FIXTURES / "byte_bpe"  # a byte-level BPE tokenizer.json (llguidance reads it) of 320 ids
BYTE_BPE_EOS = 2


def long_window_tiny_voxtral(encoder_window: int = 512, decoder_window: int = 256):
    """The random tiny Voxtral fixture's weights with windows much longer than a test's streams, so that
    pools can hold a stream's pages but not its full windows; returns (model, tokenizer)."""
    loaded, tokenizer, _ = load_pretrained(FIXTURES / "voxtral_tiny", EngineConfig(), dtype="float32")
    cfg = dataclasses.replace(loaded.cfg,
                              encoder=dataclasses.replace(loaded.cfg.encoder, sliding_window=encoder_window),
                              text=dataclasses.replace(loaded.cfg.text, sliding_window=decoder_window))
    model = VoxtralRealtime(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    return model, tokenizer


def byte_bpe_llama(vocab_size: int = 320) -> TextLM:
    """The random-weight tiny Llama (tests/fixtures/llama_tiny's config, seed 0: every call the same weights) of
    BYTE_BPE's 320 ids, or of `vocab_size` ids for that tokenizer with ids added."""
    cfg = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    return TextLM(config_from_hf({**cfg, "vocab_size": vocab_size}), rngs=nnx.Rngs(0))


def byte_bpe_engine(config: EngineConfig, tokenizer) -> AsyncEngine:
    """An engine of `byte_bpe_llama` over `tokenizer` (BYTE_BPE's, or it with ids added: the model's vocabulary is
    the tokenizer's), stopping at BYTE_BPE_EOS."""
    return AsyncEngine(byte_bpe_llama(tokenizer.vocab_size), config=config, tokenizer=tokenizer,
                       eos_token_id=BYTE_BPE_EOS)
