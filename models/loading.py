"""One entry point to load a model: `load_model(source)` for the CLI, the engine and the notebook.

`source` is one of
- a built-in name (`BUILTIN_MODELS`: name -> packaged checkpoint directory),
- a local directory holding
  (a) a Mistral-native checkpoint: `params.json` + `consolidated*.safetensors` (+ `tekken.json`),
  (b) a Hugging Face checkpoint: `config.json` + `model.safetensors` or a sharded
      `model.safetensors.index.json` (legacy on-disk and modern transformers names both accepted)
      (+ `tokenizer.json`, + `generation_config.json`: `load_checkpoint_tokenizer`, `declared_token_ids`,
      `declared_sampling_defaults`),
  (c) a jaxstream Orbax checkpoint written by `jaxstream convert` or `jaxstream train` (orbax_writer.py):
      `jaxstream.json` (format, config, parameter dtype, tokenizer file) + `state/` (Orbax) + tokenizer
      (+ the tokenizer_config.json of a tokenizer.json),
- a Hugging Face repo id `org/name`, downloaded with `huggingface_hub.snapshot_download` (a clear
  one-line `UserError` when offline or not found).

Safetensors checkpoints are streamed: the model is built abstractly (`nnx.eval_shape`, no allocation),
then each tensor is read on its own (`safe_open`), re-laid out, cast to the parameter dtype and placed on
its device before the next one is read, so host memory holds the placed parameters plus a few tensors,
never a second copy of the checkpoint. Orbax checkpoints are restored straight into the requested dtype
and shardings. With `quantization="int8"` each weight is quantized on its device as it is placed
(models/quantization.py); an Orbax checkpoint is then restored a group of tensors at a time, so neither path
holds more of the float model than the tensors in flight.
"""
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxstream.models.config import (
    EncoderConfig, TextConfig, VoxtralConfig, config_from_hf, config_from_mistral_params,
)
from jaxstream.models.errors import UserError
from jaxstream.models.hf_weights import CheckpointMismatchError, check_tensor_names, hf_name_map, ignorable_names
from jaxstream.models.native_weights import (
    check_native_tensors, interleaved_to_half_split, native_to_hf_name, rope_permutation_heads,
)
from jaxstream.models.quantization import check_method, int8_weights, quantize_structure, quantize_weight
from jaxstream.models.text_lm import TextLM
from jaxstream.models.tokenizers import TOKENIZER_FILES, HFTokenizer, Tokenizer, load_tokenizer
from jaxstream.models.voxtral import VoxtralRealtime

logger = logging.getLogger(__name__)

# Built-in model name -> packaged checkpoint directory (any of the formats above).
BUILTIN_MODELS: dict[str, Path] = {"tiny": Path(__file__).parent / "assets" / "tiny"}
DEFAULT_MODEL = "tiny"  # the embedded model every command uses without --model

ORBAX_METADATA = "jaxstream.json"
ORBAX_STATE_DIR = "state"
ORBAX_FORMAT = "jaxstream-orbax"
ORBAX_FORMAT_VERSION = 1

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_METADATA_FILES = ["*.json", "tokenizer.model"]
_NATIVE_WEIGHTS = "consolidated*.safetensors"
_HF_WEIGHTS = "model*.safetensors"

ModelConfig = TextConfig | VoxtralConfig
Model = TextLM | VoxtralRealtime
# A sharding for every parameter, or a rule (NNX state path, shape) -> sharding.
ShardingSpec = jax.sharding.Sharding | Callable[[tuple, tuple[int, ...]], jax.sharding.Sharding]


