"""One-line mistakes (`jaxstream COMMAND: error: ...`, exit 2) of commands whose own test files are about other
things: training's corpora and run directory, the engine benchmark's count lists, and a model `serve` cannot
load. Each names what was wrong and is found before any long work."""
import pytest

from jaxstream import cli
from jaxstream.synth.corpus import MANIFEST_NAME


@pytest.mark.parametrize("flag, value", [("--steps-per-dispatch", "0"), ("--batch-buckets", "0"), ("--streams", "x")])
def test_bench_count_lists_name_their_own_flag(flag, value, capsys):
    """`--steps-per-dispatch 0` and `--batch-buckets 0` both said "--streams must be positive integers"."""
    assert cli.main(["bench", flag, value]) == 2
    assert capsys.readouterr().err == (f"jaxstream bench: error: {flag} must be positive integers separated by "
                                       f"commas, got '{value}'\n")


@pytest.fixture
def corpus(tmp_path):
    """A corpus folder as the command checks it (its manifest may be empty: the run never starts)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text("")
    return folder


def test_train_corpus_mistakes_name_the_flag(tmp_path, corpus, capsys):
    """`--corpus nope` said "nope has no manifest.jsonl" for a folder that does not exist."""
    missing, a_file = tmp_path / "nope", tmp_path / "x.wav"
    a_file.write_bytes(b"RIFF")
    for args, message in [
        (["--corpus", str(missing)], f"--corpus {missing}: no such directory"),
        (["--corpus", str(corpus), str(a_file)],
         f"--corpus {a_file}: not a directory (a corpus is the folder `jaxstream synth` wrote)"),
        (["--corpus", str(tmp_path)],
         f"--corpus {tmp_path} has no {MANIFEST_NAME}: generate it with `jaxstream synth`"),
        (["--corpus", str(corpus), "--eval-corpus", str(missing)], f"--eval-corpus {missing}: no such directory"),
    ]:
        assert cli.main(["train", *args, "--out", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err == f"jaxstream train: error: {message}\n"
    assert not (tmp_path / "run").exists()


def test_train_out_that_cannot_be_a_run_directory(tmp_path, corpus, capsys):
    """`--out x.wav` (an existing file) was a FileExistsError traceback from the run directory's mkdir, after
    the corpus (and any --init-from model) had been read."""
    a_file = tmp_path / "x.wav"
    a_file.write_bytes(b"RIFF")
    unmakeable = "/proc/jaxstream-train-test"  # /proc takes no new folders, even from root
    for out, message in [(a_file, f"--out {a_file}: {a_file} is not a directory"),
                         (a_file / "run", f"--out {a_file / 'run'}: {a_file} is not a directory"),
                         (unmakeable, f"cannot create --out {unmakeable}: No such file or directory")]:
        assert cli.main(["train", "--corpus", str(corpus), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"jaxstream train: error: {message}\n"


def test_transcribe_refuses_a_text_model_before_loading_it(capsys, monkeypatch):
    """A text LM given to `transcribe` was loaded and compiled, then ended in a 22-line traceback
    (InvalidRequestError: transcription needs a Voxtral Realtime model); `eval` already said it in a line."""
    from pathlib import Path

    from jaxstream.engine import async_engine

    fixtures = Path(__file__).parent / "fixtures"
    sample = Path(__file__).parents[1] / "models" / "assets" / "samples" / "sample.wav"

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(async_engine.AsyncEngine, "from_pretrained", no_loading)
    model = str(fixtures / "llama_tiny")
    assert cli.main(["transcribe", "--model", model, str(sample)]) == 2
    assert capsys.readouterr().err == (f"jaxstream transcribe: error: model {model!r} is a text model; jaxstream "
                                       "transcribe needs a speech-to-text (Voxtral Realtime) model\n")


def test_serve_says_a_model_it_cannot_load_once(tmp_path):
    """`jaxstream serve nosuchmodel` printed its error twice: the app's `ERROR jaxstream.serving.app: loading the
    model failed: ...` log line, then the command's own. As a user runs it (a process: the log goes to stderr)."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "nosuchmodel"
    done = subprocess.run([sys.executable, "-m", "jaxstream", "serve", str(missing), "--host", "127.0.0.1", "--port",
                           "0"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"jaxstream serve: error: model {str(missing)!r} not found: not a built-in name (tiny), a local directory or a "
        "Hugging Face repo id (org/name)"], done.stderr
