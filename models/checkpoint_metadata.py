"""What a checkpoint directory holds, read without its weights: `inspect_checkpoint` recognises its format and
parses its configuration, `declared_token_ids` and `declared_sampling_defaults` read the BOS / EOS ids and the
sampling defaults it declares, `checkpoint_dtype` the dtype of its parameters. `load_model` (loading.py) reads the
weights of each format:

(a) Mistral-native: `params.json` + `consolidated*.safetensors` (+ `tekken.json`),
(b) Hugging Face: `config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`
    (+ `tokenizer.json`, + `generation_config.json`),
(c) jaxstream Orbax, written by `jaxstream convert` or `jaxstream train` (orbax_writer.py): `jaxstream.json`
    (format, config, parameter dtype, tokenizer file, declared ids and sampling defaults) + `state/` (Orbax) +
    tokenizer (+ the tokenizer_config.json of a tokenizer.json). This module owns its file names and metadata
    fields (`ORBAX_*`, `config_to_dict`); orbax_writer.py writes them.

Anything wrong with a directory raises a one-line `UserError` naming the file.
"""
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxstream.models.config import (
    EncoderConfig, ModelConfig, TextConfig, VoxtralConfig, config_from_hf, config_from_mistral_params,
)
from jaxstream.models.errors import UserError
from jaxstream.models.tokenizers import TOKENIZER_FILES

logger = logging.getLogger(__name__)

ORBAX_METADATA = "jaxstream.json"
ORBAX_STATE_DIR = "state"
ORBAX_FORMAT = "jaxstream-orbax"
ORBAX_FORMAT_VERSION = 1

NATIVE_WEIGHT_FILES = "consolidated*.safetensors"  # glob patterns
HF_WEIGHT_FILES = "model*.safetensors"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory, inspected without reading any weights."""

    kind: str  # "native", "hf" or "orbax"
    directory: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]  # safetensors files (empty for Orbax)
    tokenizer_path: Path | None


def inspect_checkpoint(directory: Path) -> CheckpointInfo:
    """Recognises the checkpoint format of `directory` and parses its configuration (no weights read)."""
    if (directory / ORBAX_METADATA).is_file():
        metadata = _orbax_metadata(directory)
        candidates = (metadata.tokenizer,) if metadata.tokenizer else ()
        return CheckpointInfo("orbax", directory, metadata.config, (),
                              _checkpoint_tokenizer(directory, metadata.config, candidates))
    native_files = tuple(sorted(directory.glob(NATIVE_WEIGHT_FILES)))
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


# ---------------------------------------------------------------------------- declared ids and sampling


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


# ------------------------------------------------------------------------------------ parameter dtype


_SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F16": jnp.float16, "F32": jnp.float32, "F64": jnp.float64}


class StoredTensor(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", ...


def stored_tensors(files: tuple[Path, ...]) -> dict[str, StoredTensor]:
    """Name -> where and what each tensor of `files` is, from their headers."""
    from safetensors import SafetensorError, safe_open

    stored: dict[str, StoredTensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as reader:
                for name in reader.keys():
                    if name in stored:
                        raise UserError(f"tensor {name!r} is stored twice ({stored[name].file.name}, {file.name})")
                    tensor = reader.get_slice(name)
                    stored[name] = StoredTensor(file, tuple(tensor.get_shape()), tensor.get_dtype())
        except (OSError, SafetensorError) as exc:
            raise UserError(f"cannot read {file}: {exc}") from None
    return stored


def checkpoint_dtype(info: CheckpointInfo) -> jnp.dtype:
    """The dtype the checkpoint stores its parameters in. Where its tensors differ (float32 norms beside
    bfloat16 weights, say), the floating dtype that holds the most parameters, the first stored on a tie:
    what the bulk of the model was trained and shipped in."""
    if info.kind == "orbax":
        return _orbax_metadata(info.directory).param_dtype
    sizes: dict[str, int] = {}
    for tensor in stored_tensors(info.weight_files).values():
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + math.prod(tensor.shape)
    floating = {dtype: size for dtype, size in sizes.items() if dtype in _SAFETENSORS_DTYPES}
    if not floating:
        stored = ", ".join(sorted(sizes)) if sizes else "no"
        raise UserError(f"{info.directory} stores {stored} tensors; expected floating-point parameters")
    return jnp.dtype(_SAFETENSORS_DTYPES[max(floating, key=floating.get)])


# --------------------------------------------------------------------------------- jaxstream.json


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


# ------------------------------------------------------------------------------------------ reading


def first_line(exc: BaseException, limit: int = 200) -> str:
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
