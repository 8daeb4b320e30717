"""What a checkpoint holds beside its weights, and the one-line errors when it is broken: the tokenizer its files
select (tokenizer.json over a sentencepiece tokenizer.model, tekken.json), the BOS/EOS ids generation_config.json or
config.json declare (kept by `convert`), and an Orbax checkpoint's jaxstream.json and state (a failed restore's
abandoned reads not logged; a failed convert leaves its destination as it was)."""
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from jaxstream import cli
from jaxstream.errors import UserError
from jaxstream.models import VOXTRAL_MINI_4B
from jaxstream.models import loading, orbax_writer
from jaxstream.models.checkpoint_metadata import CheckpointInfo, checkpoint_dtype, declared_token_ids
from loading_fixtures import (FIXTURES, MISTRAL_DIR, VOXTRAL_DIR, copy_fixture, flat_params, one_line_error,
                              write_native)


def test_declared_token_ids_prefer_generation_config(tmp_path):
    def declared(**files):
        directory = Path(tempfile.mkdtemp(dir=tmp_path))
        for name, content in files.items():
            (directory / f"{name}.json").write_text(json.dumps(content))
        return declared_token_ids(directory)

    # generation_config.json first (transformers' generate reads it), field by field, then config.json.
    assert declared(generation_config={"eos_token_id": [128001, 128009]},
                    config={"bos_token_id": 1, "eos_token_id": 2}) == (1, (128001, 128009))
    assert declared(generation_config={"bos_token_id": 5, "eos_token_id": None},
                    config={"bos_token_id": 1, "eos_token_id": 2}) == (5, (2,))
    assert declared(config={"eos_token_id": 2}) == (None, (2,))
    assert declared() == (None, ())
    with pytest.raises(UserError, match="generation_config.json: eos_token_id must be a token id or a list"):
        declared(generation_config={"eos_token_id": "</s>"})
    with pytest.raises(UserError, match="config.json: bos_token_id must be a token id"):
        declared(config={"bos_token_id": [1, 2]})


def test_hf_checkpoint_tokenizer_json_wins_over_tokenizer_model(tmp_path):
    from tokenizers import Tokenizer, models

    directory = copy_fixture(FIXTURES / "llama_tiny", tmp_path / "llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 3]}))
    # Hub repos of Llama/Mistral ship their original sentencepiece model too; its ids are not the checkpoint's
    # in our Voxtral-layout SentencePieceTokenizer, so it must not be picked (never read: not a real model).
    (directory / "tokenizer.model").write_bytes(b"the original sentencepiece model")

    loaded = loading.load_model(directory)
    assert loaded.tokenizer_path == directory / "tokenizer.json"
    tokenizer = loading.load_checkpoint_tokenizer(directory, loaded.tokenizer_path)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)  # the checkpoint's ids (the first EOS)
    assert tokenizer.encode("hello") == [3]
    assert loading.load_checkpoint_tokenizer(directory, None) is None

    # `convert` keeps what the source declared: the engine stops at the same EOS ids after conversion.
    converted = tmp_path / "converted"
    assert cli.main(["convert", str(directory), str(converted)]) == 0
    assert declared_token_ids(converted) == declared_token_ids(directory) == (1, (2, 3))
    restored = loading.load_checkpoint_tokenizer(converted, loading.load_model(converted).tokenizer_path)
    assert (restored.bos_id, restored.eos_id) == (1, 2)


