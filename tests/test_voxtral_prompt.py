"""The Voxtral transcription prompt: the ids the engine builds equal mistral-common's streaming prefix (BOS +
[STREAMING_PAD] x (32 left-pad + n_delay)) committed in the tiny fixture, and the fixture can tell a wrong
prompt apart. Its decoder window (96) covers every position of its streams (S = 91 and 87), so BOS at
position 0 reaches every generated token: a prompt with [STREAMING_PAD] in place of BOS changes the logits
of every generated position and the 480 ms greedy tokens (tests/test_engine_transcription.py holds the
engine's tokens to transformers')."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.engine.transcription_session import transcription_prompt
from jaxstream.models.audio import prompt_length
from jaxstream.models.checkpoint_metadata import inspect_checkpoint
from jaxstream.models.loading import load_model
from jaxstream.models.tokenizers import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
MODEL_DIR = FIXTURES / "voxtral_tiny"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))


@pytest.fixture(scope="module")
def model_cfg():
    """The configuration `AsyncEngine.from_pretrained` gives the engine for the fixture directory."""
    return inspect_checkpoint(MODEL_DIR).config


def delays(reference):
    return [int(d) for d in reference["delays"]]


def test_engine_prompt_equals_the_committed_prompt_ids(reference, model_cfg):
    tokenizer = load_tokenizer(MODEL_DIR / "tekken.json")
    assert (model_cfg.bos_id, model_cfg.streaming_pad_id) == (tokenizer.bos_id, tokenizer.streaming_pad_id)
    for n_delay in delays(reference):
        committed = reference[f"prompt_ids_d{n_delay}"][0].tolist()  # mistral-common start() + streaming tokens
        prompt = transcription_prompt(model_cfg, n_delay)
        assert prompt == committed, (n_delay, prompt, committed)
        assert len(prompt) == prompt_length(n_delay) == 33 + n_delay
        assert reference[f"generate_d{n_delay}"][0, : len(prompt)].tolist() == committed


def test_fixture_decoder_window_reaches_the_whole_prompt(reference, model_cfg):
    """Every generated position attends to BOS (kv > q - window), so the fixture's logits depend on it."""
    for n_delay in delays(reference):
        num_positions = reference[f"generate_d{n_delay}"].shape[1]
        assert model_cfg.text.attention_window >= num_positions, (model_cfg.text.attention_window, num_positions)

    loaded = load_model(MODEL_DIR, dtype="float32")
    mel = reference["features_d6"][0].T[None]
    ids = reference["input_ids_d6"].astype(np.int32)
    wrong_bos = ids.copy()
    wrong_bos[0, 0] = model_cfg.streaming_pad_id
    offline = jax.jit(lambda m, i: loaded.model.offline_logits(m, i, jnp.full((2,), 6.0)))
    logits = np.asarray(offline(jnp.asarray(np.concatenate([mel, mel])), jnp.asarray(np.concatenate([ids, wrong_bos]))))
    np.testing.assert_allclose(logits[0], reference["logits_d6"][0], atol=1e-4)
    prompt_len = prompt_length(6)
    # The last prompt position (whose logits give the first token) through the last one.
    change = np.abs(logits[1, prompt_len - 1 :] - logits[0, prompt_len - 1 :]).max(axis=-1)
    assert change.min() > 1e-3, change
