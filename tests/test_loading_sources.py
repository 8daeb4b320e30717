"""Model sources that are not a local folder: Hugging Face Hub ids (offline, and which files a download
fetches, over a stand-in for the Hub) and the built-in names."""
import json
import shutil
from pathlib import Path

import pytest

from jaxstream import cli
from jaxstream.models import loading
from jaxstream.models.errors import UserError
from test_loading import MISTRAL_DIR, copy_fixture


def test_hub_id_offline_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(UserError) as err:
        loading.load_model("mistralai/Voxtral-Mini-4B-Realtime-2602")
    message = str(err.value)
    assert "\n" not in message and "mistralai/Voxtral-Mini-4B-Realtime-2602" in message and "offline" in message
    assert cli.main(["convert", "no-such-org/no-such-model", str(tmp_path / "out")]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "no-such-org/no-such-model" in err_lines[0]



def fake_hub(monkeypatch, remote: Path, local: Path) -> list:
    """`huggingface_hub.snapshot_download` over a folder standing for a Hub repo: each call fetches the files its
    patterns select (the Hub's own filter) into one local snapshot; returns the list of files fetched."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    fetched = []

    def snapshot_download(repo_id, allow_patterns=None):
        for name in filter_repo_objects([p.name for p in remote.iterdir()], allow_patterns=allow_patterns):
            if not (local / name).exists():
                local.mkdir(parents=True, exist_ok=True)
                shutil.copy(remote / name, local / name)
                fetched.append(name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def test_hub_repo_with_params_json_and_hf_weights_only_downloads_those(monkeypatch, tmp_path):
    remote = copy_fixture(MISTRAL_DIR, tmp_path / "remote")
    (remote / "params.json").write_text(json.dumps({"dim": 64}))  # the base model's, beside transformers' files
    fetched = fake_hub(monkeypatch, remote, tmp_path / "snapshot")
    assert loading.load_model("someone/fine-tune").config.vocab_size == 256
    assert "model.safetensors" in fetched


def test_hub_repo_with_both_formats_downloads_the_native_weights_only(monkeypatch, tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    for name in ("params.json", "config.json", "tekken.json", "consolidated.safetensors", "model-00001-of-00002"
                 ".safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (remote / name).write_text("{}")
    fetched = fake_hub(monkeypatch, remote, tmp_path / "snapshot")
    loading._download("mistralai/both")
    assert "consolidated.safetensors" in fetched and not any(name.startswith("model-") for name in fetched)

def test_builtin_name(monkeypatch):
    monkeypatch.setitem(loading.BUILTIN_MODELS, "tiny-test", MISTRAL_DIR)
    assert loading.load_model("tiny-test").config.vocab_size == 256
    with pytest.raises(UserError, match="tiny-test"):  # unknown names list the built-in ones
        loading.load_model("no-such-model")