def word_level_tokenizer_json(path: Path):
    """A tokenizer.json with the checkpoint's own ids (`hello` is 3); returns the `tokenizers` object."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))
    return tokenizer


def test_text_models_never_read_tokenizer_model_in_the_voxtral_layout(tmp_path, caplog):
    """A native (params.json) directory takes tokenizer.json over the original sentencepiece model too, and a
    text model whose only tokenizer is a tokenizer.model loads without one instead of with ids off by 1000."""
    native = write_native(MISTRAL_DIR, tmp_path / "native")
    oracle = word_level_tokenizer_json(native / "tokenizer.json")
    shutil.copy(loading.BUILTIN_MODELS["tiny"] / "tokenizer.model", native / "tokenizer.model")
    loaded = loading.load_model(native)
    assert loaded.tokenizer_path == native / "tokenizer.json"
    tokenizer = loading.load_checkpoint_tokenizer(native, loaded.tokenizer_path)
    assert tokenizer.encode("hello") == oracle.encode("hello", add_special_tokens=False).ids == [3]

    (native / "tokenizer.json").unlink()
    hf = copy_fixture(MISTRAL_DIR, tmp_path / "hf")
    shutil.copy(native / "tokenizer.model", hf / "tokenizer.model")
    for directory in (native, hf):
        with caplog.at_level("WARNING", logger="jaxstream.models.checkpoint_metadata"):
            assert loading.load_model(directory).tokenizer_path is None
        assert "tokenizer.model not used" in caplog.text
        caplog.clear()


@pytest.fixture(scope="module")
def voxtral_orbax(tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "voxtral"
    assert cli.main(["convert", str(VOXTRAL_DIR), str(out)]) == 0
    return out


def broken_orbax(source: Path, destination: Path, metadata_edit=None) -> Path:
    shutil.copytree(source, destination)
    if metadata_edit is not None:
        metadata = json.loads((destination / "jaxstream.json").read_text())
        metadata_edit(metadata)
        (destination / "jaxstream.json").write_text(json.dumps(metadata))
    return destination


def test_orbax_metadata_and_state_errors_are_one_line(voxtral_orbax, tmp_path):
    no_tokenizer = broken_orbax(voxtral_orbax, tmp_path / "no_tokenizer")
    (no_tokenizer / "tekken.json").unlink()
    assert "lacks tekken.json, the tokenizer jaxstream.json names" in one_line_error(no_tokenizer)
    outside = broken_orbax(voxtral_orbax, tmp_path / "outside", lambda m: m.update(tokenizer="../x/tekken.json"))
    assert "tokenizer must be the name of a file beside it" in one_line_error(outside)
    version = broken_orbax(voxtral_orbax, tmp_path / "version", lambda m: m.update(format_version="1"))
    assert "format_version must be an integer, got '1'" in one_line_error(version)
    no_dtype = broken_orbax(voxtral_orbax, tmp_path / "no_dtype", lambda m: m.pop("param_dtype"))
    assert "param_dtype must be one of" in one_line_error(no_dtype)
    with pytest.raises(UserError, match="param_dtype"):
        checkpoint_dtype(CheckpointInfo("orbax", no_dtype, VOXTRAL_MINI_4B, (), None))
    no_data = broken_orbax(voxtral_orbax, tmp_path / "no_data")
    shutil.rmtree(no_data / "state" / "ocdbt.process_0")
    # In a process of its own: after the first failed read Orbax abandons its other reads, whose failures
    # surface later as "Exception ignored in ..." tracebacks (after the CLI's error line, or in a later test).
    result = subprocess.run([sys.executable, "-m", "jaxstream", "convert", str(no_data), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    [message] = [line for line in result.stderr.splitlines() if line.startswith("jaxstream convert: error:")]
    assert result.returncode == 2 and len(message) < 300 + 2 * len(str(no_data))  # it names the folder twice
    assert message.startswith(f"jaxstream convert: error: cannot restore {no_data / 'state'}")
    # TensorStore's own status names the array and what is wrong with its file, not Orbax's wrapper (which
    # printed the store's spec: "See full TensorStore details: <bound method pybind11_detail_function_...").
    assert 'Error reading "' in message and "TensorStore details" not in message, message
    assert "Task exception was never retrieved" not in result.stderr


def test_orbax_reads_abandoned_after_a_failed_restore_are_not_logged(voxtral_orbax, tmp_path):
    """After the first failed read Orbax abandons the others; asyncio logs each that failed as it is collected
    (when is up to the garbage collector: at exit, in about one CLI run of seven), with TensorStore's whole spec.
    Those records are dropped once a restore has failed; asyncio's other errors are not."""
    no_data = broken_orbax(voxtral_orbax, tmp_path / "no_data")
    shutil.rmtree(no_data / "state" / "ocdbt.process_0")
    asyncio_logger = logging.getLogger("asyncio")
    abandoned = ("Task exception was never retrieved\nfuture: <Task finished name='Task-241' coro=<async_deserialize() "
                 "done, defined at /site-packages/orbax/checkpoint/_src/serialization/serialization.py:394> "
                 "exception=Exception('Encountered error while reading array index: (slice(0, 256, 1),)')>")
    other = "Task exception was never retrieved\nfuture: <Task finished name='Task-7' coro=<handler() done>>"
    with pytest.raises(UserError, match="cannot restore"):
        loading.load_model(no_data)
    assert not asyncio_logger.filter(asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 0, abandoned, (),
                                                               None))
    assert asyncio_logger.filter(asyncio_logger.makeRecord("asyncio", logging.ERROR, __file__, 0, other, (), None))