class LoadedModel(NamedTuple):
    """What `load_model` returns; unpacks as `model, config, tokenizer_path = load_model(...)`."""

    model: Model  # the NNX module; the engine takes `nnx.split(model)`
    config: ModelConfig
    tokenizer_path: Path | None  # next to the weights (`_checkpoint_tokenizer`); None: a text model without one


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory, inspected without reading any weights."""

    kind: str  # "native", "hf" or "orbax"
    directory: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]  # safetensors files (empty for Orbax)
    tokenizer_path: Path | None


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


def declared_token_ids(directory: Path) -> tuple[int | None, tuple[int, ...]]:
    """(BOS id, EOS ids) a checkpoint declares. Hugging Face: as transformers' `generate` takes them,
    generation_config.json first, then config.json; `eos_token_id` may be one id or a list (Llama 3 stops at
    any of three). A jaxstream checkpoint: those of the source it was converted from (`orbax_writer`)."""
    if (directory / ORBAX_METADATA).is_file():
        return _orbax_metadata(directory).declared_ids
    bos_id, eos_ids = None, ()
    for name in ("generation_config.json", "config.json"):
        if not (directory / name).is_file():
            continue
        data = _read_json(directory / name)
        if bos_id is None and data.get("bos_token_id") is not None:
            [bos_id] = _token_ids(data["bos_token_id"], directory / name, "bos_token_id", several=False)
        if not eos_ids and data.get("eos_token_id") is not None:
            eos_ids = _token_ids(data["eos_token_id"], directory / name, "eos_token_id", several=True)
    return bos_id, eos_ids


# generation_config.json's sampling keys vLLM reads (`ModelConfig.get_diff_sampling_param`) -> (vLLM's name, the
# default of transformers 4.x's GenerationConfig). vLLM takes the file's diff against those (`to_diff_dict`), so a
# key stated at its default is not applied: `top_k: 50` leaves vLLM's 0 (no top-k). (Under transformers 5, whose
# defaults are all None, vLLM applies such keys too; this follows vLLM on transformers 4.x.)
_SAMPLING_KEYS = {"repetition_penalty": ("repetition_penalty", 1.0), "temperature": ("temperature", 1.0),
                  "top_k": ("top_k", 50), "top_p": ("top_p", 1.0), "min_p": ("min_p", None),
                  "max_new_tokens": ("max_tokens", None)}
# vLLM's name -> (an integer, lowest, highest, lowest excluded): what vLLM's SamplingParams accepts.
_SAMPLING_RANGES = {"repetition_penalty": (False, 0, None, True), "temperature": (False, 0, None, False),
                    "top_k": (True, -1, 2**31 - 1, False), "top_p": (False, 0, 1, True),
                    "min_p": (False, 0, 1, False), "max_tokens": (True, 1, 2**31 - 1, False)}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def declared_sampling_defaults(directory: Path) -> dict[str, int | float]:
    """The sampling defaults a checkpoint declares, keyed by vLLM's names (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens), as vLLM's `--generation-config auto` takes them: generation_config.json's
    values that differ from transformers' defaults (`_SAMPLING_KEYS`; max_new_tokens is max_tokens). A jaxstream
    checkpoint: those of the source it was converted from (`orbax_writer`). A bad value raises a one-line
    `UserError` naming the file and the key."""
    if (directory / ORBAX_METADATA).is_file():
        return dict(_orbax_metadata(directory).sampling_defaults)
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    data = _read_json(path)
    return {name: data[key] for key, (name, default) in _SAMPLING_KEYS.items()
            if data.get(key) is not None and _sampling_value(data[key], path, key, name) != default}


def _sampling_value(value, path: Path, key: str, name: str) -> int | float:
    integer, low, high, low_excluded = _SAMPLING_RANGES[name]
    valid = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    valid = valid and math.isfinite(value) and abs(value) <= _FLOAT32_MAX and (high is None or value <= high)
    if not valid or value < low or (low_excluded and value == low):
        bound = (f"in {'(' if low_excluded else '['}{low}, {high}]" if high is not None
                 else f"{'>' if low_excluded else '>='} {low}")
        raise UserError(f"{path}: {key} must be {'an integer' if integer else 'a number'} {bound}, got {value!r}")
    return value


def _token_ids(value, path: Path, key: str, *, several: bool) -> tuple[int, ...]:
    ids = value if several and isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        expected = "a token id or a list of them" if several else "a token id"
        raise UserError(f"{path}: {key} must be {expected}, got {value!r}")
    return tuple(ids)


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
            directory = Path(snapshot_download(repo_id, allow_patterns=_HUB_METADATA_FILES + [_NATIVE_WEIGHTS]))
            if any(directory.glob(_NATIVE_WEIGHTS)):
                return directory
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_METADATA_FILES + [_HF_WEIGHTS]))
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
        raise UserError(f"downloading {repo_id!r} from the Hugging Face Hub failed: {_first_line(exc)}") from None


# ---------------------------------------------------------------------------------------- inspecting


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an error from a library, for a one-line `UserError` (TensorStore's run to pages)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit] + "..."


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"cannot read {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _parse_config(path: Path, parse: Callable[[dict], ModelConfig]) -> ModelConfig:
    try:
        return parse(_read_json(path))
    except KeyError as exc:
        raise UserError(f"{path}: missing field {exc}") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path}: {exc}") from None


# The tokenizer files a model can use, in order of preference, whatever the checkpoint's format. tekken.json has
# the checkpoint's ids everywhere. Our `SentencePieceTokenizer` reads a tokenizer.model in the Voxtral layout
# (control ids first): right for the Voxtral models jaxstream trains, wrong for a text model, whose repo ships its
# original sentencepiece model beside tokenizer.json, the one file that keeps the checkpoint's own ids. Voxtral
# needs the realtime control ids, which a tokenizer.json lacks.
_VOXTRAL_TOKENIZERS = ("tekken.json", "tokenizer.model")
_TEXT_TOKENIZERS = ("tekken.json", "tokenizer.json")


def _checkpoint_tokenizer(directory: Path, config: ModelConfig, candidates=tuple(TOKENIZER_FILES)) -> Path | None:
    """The first tokenizer file of `directory` among `candidates` that `config`'s model can use. Voxtral without
    one is refused (it cannot transcribe); a text model loads without one and then takes token ids only."""
    voxtral = isinstance(config, VoxtralConfig)
    present = [name for name in candidates if (directory / name).is_file()]
    found = next((directory / name for name in (_VOXTRAL_TOKENIZERS if voxtral else _TEXT_TOKENIZERS)
                  if name in present), None)
    if found is None and voxtral:
        raise UserError(f"{directory} has no tekken.json or tokenizer.model: Voxtral Realtime needs its tokenizer")
    if found is None and "tokenizer.model" in present:
        logger.warning("%s: tokenizer.model not used: it would be read in the Voxtral id layout, not this text "
                       "model's (add the checkpoint's tokenizer.json)", directory)
    return found


def inspect_checkpoint(directory: Path) -> CheckpointInfo:
    """Recognises the checkpoint format of `directory` and parses its configuration (no weights read)."""
    if (directory / ORBAX_METADATA).is_file():
        metadata = _orbax_metadata(directory)
        candidates = (metadata.tokenizer,) if metadata.tokenizer else ()
        return CheckpointInfo("orbax", directory, metadata.config, (),
                              _checkpoint_tokenizer(directory, metadata.config, candidates))
    native_files = tuple(sorted(directory.glob(_NATIVE_WEIGHTS)))
    if (directory / "params.json").is_file() and native_files:
        config = _parse_config(directory / "params.json", config_from_mistral_params)
        return CheckpointInfo("native", directory, config, native_files, _checkpoint_tokenizer(directory, config))
    if (directory / "config.json").is_file():
        config = _parse_config(directory / "config.json", config_from_hf)
        return CheckpointInfo("hf", directory, config, _hf_weight_files(directory),
                              _checkpoint_tokenizer(directory, config))
    if (directory / "params.json").is_file():
        raise UserError(f"{directory} has params.json but no consolidated.safetensors")
    raise UserError(f"{directory} is not a model checkpoint: it has no params.json (Mistral native), config.json "
                    f"(Hugging Face) or {ORBAX_METADATA} (jaxstream Orbax)")


def _hf_weight_files(directory: Path) -> tuple[Path, ...]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index} has no weight_map")
        files = tuple(directory / name for name in sorted(set(weight_map.values())))
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise UserError(f"{directory} lacks {', '.join(missing)}, listed in {index.name}")
        return files
    if (directory / "model.safetensors").is_file():
        return (directory / "model.safetensors",)
    raise UserError(f"{directory} has config.json but no model.safetensors or model.safetensors.index.json")


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


class _Stored(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", ...


def _stored_tensors(files: tuple[Path, ...]) -> dict[str, _Stored]:
    """Name -> where and what each tensor of `files` is, from their headers."""
    from safetensors import SafetensorError, safe_open

    stored: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as reader:
                for name in reader.keys():
                    if name in stored:
                        raise UserError(f"tensor {name!r} is stored twice ({stored[name].file.name}, {file.name})")
                    tensor = reader.get_slice(name)
                    stored[name] = _Stored(file, tuple(tensor.get_shape()), tensor.get_dtype())
        except (OSError, SafetensorError) as exc:
            raise UserError(f"cannot read {file}: {exc}") from None
    return stored


def _tensor_sources(info: CheckpointInfo) -> dict[str, _Source]:
    """HF on-disk name -> where to read it, after checking names and shapes against the configuration."""
    stored = _stored_tensors(info.weight_files)
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


_SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F16": jnp.float16, "F32": jnp.float32, "F64": jnp.float64}


def checkpoint_dtype(info: CheckpointInfo) -> jnp.dtype:
    """The dtype the checkpoint stores its parameters in. Where its tensors differ (float32 norms beside
    bfloat16 weights, say), the floating dtype that holds the most parameters, the first stored on a tie:
    what the bulk of the model was trained and shipped in."""
    if info.kind == "orbax":
        return _orbax_metadata(info.directory).param_dtype
    sizes: dict[str, int] = {}
    for tensor in _stored_tensors(info.weight_files).values():
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + math.prod(tensor.shape)
    floating = {dtype: size for dtype, size in sizes.items() if dtype in _SAFETENSORS_DTYPES}
    if not floating:
        stored = ", ".join(sorted(sizes)) if sizes else "no"
        raise UserError(f"{info.directory} stores {stored} tensors; expected floating-point parameters")
    return jnp.dtype(_SAFETENSORS_DTYPES[max(floating, key=floating.get)])


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
    its int8 form (models/quantization.py)."""
    cls = model_class(config)
    param_dtype = dtype if param_dtype is None else param_dtype

    def build():
        model = cls(config, rngs=_ConstantKeys(), dtype=dtype, param_dtype=param_dtype)
        return quantize_structure(model) if quantization else model

    try:
        return nnx.eval_shape(build)
    except ValueError as exc:  # a configuration the model does not support
        raise UserError(f"unsupported {cls.__name__} configuration: {exc}") from None


