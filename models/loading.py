"""One entry point to load a model: `load_model(source)` for the CLI, the engine and the notebook.

`source` is one of
- a built-in name (`BUILTIN_MODELS`: name -> packaged checkpoint directory),
- a local directory holding a Mistral-native, Hugging Face or jaxstream Orbax checkpoint (the formats and what
  they declare beside their weights: checkpoint_metadata.py),
- a Hugging Face repo id `org/name`, downloaded with `huggingface_hub.snapshot_download` (a clear
  one-line `UserError` when offline or not found).

Safetensors checkpoints are streamed: the model is built abstractly (`nnx.eval_shape`, no allocation),
then each tensor is read on its own (`safe_open`), re-laid out, cast to the parameter dtype and placed on
its device before the next one is read, so host memory holds the placed parameters plus a few tensors,
never a second copy of the checkpoint. Orbax checkpoints are restored straight into the requested dtype
and shardings (orbax_reader.py). With `quantization="int8"` each weight is quantized on its device as it is
placed (models/quantization.py); an Orbax checkpoint is then restored a group of tensors at a time, so neither path
holds more of the float model than the tensors in flight.
"""
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxstream.models.checkpoint_metadata import (
    HF_WEIGHT_FILES, NATIVE_WEIGHT_FILES, ORBAX_STATE_DIR, CheckpointInfo, declared_token_ids, first_line,
    inspect_checkpoint, stored_tensors,
)
from jaxstream.models.config import ModelConfig, VoxtralConfig
from jaxstream.models.errors import UserError
from jaxstream.models.hf_weights import CheckpointMismatchError, check_tensor_names, hf_name_map, ignorable_names
from jaxstream.models.native_weights import (
    check_native_tensors, interleaved_to_half_split, native_to_hf_name, rope_permutation_heads,
)
from jaxstream.models.orbax_reader import restore_state
from jaxstream.models.quantization import check_method, int8_weights, quantize_structure, quantize_weight
from jaxstream.models.text_lm import TextLM
from jaxstream.models.tokenizers import HFTokenizer, Tokenizer, load_tokenizer
from jaxstream.models.voxtral import VoxtralRealtime

# Built-in model name -> packaged checkpoint directory (any of the formats above).
BUILTIN_MODELS: dict[str, Path] = {"tiny": Path(__file__).parent / "assets" / "tiny"}
DEFAULT_MODEL = "tiny"  # the embedded model every command uses without --model

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_METADATA_FILES = ["*.json", "tokenizer.model"]

Model = TextLM | VoxtralRealtime
# A sharding for every parameter, or a rule (NNX state path, shape) -> sharding.
ShardingSpec = jax.sharding.Sharding | Callable[[tuple, tuple[int, ...]], jax.sharding.Sharding]


class LoadedModel(NamedTuple):
    """What `load_model` returns; unpacks as `model, config, tokenizer_path = load_model(...)`."""

    model: Model  # the NNX module; the engine takes `nnx.split(model)`
    config: ModelConfig
    tokenizer_path: Path | None  # next to the weights (`inspect_checkpoint`); None: a text model without one


