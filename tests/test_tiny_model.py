"""The shipped tiny model through `jaxstream eval` (loader, front end, engine, tokenizer) on a freshly
generated held-out set (sentences and espeak-ng voice variants never used in training).

Documented bounds, from the model card (models/assets/tiny/MODEL_CARD.md): on 300 held-out utterances the
shipped checkpoint scores WER 0.097 / CER 0.045 at its default 480 ms delay, and on this test's 8 utterances
(seed 2024) WER 0.125 / CER 0.035; the previous checkpoints scored 0.075 / 0.027, 0.10 / 0.05 and 0.45 / 0.24
here and an untrained model of the same shape ~10.9 / ~7.7. The bounds leave room for synthesizer differences
across machines and still catch a broken or regressed checkpoint, loader, front end or decoding loop; tighten
them as the model improves (the project's target is WER <= 0.10 on the 300).
"""
import json
import os
import shutil
from pathlib import Path

import pytest

ASSET_DIR = Path(__file__).resolve().parents[1] / "models" / "assets" / "tiny"
WER_BOUND = 0.25
CER_BOUND = 0.12


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed (.ci/run installs it)")
def test_shipped_tiny_model_transcribes_held_out_speech(tmp_path):
    from jaxstream.cli import main
    from jaxstream.synth import CorpusSpec, generate_corpus

    corpus = tmp_path / "heldout"
    records = generate_corpus(os.fspath(corpus), CorpusSpec(num_utterances=8, seed=2024, held_out=True, max_words=6))
    report = tmp_path / "report.json"
    assert main(["eval", os.fspath(corpus), "--model", os.fspath(ASSET_DIR), "--concurrency", "8",
                 "--report", os.fspath(report)]) == 0
    summary = json.loads(report.read_text())["runs"][0]["summary"]
    assert summary["transcribed"] == len(records)
    assert summary["wer"] <= WER_BOUND and summary["cer"] <= CER_BOUND, summary


def test_tiny_preset_reproduces_the_shipped_architecture():
    """`jaxstream train --config tiny` is the shipped model's recipe: same [model] block, the decoder vocabulary
    sized from the tokenizer it trains."""
    from jaxstream.commands.train import resolve_config_path
    from jaxstream.models.loading import inspect_checkpoint, resolve_model_dir
    from jaxstream.training import load_train_config
    from jaxstream.training.config import with_vocab_size

    shipped = inspect_checkpoint(resolve_model_dir("tiny")).config
    recipe = load_train_config(resolve_config_path("tiny"))
    assert with_vocab_size(recipe, shipped.text.vocab_size).model == shipped


def test_v2_recipe_is_a_subword_model_with_room_for_a_sentence():
    """configs/tiny_v2.toml, the recipe in training (models/assets/tiny/MODEL_CARD.md, "v2 in progress"): it
    replaces configs/tiny.toml, and the test above then compares the shipped model with it, once v2 ships."""
    from jaxstream.commands.train import resolve_config_path
    from jaxstream.models import audio as front_end
    from jaxstream.training import load_train_config

    recipe = load_train_config(resolve_config_path("tiny_v2"))
    assert recipe.spm_model_type == "bpe" and 2000 <= recipe.spm_vocab_size <= 4000
    # A 20-word sentence at espeak-ng's slowest training rate (125 words a minute) is 9.6 s: the decoder sees it
    # whole, with the 480 ms default delay.
    slot_seconds = front_end.SAMPLES_PER_SLOT / front_end.SAMPLING_RATE
    assert recipe.model.text.sliding_window * slot_seconds >= 20 / 125 * 60 + 0.48
    assert recipe.optimizer.ctc_weight > 0 and recipe.optimizer.aligned_piece_weight > 0
    assert recipe.optimizer.cooldown_steps > 0  # warmup-stable-decay: the end can move until the cooldown