def _leaf_shardings(abstract: nnx.State, sharding: ShardingSpec | None) -> dict[tuple, jax.sharding.Sharding]:
    """NNX state path -> sharding of that parameter."""
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(abstract))
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return {path: sharding for path in leaves}
    return {path: sharding(path, tuple(leaf.shape)) for path, leaf in leaves.items()}


# ---------------------------------------------------------------------------------------------- Orbax


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A JSON-ready dict of a configuration; `config_from_dict` inverts it."""
    return {"type": type(config).__name__, **dataclasses.asdict(config)}


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    data = dict(data)
    kind = data.pop("type")

    def text(fields: dict) -> TextConfig:
        scaling = fields.get("rope_llama3_scaling")
        return TextConfig(**{**fields, "rope_llama3_scaling": tuple(scaling) if scaling is not None else None})

    if kind == "TextConfig":
        return text(data)
    if kind == "VoxtralConfig":
        trained = data.get("trained_delays_ms")
        return VoxtralConfig(**{**data, "encoder": EncoderConfig(**data["encoder"]), "text": text(data["text"]),
                                "trained_delays_ms": tuple(trained) if trained is not None else None})
    raise ValueError(f"unknown configuration type {kind!r}")


class _OrbaxMetadata(NamedTuple):
    config: ModelConfig
    param_dtype: jnp.dtype
    tokenizer: str | None  # a file beside jaxstream.json
    declared_ids: tuple[int | None, tuple[int, ...]]  # see `declared_token_ids`
    sampling_defaults: dict[str, int | float]  # see `declared_sampling_defaults`


def _orbax_metadata(directory: Path) -> _OrbaxMetadata:
    """The checked contents of `directory`'s jaxstream.json: a hand-edited or damaged file fails here, in one
    line, not later as a TypeError or a missing tokenizer."""
    path = directory / ORBAX_METADATA
    metadata = _read_json(path)
    if metadata.get("format") != ORBAX_FORMAT or not (directory / ORBAX_STATE_DIR).is_dir():
        raise UserError(f"{path} does not describe a jaxstream Orbax checkpoint "
                        f"(format {ORBAX_FORMAT!r} with a {ORBAX_STATE_DIR}/ directory)")
    version = metadata.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UserError(f"{path}: format_version must be an integer, got {version!r}")
    if version > ORBAX_FORMAT_VERSION:
        raise UserError(f"{directory} was written by a newer jaxstream (checkpoint format version {version}); "
                        "upgrade jaxstream to load it")
    config = _parse_config(path, lambda meta: config_from_dict(meta["config"]))
    param_dtype = metadata.get("param_dtype")
    if param_dtype not in (floating := tuple(jnp.dtype(dtype).name for dtype in _SAFETENSORS_DTYPES.values())):
        raise UserError(f"{path}: param_dtype must be one of {', '.join(floating)}, got {param_dtype!r}")
    tokenizer = metadata.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or Path(tokenizer).name != tokenizer):
        raise UserError(f"{path}: tokenizer must be the name of a file beside it, got {tokenizer!r}")
    if tokenizer and not (directory / tokenizer).is_file():
        raise UserError(f"{directory} lacks {tokenizer}, the tokenizer {ORBAX_METADATA} names")
    bos_id = metadata.get("bos_token_id")
    declared = (None if bos_id is None else _token_ids(bos_id, path, "bos_token_id", several=False)[0],
                _token_ids(metadata.get("eos_token_ids") or [], path, "eos_token_ids", several=True))
    defaults = metadata.get("sampling_defaults", {})  # absent in checkpoints written before it was kept
    if not isinstance(defaults, dict) or not set(defaults) <= set(_SAMPLING_RANGES):
        raise UserError(f"{path}: sampling_defaults must map some of {', '.join(_SAMPLING_RANGES)} to values, "
                        f"got {defaults!r}")
    defaults = {name: _sampling_value(value, path, f"sampling_defaults.{name}", name)
                for name, value in defaults.items()}
    return _OrbaxMetadata(config, jnp.dtype(param_dtype), tokenizer, declared, defaults)


# The float tensors restored at once when a model is quantized as it loads: what its loading holds beyond the
# int8 model (the float model whole is what quantizing as it loads avoids: 8.9 GB for Voxtral 4B in bfloat16).
_QUANTIZED_RESTORE_BYTES = 256 << 20


def _restore_orbax(directory: Path, abstract: nnx.State, param_dtype, shardings: dict, int8: dict) -> dict:
    """Restores the state in `param_dtype` and `shardings`, at once, or for an int8 model a group of tensors at a
    time, each quantized as it is placed (`_placed`)."""
    from jaxstream.models.orbax_reader import restore_state

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
