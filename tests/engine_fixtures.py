"""Models shared by engine test modules (tests/test_engine_*.py)."""
import dataclasses
from pathlib import Path

from flax import nnx

from jaxstream.engine.builders import load_pretrained
from jaxstream.engine.config import EngineConfig
from jaxstream.models.voxtral import VoxtralRealtime

FIXTURES = Path(__file__).parent / "fixtures"


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