def default_dtype() -> jnp.dtype:
    """bfloat16 on accelerators, float32 on CPU (design.md numerics)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def load_model(source: str | os.PathLike, *, dtype=None, param_dtype=None, sharding: ShardingSpec | None = None,
               progress: bool | None = None, quantization: str | None = None) -> LoadedModel:
    """Loads a model from a built-in name, a local directory or a Hugging Face repo id (module docstring).

    dtype: the computation dtype (default: `default_dtype()`); param_dtype: the stored parameter dtype
    (default: `dtype`), every tensor is cast to it as it is read. sharding: where the parameters go
    (default: the first device), e.g. `NamedSharding(mesh, PartitionSpec())` to replicate over a mesh, or
    a callable `(path, shape) -> Sharding` for per-parameter layouts (an int8 weight's scale is asked for at
    its own path). progress: a tqdm bar (default: when stderr is a terminal). quantization: "int8" quantizes
    the weights as they are read (models/quantization.py; ValueError for another value), each from its
    `param_dtype` value. Raises `UserError` (one line) for anything wrong with `source`.
    """
    check_method(quantization)
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()
    param_dtype = jnp.dtype(param_dtype) if param_dtype is not None else dtype
    info = inspect_checkpoint(resolve_model_dir(source))
    model = abstract_model(info.config, dtype, param_dtype, quantization)
    int8 = int8_weights(model)
    graphdef, abstract = nnx.split(model)
    shardings = _leaf_shardings(abstract, sharding)
    if info.kind == "orbax":
        params = _restore_orbax(info.directory, abstract, param_dtype, shardings, int8)
    else:
        params = _stream_safetensors(info, param_dtype, shardings, int8, progress)
    nnx.replace_by_pure_dict(abstract, params)
    return LoadedModel(nnx.merge(graphdef, abstract), info.config, info.tokenizer_path)


def load_checkpoint_tokenizer(directory: Path, tokenizer_path: Path | None) -> Tokenizer | None:
    """The tokenizer `load_model` found (`LoadedModel.tokenizer_path`) in checkpoint `directory`. A
    tokenizer.json takes BOS / EOS from the checkpoint's configuration (`declared_token_ids`) where it
    declares them, else from its own tokenizer_config.json. A file that cannot be read raises a one-line
    `UserError` naming it (`TokenizerFileError`)."""
    if tokenizer_path is None:
        return None
    if tokenizer_path.name != "tokenizer.json":
        return load_tokenizer(tokenizer_path)
    bos_id, eos_ids = declared_token_ids(directory)
    return HFTokenizer(tokenizer_path, bos_id=bos_id, eos_id=eos_ids[0] if eos_ids else None)


# ----------------------------------------------------------------------------------------- resolving


def resolve_model_dir(source: str | os.PathLike) -> Path:
    """The local directory of `source`: a built-in name, an existing directory, or a downloaded hub repo."""
    name = os.fspath(source)
    if name in BUILTIN_MODELS:
        return Path(BUILTIN_MODELS[name])
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model {name!r} is a file; expected a checkpoint directory")
        return path
    if _HUB_ID.fullmatch(name):
        return _download(name)
    builtins = ", ".join(sorted(BUILTIN_MODELS)) or "none"
    raise UserError(f"model {name!r} not found: not a built-in name ({builtins}), a local directory or a "
                    "Hugging Face repo id (org/name)")


def _download(repo_id: str) -> Path:
    """Metadata first, then only the weights of the format the repo offers (native preferred), so a repo
    that ships both formats is not downloaded twice. A repo with params.json but Hugging Face weights only
    (fine-tunes saved with transformers beside the base model's params.json) gets those."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        directory = Path(snapshot_download(repo_id, allow_patterns=_HUB_METADATA_FILES))
        if (directory / "params.json").is_file():
            directory = Path(snapshot_download(repo_id, allow_patterns=_HUB_METADATA_FILES + [NATIVE_WEIGHT_FILES]))
            if any(directory.glob(NATIVE_WEIGHT_FILES)):
                return directory
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_METADATA_FILES + [HF_WEIGHT_FILES]))
    except GatedRepoError:
        raise UserError(f"Hugging Face repo {repo_id!r} is gated: accept its terms on huggingface.co and log in "
                        "with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise UserError(f"model {repo_id!r} is not a local directory and not a Hugging Face repo (or it is "
                        "private: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        why = "offline mode (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise UserError(f"model {repo_id!r} is not a local directory and cannot be downloaded from the Hugging "
                        f"Face Hub: {why} and it is not in the local cache") from None
    except OSError as exc:  # network and HTTP errors of huggingface_hub derive from OSError
        raise UserError(f"downloading {repo_id!r} from the Hugging Face Hub failed: {first_line(exc)}") from None


# ---------------------------------------------------------------------------------- safetensors path


class _Source(NamedTuple):
    file: Path
    name: str  # the tensor's name in the file
    rope_heads: int | None  # un-interleave q/k rows of this many heads (native checkpoints)


# transformers' load-time names (the module tree) -> the legacy names `save_pretrained` writes (spec §5.3).
_VOXTRAL_MODERN_PREFIXES = (
    ("model.language_model.", "language_model.model."), ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def _hf_legacy_name(name: str, config: ModelConfig) -> str:
    """Modern transformers names of Voxtral -> the legacy on-disk names `hf_name_map` uses."""
    if isinstance(config, VoxtralConfig):
        for modern, legacy in _VOXTRAL_MODERN_PREFIXES:
            if name.startswith(modern):
                return legacy + name[len(modern):]
    return name


def _tensor_sources(info: CheckpointInfo) -> dict[str, _Source]:
    """HF on-disk name -> where to read it, after checking names and shapes against the configuration."""
    stored = stored_tensors(info.weight_files)
    try:
        if info.kind == "native":
            check_native_tensors(info.config, {name: tensor.shape for name, tensor in stored.items()})
            renamed = {native_to_hf_name(name, info.config): name for name in stored}
        else:
            renamed = {_hf_legacy_name(name, info.config): name for name in stored}
            check_tensor_names(info.config, {hf: stored[name].shape for hf, name in renamed.items()})
    except CheckpointMismatchError as exc:
        raise UserError(f"{info.directory}: {exc}") from None
    ignored = ignorable_names(info.config)
    return {hf: _Source(stored[name].file, name,
                        rope_heads=rope_permutation_heads(hf, info.config) if info.kind == "native" else None)
            for hf, name in renamed.items() if hf not in ignored}


def _stream_safetensors(info: CheckpointInfo, param_dtype, shardings: dict, int8: dict,
                        progress: bool | None) -> dict:
    """Reads, re-lays-out, casts and places (or quantizes: `_placed`) one tensor at a time; returns the nested
    pure state dict."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    sources = _tensor_sources(info)
    entries = hf_name_map(info.config)
    by_file: dict[Path, list[str]] = {}
    for hf_name, source in sources.items():
        by_file.setdefault(source.file, []).append(hf_name)
    flat = {}
    show = progress if progress is not None else sys.stderr.isatty()
    with tqdm(total=len(sources), unit="tensor", desc="loading", disable=not show) as bar:
        for file, names in by_file.items():
            with safe_open(file, framework="numpy") as reader:
                for hf_name in names:
                    source, entry = sources[hf_name], entries[hf_name]
                    tensor = reader.get_tensor(source.name)
                    if source.rope_heads is not None:
                        tensor = interleaved_to_half_split(tensor, source.rope_heads)
                    host = np.ascontiguousarray(entry.transform(tensor), dtype=param_dtype)
                    del tensor
                    flat.update(_placed(entry.path, host, shardings, int8))
                    del host
                    bar.update()
    return traverse_util.unflatten_dict(flat)


def _placed(path: tuple, value, shardings: dict, int8: dict) -> dict[tuple, jax.Array]:
    """{path: `value` where `shardings` puts it}; for an int8 weight, {path: q, its scale's path: scale}, quantized
    on the device from the float value placed as the int8 kernel is. Waits for the device, so that the float value
    (a host tensor, a restored array) can go before the next one is read: one tensor in flight."""
    value = jax.device_put(value, shardings[path])
    if path not in int8:
        return {path: value.block_until_ready()}
    q, scale = quantize_weight(value, int8[path])
    scale_path = path[:-1] + ("scale",)
    return jax.block_until_ready({path: jax.device_put(q, shardings[path]),
                                  scale_path: jax.device_put(scale, shardings[scale_path])})


# ------------------------------------------------------------------------------------------ modelling


def model_class(config: ModelConfig) -> type[Model]:
    return VoxtralRealtime if isinstance(config, VoxtralConfig) else TextLM


class _ConstantKeys:
    """Stands in for `nnx.Rngs` when building a model whose every parameter will be overwritten.

    A stateful `nnx.Rngs` under `nnx.eval_shape` makes tracing quadratic in the parameter count (each
    counter update asks a tracer for its sharding, and jax 0.10 builds an error message scanning the
    whole trace): 15 s instead of 1 s for the 4B model. Any stream (`rngs.params()`, ...) gives one key.
    """

    def __call__(self) -> jax.Array:
        return jax.random.key(0)

    def __getattr__(self, stream: str):
        if stream.startswith("_"):  # not a stream name: keep Python's protocols (copy, pickle) honest
            raise AttributeError(stream)
        return self


def abstract_model(config: ModelConfig, dtype=jnp.float32, param_dtype=None, quantization: str | None = None) -> Model:
    """The model of `config` with `jax.ShapeDtypeStruct` parameters (nothing allocated); with `quantization`,
    its int8 form (models/quantization.py). `dtype` and `param_dtype` may be spelt any way jnp.dtype reads."""
    cls = model_class(config)
    dtype = _module_dtype(dtype)
    param_dtype = dtype if param_dtype is None else _module_dtype(param_dtype)

    def build():
        model = cls(config, rngs=_ConstantKeys(), dtype=dtype, param_dtype=param_dtype)
        return quantize_structure(model) if quantization else model

    try:
        return nnx.eval_shape(build)
    except ValueError as exc:  # a configuration the model does not support
        raise UserError(f"unsupported {cls.__name__} configuration: {exc}") from None


def _module_dtype(dtype) -> type:
    """`dtype` in the one form the model modules hold it: jax's scalar type (`jnp.float32`), that of their defaults.

    A module keeps its dtypes as static attributes, in its graphdef, and a graphdef keys jit caches (the training
    step's, `make_train_step`). `np.dtype("float32") == jnp.float32` holds but their hashes differ, so a loaded
    model holding the one missed the cache entry of a freshly built model holding the other.
    """
    return getattr(jnp, jnp.dtype(dtype).name)


def _leaf_shardings(abstract: nnx.State, sharding: ShardingSpec | None) -> dict[tuple, jax.sharding.Sharding]:
    """NNX state path -> sharding of that parameter."""
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(abstract))
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return {path: sharding for path in leaves}
    return {path: sharding(path, tuple(leaf.shape)) for path, leaf in leaves.items()}


# ---------------------------------------------------------------------------------------------- Orbax

# The float tensors restored at once when a model is quantized as it loads: what its loading holds beyond the
# int8 model (the float model whole is what quantizing as it loads avoids: 8.9 GB for Voxtral 4B in bfloat16).
_QUANTIZED_RESTORE_BYTES = 256 << 20


def _restore_orbax(directory: Path, abstract: nnx.State, param_dtype, shardings: dict, int8: dict) -> dict:
    """Restores the state in `param_dtype` and `shardings`, at once, or for an int8 model a group of tensors at a
    time, each quantized as it is placed (`_placed`)."""
    scales = {path[:-1] + ("scale",) for path in int8}  # computed here, not stored
    target = {path: jax.ShapeDtypeStruct(leaf.shape, param_dtype, sharding=shardings[path])
              for path, leaf in traverse_util.flatten_dict(nnx.to_pure_dict(abstract)).items() if path not in scales}
    state_dir = (directory / ORBAX_STATE_DIR).resolve()
    if not int8:
        [restored] = restore_state(state_dir, target)
        return traverse_util.unflatten_dict(restored)
    flat = {}
    for restored in restore_state(state_dir, target, group_bytes=_QUANTIZED_RESTORE_BYTES):
        for path, value in restored.items():
            flat.update(_placed(path, value, shardings, int8))
    return traverse_util.unflatten_dict(flat)
