"""Restoring the state of a jaxstream Orbax checkpoint (what orbax_writer.py writes and `load_model` reads;
checkpoint_metadata.py reads its jaxstream.json).

`restore_state` restores the whole state at once, or consecutive groups of its tensors (Orbax's partial restore),
so that a loader that turns each tensor into something else (int8 weights) never holds the whole float state.
"""
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import jax
from flax import traverse_util

from jaxstream.models.errors import UserError
from jaxstream.models.checkpoint_metadata import ORBAX_METADATA, first_line


def restore_state(state_dir: Path, target: dict, *, group_bytes: int | None = None) -> Iterator[dict]:
    """Yields the restored arrays (flat path -> array, dtype and sharding as `target`'s ShapeDtypeStructs say): all
    of them at once, or with `group_bytes`, consecutive groups of at most that many bytes (a larger tensor alone).
    A missing or damaged file raises a one-line `UserError`."""
    import orbax.checkpoint as ocp

    options = ocp.options.MultiprocessingOptions()  # the job's processes restore their shards together
    if all(leaf.sharding.is_fully_addressable for leaf in target.values()):
        # This process's own copy (one process, or each process of a data-parallel job such as
        # `eval --shard auto`): no barrier with processes that load at another time or not at all.
        options = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                     active_processes={jax.process_index()})
    try:
        if group_bytes is None:
            with ocp.StandardCheckpointer(multiprocessing_options=options) as checkpointer:
                restored = checkpointer.restore(state_dir, traverse_util.unflatten_dict(target))
            yield traverse_util.flatten_dict(restored)
            return
        handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options)
        with ocp.Checkpointer(handler, multiprocessing_options=options) as checkpointer:
            for group in _groups_of_bytes(target, group_bytes):
                item = traverse_util.unflatten_dict(group)
                restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
                yield traverse_util.flatten_dict(restored)
    except Exception as exc:  # Orbax and TensorStore raise plain Exceptions for missing or damaged files
        # Orbax abandons its other reads at the first failure; each that fails too would be logged by asyncio as
        # "Task exception was never retrieved" with TensorStore's whole spec, pages of it after our one line.
        asyncio_logger = logging.getLogger("asyncio")
        if _drop_abandoned_orbax_reads not in asyncio_logger.filters:
            asyncio_logger.addFilter(_drop_abandoned_orbax_reads)
        raise UserError(f"cannot restore {state_dir} as {ORBAX_METADATA} describes it: "
                        f"{first_line(_tensorstore_status(exc), 300)}") from None


def _groups_of_bytes(leaves: dict, limit: int) -> list[dict]:
    """`leaves` (path -> ShapeDtypeStruct) in consecutive groups of at most `limit` bytes (a larger leaf alone)."""
    groups, size = [{}], 0
    for path, leaf in leaves.items():
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][path] = leaf
        size += nbytes
    return groups


def _drop_abandoned_orbax_reads(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Task exception was never retrieved") and "orbax" in message)


def _tensorstore_status(exc: BaseException) -> BaseException:
    """The error under Orbax's "Encountered error while reading array index ... See full TensorStore details:
    <the store's whole spec>": TensorStore's own status, which names the array and what is wrong with its file
    ('FAILED_PRECONDITION: Error reading "decoder.norm.scale/0" ...: Truncated Zstd-compressed stream')."""
    while "TensorStore details" in str(exc) and (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return exc
