"""The jaxstream Orbax checkpoint writer: `save_checkpoint` (used by `jaxstream convert` and `jaxstream train`)
and `check_destination`, the check a caller runs before any work.

The format is read by `jaxstream.models.checkpoint_metadata` (`inspect_checkpoint`), which owns its file names and
metadata fields (`ORBAX_*`, `config_to_dict`), and `jaxstream.models.loading` (`load_model`); this module only
writes them.
"""
import json
import os
import shutil
from pathlib import Path

import jax
from flax import nnx

from jaxstream.models.chat_templates import CHAT_TEMPLATE_FILE
from jaxstream.models.errors import UserError
from jaxstream.models.checkpoint_metadata import (
    ORBAX_FORMAT, ORBAX_FORMAT_VERSION, ORBAX_METADATA, ORBAX_STATE_DIR, config_to_dict,
)
from jaxstream.models.loading import LoadedModel


class CheckpointExistsError(UserError):
    """The destination already holds a jaxstream checkpoint and `overwrite` was not given."""


def check_destination(destination: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """The absolute checkpoint directory for `destination`, which must be missing, empty, or (with
    `overwrite`) a jaxstream checkpoint; anything else would lose the user's files. Its parent must be
    writable: `save_checkpoint` writes beside it."""
    directory = Path(destination).expanduser().resolve()
    if directory.exists():
        if not directory.is_dir():
            raise UserError(f"destination {directory} is a file")
        if any(directory.iterdir()):
            if not (directory / ORBAX_METADATA).is_file():
                raise UserError(f"destination {directory} is not empty and not a jaxstream checkpoint; "
                                "refusing to overwrite it")
            if not overwrite:
                raise CheckpointExistsError(f"destination {directory} already holds a checkpoint")
    if not os.access(_existing_ancestor(directory.parent), os.W_OK):
        raise UserError(f"cannot write destination {directory}: permission denied")
    return directory


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def save_checkpoint(loaded: LoadedModel, destination: str | os.PathLike, *, overwrite: bool = False,
                    declared_ids: tuple[int | None, tuple[int, ...]] = (None, ()),
                    sampling_defaults: dict[str, int | float] | None = None) -> Path:
    """Writes `loaded` as a jaxstream Orbax checkpoint (state, `jaxstream.json`, tokenizer file) and returns
    its directory (see `check_destination`). `declared_ids` are the source's (BOS id, EOS ids) as
    `declared_token_ids` read them, and a tokenizer.json takes its tokenizer_config.json (`HFTokenizer`'s BOS / EOS
    fallback) and chat_template.jinja along: the converted checkpoint stops and chats as its source did.
    `sampling_defaults` are the source's as `declared_sampling_defaults` read them: it samples as its source did too.

    Everything is written into a hidden sibling directory that is renamed into place at the end, so a failed or
    interrupted write leaves the destination as it was (an overwritten checkpoint is removed only then)."""
    import orbax.checkpoint as ocp

    directory = check_destination(destination, overwrite=overwrite)
    staging = directory.with_name(f".{directory.name}.partial")
    directory.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)  # what a killed write left
    try:
        staging.mkdir()
        params = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(staging / ORBAX_STATE_DIR, params)
        tokenizer = None
        if loaded.tokenizer_path is not None:
            tokenizer = loaded.tokenizer_path.name
            shutil.copyfile(loaded.tokenizer_path, staging / tokenizer)
            if tokenizer == "tokenizer.json":  # what HFTokenizer reads beside it: BOS / EOS names, the chat template
                for name in ("tokenizer_config.json", CHAT_TEMPLATE_FILE):
                    if (loaded.tokenizer_path.parent / name).is_file():
                        shutil.copyfile(loaded.tokenizer_path.parent / name, staging / name)
        metadata = {"format": ORBAX_FORMAT, "format_version": ORBAX_FORMAT_VERSION,
                    "config": config_to_dict(loaded.config), "param_dtype": str(jax.tree.leaves(params)[0].dtype),
                    "tokenizer": tokenizer, "bos_token_id": declared_ids[0], "eos_token_ids": list(declared_ids[1]),
                    "sampling_defaults": dict(sampling_defaults or {})}
        (staging / ORBAX_METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        if directory.exists():  # an empty directory, or the checkpoint `overwrite` replaces
            replaced = directory.with_name(f".{directory.name}.replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            directory.rename(replaced)
            staging.rename(directory)
            shutil.rmtree(replaced)
        else:
            staging.rename(directory)
    except BaseException:  # Ctrl-C included: no half-written checkpoint is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