def test_tokenizer_file_errors_are_one_line(voxtral_orbax, tmp_path):
    def tokenizer_error(directory: Path) -> str:
        with pytest.raises(UserError) as err:
            loading.load_checkpoint_tokenizer(directory, loading.load_model(directory).tokenizer_path)
        assert "\n" not in str(err.value)
        return str(err.value)

    no_tekken = copy_fixture(VOXTRAL_DIR, tmp_path / "no_tekken")
    (no_tekken / "tekken.json").unlink()
    assert "Voxtral Realtime needs its tokenizer" in one_line_error(no_tekken)
    orbax_without = broken_orbax(voxtral_orbax, tmp_path / "orbax_without", lambda m: m.update(tokenizer=None))
    (orbax_without / "tekken.json").unlink()
    assert "Voxtral Realtime needs its tokenizer" in one_line_error(orbax_without)

    malformed = copy_fixture(VOXTRAL_DIR, tmp_path / "malformed")
    (malformed / "tekken.json").write_text('{"not": "tekken"')
    assert f"cannot read tokenizer {malformed / 'tekken.json'}" in tokenizer_error(malformed)
    specials = copy_fixture(VOXTRAL_DIR, tmp_path / "specials")
    tekken = json.loads((specials / "tekken.json").read_text())
    tekken["config"].update(default_num_special_tokens=1001, default_vocab_size=1101)
    (specials / "tekken.json").write_text(json.dumps(tekken))
    assert "expected 1000 special tokens" in tokenizer_error(specials)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        directory = copy_fixture(FIXTURES / "llama_tiny", tmp_path / name)
        word_level_tokenizer_json(directory / "tokenizer.json")
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        (directory / name).write_text("{bad")
        assert f"cannot read tokenizer {directory / name}" in tokenizer_error(directory)


def test_failed_convert_leaves_the_destination_as_it_was(voxtral_orbax, tmp_path):
    loaded = loading.load_model(VOXTRAL_DIR)
    before = flat_params(loading.load_model(voxtral_orbax).model)
    lost = loaded._replace(tokenizer_path=tmp_path / "gone" / "tekken.json")  # fails after state/ is written
    for destination in (voxtral_orbax, tmp_path / "fresh"):
        with pytest.raises(FileNotFoundError):
            orbax_writer.save_checkpoint(lost, destination, overwrite=True)
        assert sorted(path.name for path in destination.parent.iterdir() if path.name.startswith(".")) == []
    assert not (tmp_path / "fresh").exists()
    after = flat_params(loading.load_model(voxtral_orbax).model)
    assert before.keys() == after.keys() and all(np.array_equal(before[path], after[path]) for path in before)
    assert orbax_writer.check_destination(voxtral_orbax, overwrite=True) == voxtral_orbax
    assert orbax_writer.save_checkpoint(loaded, voxtral_orbax, overwrite=True) == voxtral_orbax
    assert loading.load_model(voxtral_orbax).tokenizer_path == voxtral_orbax / "tekken.json"


def test_convert_keeps_bos_eos_named_only_in_tokenizer_config(tmp_path):
    source = copy_fixture(FIXTURES / "llama_tiny", tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.endswith("token_id")}))
    (source / "generation_config.json").unlink()
    word_level_tokenizer_json(source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    # transformers 5's save_pretrained writes the chat template to a file of its own
    (source / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert cli.main(["convert", str(source), str(tmp_path / "converted")]) == 0
    for directory in (source, tmp_path / "converted"):
        tokenizer = loading.load_checkpoint_tokenizer(directory, loading.load_model(directory).tokenizer_path)
        assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
        chat = tokenizer.chat_template.encode([{"role": "user", "content": "w5"}])  # it chats as its source did
        assert chat.text == "[user] w5\n" and chat.token_ids == tokenizer.encode("[user] w5\n")

