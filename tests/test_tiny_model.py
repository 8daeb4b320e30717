"""The shipped tiny model through `jaxstream eval` (loader, front end, engine, tokenizer) on freshly generated
held-out sets: natural sentences from the sources training never read, spoken by the held-out espeak-ng
voices, by flite (an engine training never heard) and over a phone line written at 8 kHz, 8 utterances each.

Documented bounds, from the model card (models/assets/tiny/MODEL_CARD.md): the shipped checkpoint (v3) scores
WER 26.6 / 80.1 / 32.6 % on the 300-utterance sets (a) / (b) / (c) and 28.8 / 83.6 / 39.7 % (CER 13.0 / 53.7 /
15.9 %) on these 8-utterance sets (seed 2024); v2 scored 34.2 / 82.2 / 38.4 % (CER 18.4 / 60.6 / 21.5 %) on them,
v1 (word lists) 83 / 99 / 99 % on the first 100 of (a) / (b) / (c). The bounds leave room for synthesizer
differences across machines and still catch a broken or regressed checkpoint, loader, front end or decoding loop;
tighten them as the model improves.
"""
import json
import os
import shutil
from pathlib import Path

import pytest

ASSET_DIR = Path(__file__).resolve().parents[1] / "models" / "assets" / "tiny"
SETS = {  # name: (CorpusSpec fields, the synthesizer it needs, WER bound, CER bound)
    "espeak": ({}, "espeak-ng", 0.45, 0.25),
    "flite": ({"engines": (("flite", 1.0),)}, "flite", 1.0, 0.70),
    "telephone": ({"telephone": 1.0}, "espeak-ng", 0.55, 0.28),
}


def test_shipped_tiny_model_transcribes_held_out_sentences(tmp_path):
    """The three sets in one `jaxstream eval` run (one engine), through one manifest naming each set's files;
    each set's WER and CER recomputed with jiwer from the report's normalized texts."""
    import jiwer

    from jaxstream.cli import main
    from jaxstream.synth import CorpusSpec, generate_corpus, sentences

    if not sentences.wordnet_installed():
        pytest.skip("wordnet-base not installed (.ci/run installs it)")
    sets = [name for name, (_, synthesizer, _, _) in SETS.items() if shutil.which(synthesizer) is not None]
    if not sets:
        pytest.skip("neither espeak-ng nor flite is installed (.ci/run installs them)")
    rows = []
    for name in sets:
        records = generate_corpus(os.fspath(tmp_path / name), CorpusSpec(num_utterances=8, seed=2024, held_out=True,
                                                                         text="sentences", **SETS[name][0]))
        assert len(records) == 8
        rows += [{"id": f"{name}/{row['id']}", "audio": f"{name}/{row['path']}", "text": row["text"]}
                 for row in records]
    manifest = tmp_path / "all.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = tmp_path / "report.json"
    assert main(["eval", os.fspath(manifest), "--model", os.fspath(ASSET_DIR), "--concurrency", "8",
                 "--report", os.fspath(report)]) == 0
    utterances = json.loads(report.read_text())["runs"][0]["utterances"]
    assert sorted(u["id"] for u in utterances) == sorted(row["id"] for row in rows)
    assert all(u["error"] is None for u in utterances)
    rates = {}
    for name in sets:
        pairs = [(u["reference_normalized"], u["hypothesis_normalized"]) for u in utterances
                 if u["id"].startswith(f"{name}/")]
        references, hypotheses = map(list, zip(*pairs))
        rates[name] = jiwer.wer(references, hypotheses), jiwer.cer(references, hypotheses)
    for name, (wer, cer) in rates.items():
        assert wer <= SETS[name][2] and cer <= SETS[name][3], rates


def test_tiny_preset_reproduces_the_shipped_architecture():
    """`jaxstream train --config tiny` is the shipped model's recipe: same [model] block, the decoder vocabulary
    sized from the tokenizer it trains."""
    from jaxstream.commands.train import resolve_config_path
    from jaxstream.models.checkpoint_metadata import inspect_checkpoint
    from jaxstream.models.loading import resolve_model_dir
    from jaxstream.training import load_train_config
    from jaxstream.training.config import with_vocab_size

    shipped = inspect_checkpoint(resolve_model_dir("tiny")).config
    recipe = load_train_config(resolve_config_path("tiny"))
    assert with_vocab_size(recipe, shipped.text.vocab_size).model == shipped


def test_tiny_recipe_is_a_subword_model_with_room_for_a_sentence():
    """configs/tiny.toml (models/assets/tiny/MODEL_CARD.md): an open vocabulary and a decoder window that holds
    a whole sentence."""
    from jaxstream.commands.train import resolve_config_path
    from jaxstream.models import audio as front_end
    from jaxstream.training import load_train_config

    recipe = load_train_config(resolve_config_path("tiny"))
    assert recipe.spm_model_type == "bpe" and 2000 <= recipe.spm_vocab_size <= 4000
    # A 20-word sentence at espeak-ng's slowest training rate (125 words a minute) is 9.6 s: the decoder sees it
    # whole, with the 480 ms default delay.
    slot_seconds = front_end.SAMPLES_PER_SLOT / front_end.SAMPLING_RATE
    assert recipe.model.text.sliding_window * slot_seconds >= 20 / 125 * 60 + 0.48
    assert recipe.optimizer.ctc_weight > 0 and recipe.optimizer.aligned_piece_weight > 0
    assert recipe.optimizer.cooldown_steps > 0  # warmup-stable-decay: the end can move until the cooldown
