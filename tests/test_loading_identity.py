"""A model saved and loaded again is, to jit caches, the model it was saved from: its configuration equals and hashes
like the original, and so does its graphdef, whose modules hold their dtypes as static attributes. `jaxstream train
--init-from` loads the model a fresh run builds, and `make_train_step` caches the compiled step by both."""
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream.models.loading import BUILTIN_MODELS, LoadedModel, load_model
from jaxstream.models.orbax_writer import save_checkpoint
from jaxstream.models.voxtral import VoxtralRealtime
from jaxstream.training import load_train_config
from jaxstream.training.step import make_train_step
from training_fixtures import TINY_TOML


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tests' training recipe, a fresh model of it (as a run without --init-from builds it) and that model
    saved as `jaxstream train` exports it."""
    root = tmp_path_factory.mktemp("identity")
    (root / "tiny.toml").write_text(TINY_TOML)
    cfg = load_train_config(root / "tiny.toml")
    fresh = VoxtralRealtime(cfg.model, rngs=nnx.Rngs(cfg.seed))
    # Any sentencepiece model: a Voxtral checkpoint must ship one, and loading does not read it.
    shutil.copyfile(BUILTIN_MODELS["tiny"] / "tokenizer.model", root / "tokenizer.model")
    directory = save_checkpoint(LoadedModel(fresh, cfg.model, root / "tokenizer.model"), root / "model")
    return cfg, fresh, directory


@pytest.mark.parametrize("dtype", [jnp.float32, "float32", np.dtype("float32")], ids=["jnp", "str", "np"])
def test_a_loaded_model_keys_the_train_step_cache_as_the_fresh_one(saved, dtype):
    cfg, fresh, directory = saved
    loaded = load_model(directory, dtype=dtype)
    assert loaded.config == cfg.model and hash(loaded.config) == hash(cfg.model)
    fresh_graphdef, _ = nnx.split(fresh, nnx.Param)
    loaded_graphdef, _ = nnx.split(loaded.model, nnx.Param)
    assert loaded_graphdef == fresh_graphdef and hash(loaded_graphdef) == hash(fresh_graphdef)
    step = make_train_step(fresh_graphdef, cfg.model, cfg.optimizer)
    assert make_train_step(loaded_graphdef, loaded.config, cfg.optimizer) is step
