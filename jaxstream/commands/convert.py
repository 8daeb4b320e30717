"""`jaxstream convert SRC DST`: turn a Mistral-native or Hugging Face safetensors checkpoint into a jaxstream
Orbax checkpoint, which `load_model` restores straight into any dtype and device sharding."""
import argparse

from jaxstream.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# `inspect_checkpoint`'s kinds as the summary line names them.
_SOURCE_KINDS = {"native": "a Mistral-native", "hf": "a Hugging Face", "orbax": "an Orbax"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a safetensors checkpoint into a jaxstream Orbax checkpoint",
        description="Convert a Mistral-native or Hugging Face safetensors checkpoint into a jaxstream Orbax "
                    "checkpoint, which loads straight into any dtype and device sharding.")
    parser.add_argument("src", metavar="SRC", help="a checkpoint directory (Mistral native: params.json + "
                        "consolidated.safetensors; Hugging Face: config.json + model*.safetensors; or a jaxstream "
                        "checkpoint), a built-in model name or a Hugging Face repo id")
    parser.add_argument("dst", metavar="DST", help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="parameter dtype of the written checkpoint (auto: the source's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing jaxstream checkpoint at DST")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from jaxstream.models import checkpoint_metadata, loading, orbax_writer
    from jaxstream.models.layers import num_parameters

    source = loading.resolve_model_dir(args.src)
    try:
        destination = orbax_writer.check_destination(args.dst, overwrite=args.overwrite)
    except orbax_writer.CheckpointExistsError as exc:
        raise UserError(f"{exc} (use --overwrite to replace it)") from None
    if destination == source.resolve():
        raise UserError("SRC and DST are the same directory")
    info = checkpoint_metadata.inspect_checkpoint(source)
    dtype = checkpoint_metadata.checkpoint_dtype(info) if args.dtype == "auto" else jnp.dtype(args.dtype)
    # Read (and checked) before the weights: a bad generation_config.json fails at once.
    declared_ids = checkpoint_metadata.declared_token_ids(source)
    sampling_defaults = checkpoint_metadata.declared_sampling_defaults(source)
    loaded = loading.load_model(source, dtype=dtype)
    written = orbax_writer.save_checkpoint(loaded, destination, overwrite=args.overwrite, declared_ids=declared_ids,
                                           sampling_defaults=sampling_defaults)
    source_kind = _SOURCE_KINDS.get(info.kind, f"a {info.kind}")
    print(f"wrote {written} ({num_parameters(loaded.model):,} {dtype.name} parameters from {source_kind} checkpoint)")
    return 0
