"""Training the tiny model on a small synthesised corpus, which is built once per module, so every test that reads it
is here: examples and their aligned targets, the shared-prefix forward, greedy decoding, the optax step, `train` and
its checks, Orbax resume and export. Oracles: the front end's features (models/audio.py), the model's own offline
forward, the corpus's word timings, an uninterrupted run. The training pieces that need no corpus:
test_training_recipe.py."""
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import soundfile
from flax import nnx

from jaxstream.models import audio as front_end
from jaxstream.models.config import EncoderConfig, TextConfig, VoxtralConfig
from jaxstream.models.tokenizers import SentencePieceTokenizer
from jaxstream.models.voxtral import VoxtralRealtime
from jaxstream.training import data, targets
from jaxstream.training.config import TrainConfig
from jaxstream.training.decode import transcribe_batch
from jaxstream.training.step import (aligned_targets, init_ctc_head, learning_rate_schedule, make_optimizer,
                                     make_train_step, stream_logits)
from training_fixtures import TINY_TOML

SPM_VOCAB = 300
# The recipe of the steps that train here (three_step_runs), so that they share one compiled step: the tests' tiny
# one with the auxiliary losses (configs/tiny.toml trains with both), at a rate and over a schedule on which 10 steps
# of test_train_step_lowers_the_loss_on_a_fixed_batch learn.
RECIPE = TINY_TOML.replace("learning_rate = 0.003", "learning_rate = 0.01").replace(
    "total_steps = 3", "total_steps = 12\nctc_weight = 0.3\naligned_piece_weight = 0.3")


def tiny_config(vocab_size: int = 1000 + SPM_VOCAB) -> VoxtralConfig:
    return VoxtralConfig(
        encoder=EncoderConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=1, head_dim=32,
                              sliding_window=64),
        text=TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, sliding_window=32, tie_embeddings=True, ada_t_cond_dim=32))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed")
    from jaxstream.synth import CorpusSpec, generate_corpus

    out = tmp_path_factory.mktemp("corpus")
    records = generate_corpus(os.fspath(out), CorpusSpec(num_utterances=4, seed=11, max_words=4))
    return os.fspath(out), records


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jaxstream.synth import SentenceSampler
    from jaxstream.training.spm import train_sentencepiece

    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    train_sentencepiece(sorted(SentenceSampler().vocabulary), os.fspath(path), SPM_VOCAB)
    return SentencePieceTokenizer(path)


def test_example_features_and_tokens(corpus, tokenizer):
    corpus_dir, records = corpus
    import soundfile

    record = records[0]
    audio, _ = soundfile.read(os.path.join(corpus_dir, record["path"]), dtype="float32")
    mel, tokens, mask, text = data.load_example(corpus_dir, record, tokenizer, 6, cut_tail=False)
    offline = front_end.offline_features(audio, 6)
    assert tokens.size == offline.shape[0] // 8 == mask.size
    np.testing.assert_array_equal(mel, offline[8 * data.SHARED_PREFIX_SLOTS :])
    np.testing.assert_array_equal(offline[: 8 * data.SHARED_PREFIX_SLOTS], data._silence_mel_value())
    assert tokenizer.decode(tokens) == record["text"] == text
    assert (tokens == 33).sum() == len(record["words"])
    cut_mel, cut_tokens, _, _ = data.load_example(corpus_dir, record, tokenizer, 6)
    assert tokenizer.decode(cut_tokens) == record["text"] and cut_tokens.size <= tokens.size
    np.testing.assert_array_equal(cut_mel, mel[: cut_mel.shape[0]])


@pytest.mark.parametrize("n_delay", [2, 7])
def test_aligned_targets_sit_one_slot_after_each_word_ends(corpus, tokenizer, n_delay):
    corpus_dir, records = corpus
    for record in records:
        example = data.load_example(corpus_dir, record, tokenizer, n_delay, cut_tail=False)
        aligned, valid = aligned_targets(jnp.asarray(example.tokens[None]), jnp.full((1,), float(n_delay)))
        aligned, valid = np.asarray(aligned[0]), np.asarray(valid[0])
        assert valid.sum() == example.tokens.size - data.SHARED_PREFIX_SLOTS - n_delay
        assert valid[: int(valid.sum())].all()
        # Oracle: the word timings. Word w's marker is due on the audio slot after the one holding its last
        # sample, its pieces on the next slots, unless the previous word's pieces still occupy them.
        expected = np.full(aligned.size, 32)
        free = 0
        for word in record["words"]:
            slot = max(targets.word_end_slot(word["end"]) + 1 - data.SHARED_PREFIX_SLOTS, free)
            emitted = [33, *tokenizer.encode(word["word"])]
            expected[slot : slot + len(emitted)] = emitted
            free = slot + len(emitted)
        np.testing.assert_array_equal(aligned[valid == 1], expected[valid == 1])


def test_shared_prefix_forward_equals_offline_forward(corpus, tokenizer):
    corpus_dir, records = corpus
    cfg = tiny_config()
    model = VoxtralRealtime(cfg, rngs=nnx.Rngs(1))
    delays = [2, 9]
    examples = [data.load_example(corpus_dir, r, tokenizer, d, cut_tail=False) for r, d in zip(records, delays)]
    num_slots = max(example.tokens.size for example in examples)
    batch = data.collate(examples, delays, num_slots)
    assert batch.frames_valid.tolist() == [4 * (e.tokens.size - data.SHARED_PREFIX_SLOTS) for e in examples]
    for chars, padding, example in zip(batch.chars, batch.char_padding, examples):
        assert "".join(data.CTC_CHARACTERS[c - 1] for c in chars[padding == 0]) == example.text
    # Jitted: one compile each instead of an eager compile per op and shape.
    logits, _, _ = nnx.jit(stream_logits, static_argnums=1)(model, cfg, jnp.asarray(batch.mel),
                                                            jnp.asarray(batch.tokens), jnp.asarray(batch.n_delay))
    silence = np.full((2, 8 * data.SHARED_PREFIX_SLOTS, 128), data._silence_mel_value(), np.float32)
    full_mel = np.concatenate([silence, batch.mel], axis=1)
    expected = nnx.jit(VoxtralRealtime.offline_logits)(model, jnp.asarray(full_mel), jnp.asarray(batch.tokens),
                                                       jnp.asarray(batch.n_delay))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected)[:, data.SHARED_PREFIX_SLOTS:], rtol=2e-4,
                               atol=2e-4)


def test_greedy_decode_agrees_with_teacher_forced_argmax(corpus):
    corpus_dir, records = corpus
    import soundfile

    cfg = tiny_config(vocab_size=1040)
    model = VoxtralRealtime(cfg, rngs=nnx.Rngs(2))
    graphdef, params = nnx.split(model, nnx.Param)
    audios = [soundfile.read(os.path.join(corpus_dir, r["path"]), dtype="float32")[0] for r in records[:2]]
    n_delay = 3
    outputs = transcribe_batch(graphdef, params, audios, n_delay)
    prompt = front_end.prompt_length(n_delay)
    for audio, generated in zip(audios, outputs):
        num_slots = targets.num_stream_slots(audio.size, n_delay)
        assert len(generated) == num_slots - prompt
        tokens = np.array([1] + [32] * (prompt - 1) + generated, np.int32)
        mel = front_end.offline_features(audio, n_delay)
        logits = nnx.jit(VoxtralRealtime.offline_logits)(model, jnp.asarray(mel[None]), jnp.asarray(tokens[None]),
                                                         jnp.full((1,), float(n_delay)))
        assert np.argmax(np.asarray(logits[0, prompt - 1 : num_slots - 1]), -1).tolist() == generated


def test_train_command_checks_steps_against_the_cooldown(corpus, tmp_path, capsys):
    from jaxstream.cli import main

    corpus_dir, _ = corpus
    (tmp_path / "wsd.toml").write_text(TINY_TOML.replace("total_steps = 3", "total_steps = 3\ncooldown_steps = 2"))
    assert main(["train", "--config", os.fspath(tmp_path / "wsd.toml"), "--corpus", corpus_dir,
                 "--out", os.fspath(tmp_path / "run"), "--steps", "2", "--no-progress"]) == 2
    assert "--steps must be at least 3;" in capsys.readouterr().err
    assert main(["train", "--config", os.fspath(tmp_path / "wsd.toml"), "--corpus", corpus_dir,
                 "--out", os.fspath(tmp_path / "run"), "--until-step", "0", "--no-progress"]) == 2
    assert "--until-step must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _checkpoint_weights(run):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(run / "checkpoints") as manager:
        restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())
    return jax.tree.map(np.asarray, restored["weights"])


def test_vtlp_range_warps_every_training_example(corpus, tokenizer, tmp_path):
    from jaxstream.training import load_train_config
    from jaxstream.training.vtlp import warped_mel_filters

    (tmp_path / "vtlp.toml").write_text(TINY_TOML + "vtlp_range = [0.9, 0.9]\n")
    assert load_train_config(tmp_path / "vtlp.toml").vtlp_range == (0.9, 0.9)
    (tmp_path / "bad.toml").write_text(TINY_TOML + "vtlp_range = [1.1, 0.9]\n")
    with pytest.raises(ValueError, match=r"\[train\] vtlp_range must be \[low, high\]"):
        load_train_config(tmp_path / "bad.toml")

    corpus_dir, records = corpus
    batches = {}
    for name, vtlp_range in (("plain", ()), ("warped", (0.9, 0.9))):
        stream = data.BatchStream(corpus_dir, records[:1], tokenizer, batch_size=2, delays_slots=(6,), seed=3,
                                  vtlp_range=vtlp_range)
        batches[name] = next(stream)
        stream.close()
    example = data.load_example(corpus_dir, records[0], tokenizer, 6, mel_filters=warped_mel_filters(0.9))
    frames = example.mel.shape[0]
    for row in range(2):
        np.testing.assert_array_equal(batches["warped"].mel[row, :frames], example.mel)
        np.testing.assert_array_equal(batches["warped"].tokens[row], batches["plain"].tokens[row])
    assert not np.array_equal(batches["warped"].mel, batches["plain"].mel)


def test_a_long_example_is_its_utterances_as_one_recording(corpus, tokenizer, tmp_path):
    corpus_dir, records = corpus
    # Oracle: the same utterances written out as one recording with its words' times shifted by hand, loaded as
    # a single utterance (load_example: checked above against the front end and the word timings).
    audios = [soundfile.read(os.path.join(corpus_dir, r["path"]), dtype="float32")[0] for r in records[:3]]
    starts = np.cumsum([0] + [a.size for a in audios])[:-1] / 16000
    words = [{**w, "start": w["start"] + start, "end": w["end"] + start}
             for r, start in zip(records[:3], starts) for w in r["words"]]
    soundfile.write(tmp_path / "joined.wav", np.concatenate(audios), 16000, subtype="FLOAT")
    text = " ".join(r["text"] for r in records[:3])
    joined = {"path": "joined.wav", "words": words, "text": text}
    for n_delay in (2, 9):
        expected = data.load_example(os.fspath(tmp_path), joined, tokenizer, n_delay)
        example = data.load_long_example(corpus_dir, records[:3], tokenizer, n_delay)
        for got, want in zip(example, expected):
            np.testing.assert_array_equal(got, want)
        # Every word's marker; this tokenizer spells words letter by letter, so the last word's may spill past
        # the stream's end.
        assert (example.tokens == 33).sum() == len(words) and text.startswith(tokenizer.decode(example.tokens))


def test_long_stream_batches_join_whole_utterances_within_their_length(corpus, tokenizer):
    corpus_dir, records = corpus
    seconds = 9.0
    long_streams = data.LongStreams(fraction=1.0, seconds=seconds, from_step=2)
    streams = [data.BatchStream(corpus_dir, records, tokenizer, batch_size=4, delays_slots=(3, 6), seed=3,
                                long_streams=setting) for setting in (None, long_streams)]
    (plain, _), (first, second) = [[next(stream), next(stream)] for stream in streams]
    for stream in streams:
        stream.close()
    for got, want in zip(first, plain):  # before from_step: the batch a stream without long ones makes
        np.testing.assert_array_equal(got, want)
    # From from_step: half the rows, all padded to the slots of `seconds` of audio (+ a slot of margin).
    slots = data.bucket_slots(targets.num_stream_slots(int(seconds * 16000) + 1280, 6))
    assert second.tokens.shape == (2, slots) and second.mel.shape[1] == 8 * (slots - data.SHARED_PREFIX_SLOTS)
    texts = {r["text"]: r["duration"] for r in records}

    def split(text):  # the utterances whose texts, joined, make `text` (each one's text is whole)
        if not text:
            return []
        for candidate in texts:
            if text == candidate or text.startswith(candidate + " "):
                rest = split(text[len(candidate) + 1:])
                if rest is not None:
                    return [candidate, *rest]
        return None

    lengths = []
    for tokens, chars, padding in zip(second.tokens, second.chars, second.char_padding):
        text = "".join(data.CTC_CHARACTERS[c - 1] for c in chars[padding == 0])
        utterances = split(text)
        assert utterances and sum(texts[u] for u in utterances) <= seconds
        assert text.startswith(tokenizer.decode(tokens))  # spelled letter by letter, a last word may spill
        lengths.append(len(utterances))
    assert max(lengths) > 1  # utterances of 2-4 s: a row of 9 s holds several


def test_phoneme_ctc_targets_reach_the_batch_and_size_the_head(corpus, tokenizer, tmp_path, monkeypatch):
    from jaxstream.errors import UserError
    from jaxstream.training import load_train_config, loop, train
    from jaxstream.training.phonemes import PHONEME_CLASSES, PhonemeLexicon

    (tmp_path / "bad.toml").write_text(TINY_TOML + 'ctc_targets = "graphemes"\n')
    with pytest.raises(ValueError, match=r"\[train\] ctc_targets must be one of"):
        load_train_config(tmp_path / "bad.toml")
    (tmp_path / "phonemes.toml").write_text(TINY_TOML + 'ctc_targets = "phonemes"\n')
    cfg = load_train_config(tmp_path / "phonemes.toml")
    assert cfg.ctc_targets == "phonemes"

    corpus_dir, records = corpus
    lexicon = PhonemeLexicon(records)
    stream = data.BatchStream(corpus_dir, records[:1], tokenizer, batch_size=2, delays_slots=(6,), seed=3,
                              ctc_labels=lexicon.ctc_labels)
    batch = next(stream)
    stream.close()
    for row in range(2):
        np.testing.assert_array_equal(batch.chars[row][batch.char_padding[row] == 0], lexicon.ctc_labels(records[0]))

    # What the targets change is the batch and the head, both in place before the first step runs, so the run's
    # step only records its batches: a compiled one (~13 s) would check nothing more (the recipe's ctc_weight of
    # 0 leaves the head out of the loss).
    trained = []

    def recording_step(weights, opt_state, batch):
        trained.append(batch)
        return weights, opt_state, {"loss": 0.0, "accuracy": 0.0}

    monkeypatch.setattr(loop, "make_train_step", lambda *key: recording_step)
    run = tmp_path / "run"
    train(cfg, corpus_dir, os.fspath(run), steps=1, progress=False)
    assert _checkpoint_weights(run)["ctc_head"]["bias"].shape == (PHONEME_CLASSES,)
    expected = [lexicon.ctc_labels(record) for record in records]
    (trained_batch,) = trained
    for labels, padding in zip(trained_batch.chars, trained_batch.char_padding):
        assert any(np.array_equal(labels[padding == 0], phonemes) for phonemes in expected), labels
    (tmp_path / "characters.toml").write_text(TINY_TOML)
    characters = load_train_config(tmp_path / "characters.toml")
    with pytest.raises(UserError, match=rf"its CTC head predicts {PHONEME_CLASSES} classes; the recipe's "
                                        rf"ctc_targets = 'characters' need {data.CTC_CLASSES}$"):
        train(characters, corpus_dir, os.fspath(tmp_path / "from_phonemes"), steps=1, init_from=os.fspath(run),
              progress=False)


def test_train_refuses_a_corpus_without_word_timings(corpus, tmp_path):
    from jaxstream.errors import UserError
    from jaxstream.training import load_train_config, train

    corpus_dir, records = corpus
    flite_like = tmp_path / "flite"
    shutil.copytree(corpus_dir, flite_like)
    (flite_like / "manifest.jsonl").write_text(
        "".join(json.dumps({**record, "words": [], "engine": "flite"}) + "\n" for record in records))
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    with pytest.raises(UserError, match="no word timings"):
        train(load_train_config(tmp_path / "tiny.toml"), os.fspath(flite_like), os.fspath(tmp_path / "run"),
              progress=False)


def test_several_corpora_pool_their_utterances(corpus, tmp_path):
    from jaxstream.training.loop import read_corpora

    corpus_dir, records = corpus
    other = tmp_path / "other"
    shutil.copytree(corpus_dir, other)
    pooled = read_corpora([corpus_dir, os.fspath(other)])
    assert len(pooled) == 2 * len(records)
    for record in pooled:
        assert os.path.isfile(record["path"]) and record["path"].startswith((corpus_dir, os.fspath(other)))


def test_a_failing_batch_loader_stops_training_instead_of_hanging(corpus, tokenizer, tmp_path):
    from jaxstream.errors import UserError

    corpus_dir, records = corpus
    broken = [{**record, "path": "missing.flac"} for record in records]
    audio, _ = soundfile.read(os.path.join(corpus_dir, records[0]["path"]), dtype="float32")
    soundfile.write(tmp_path / "8k.flac", audio[::2], 8000)
    telephone = [{**record, "path": os.fspath(tmp_path / "8k.flac")} for record in records]
    # The corpus's fault, so one line for the user, not a traceback.
    for bad, message in ((broken, "missing.flac"), (telephone, "expected 16000 Hz audio, got 8000")):
        stream = data.BatchStream(corpus_dir, bad, tokenizer, batch_size=2, delays_slots=(6,), seed=0)
        try:
            with pytest.raises(UserError, match=f"batch loader failed: .*{message}"):
                next(stream)
        finally:
            stream.close()


class ThreeStepRuns(NamedTuple):
    root: Path
    cfg: TrainConfig
    batch_shapes: list  # the shapes of the arrays of each batch the runs trained on, in order
    programs: int  # the programs their train step compiled


def _first_batches(cfg: TrainConfig, corpus_dir: str, tokenizer, count: int) -> list[data.Batch]:
    """The first `count` batches a run of `cfg` on the corpus trains on (the loop's stream, seeded alike)."""
    from jaxstream.training.loop import read_corpora

    stream = data.BatchStream("", read_corpora([corpus_dir]), tokenizer, batch_size=cfg.batch_size, seed=cfg.seed,
                              delays_slots=tuple(front_end.n_delay_from_ms(ms) for ms in cfg.delays_ms))
    try:
        return [next(stream) for _ in range(count)]
    finally:
        stream.close()


@pytest.fixture(scope="module")
def three_step_runs(corpus, tmp_path_factory) -> ThreeStepRuns:
    """RECIPE trained 3 steps (of its 12) in one call ("whole") and in three, resumed after steps 1 and 2
    ("resumed"; the model it exported after step 1 kept as "model_after_step_1"). The runs share a train step
    of their own, not make_train_step's process-wide one, which other runs in this process fill, so that the
    programs it compiled can be counted; their seed is the first whose three batches pad to one shape, so that
    there is one program to compile (~10 s on CI's CPU), not one per shape."""
    from jaxstream.training import load_train_config, loop, train

    corpus_dir, records = corpus
    root = tmp_path_factory.mktemp("three_steps")
    (root / "tiny.toml").write_text(RECIPE)
    cfg = load_train_config(root / "tiny.toml")
    # The runs' own tokenizer: a word model gives every word of the corpus one piece.
    tokenizer = loop.ensure_tokenizer(loop.RunPaths(root), records, cfg.spm_vocab_size, cfg.spm_model_type)

    def one_shape(seed: int) -> bool:
        batches = _first_batches(dataclasses.replace(cfg, seed=seed), corpus_dir, tokenizer, 3)
        return len({tuple(array.shape for array in batch) for batch in batches}) == 1

    seed = next(seed for seed in range(100) if one_shape(seed))
    (root / "tiny.toml").write_text(RECIPE + f"seed = {seed}\n")
    cfg = load_train_config(root / "tiny.toml")
    own_steps, shapes = {}, []

    def own_step(*key):
        if key not in own_steps:
            own_steps[key] = make_train_step.__wrapped__(*key)

        def step(weights, opt_state, batch):
            shapes.append(tuple(array.shape for array in batch))
            return own_steps[key](weights, opt_state, batch)
        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "make_train_step", own_step)
        train(cfg, corpus_dir, os.fspath(root / "whole"), until_step=3, progress=False)
        train(cfg, corpus_dir, os.fspath(root / "resumed"), until_step=1, progress=False)
        shutil.copytree(root / "resumed" / "model", root / "model_after_step_1")
        train(cfg, corpus_dir, os.fspath(root / "resumed"), until_step=2, progress=False)
        train(cfg, corpus_dir, os.fspath(root / "resumed"), until_step=3, progress=False)
    (step,) = own_steps.values()
    return ThreeStepRuns(root, cfg, shapes, step._cache_size())


def test_train_step_lowers_the_loss_on_a_fixed_batch(corpus, three_step_runs):
    from jaxstream.training.config import with_vocab_size

    # The runs' step on their first batch, with arguments like the loop's: the program three_step_runs compiled.
    root, cfg = three_step_runs.root, three_step_runs.cfg
    tokenizer = SentencePieceTokenizer(root / "whole" / "tokenizer.model")
    cfg = with_vocab_size(cfg, tokenizer.vocab_size)
    (batch,) = _first_batches(cfg, corpus[0], tokenizer, 1)
    graphdef, params = nnx.split(VoxtralRealtime(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param)
    weights = jax.device_put({"model": params, "ctc_head": init_ctc_head(cfg.model, cfg.seed)}, jax.local_devices()[0])
    opt_state = jax.device_put(make_optimizer(cfg.optimizer).init(weights), jax.local_devices()[0])
    step = make_train_step(graphdef, cfg.model, cfg.optimizer)
    losses, ctc, aligned = [], [], []
    for _ in range(10):
        weights, opt_state, metrics = step(weights, opt_state, batch)
        losses.append(float(metrics["loss"]))
        ctc.append(float(metrics["ctc"]))
        aligned.append(float(metrics["aligned"]))
    assert losses[-1] < 0.7 * losses[0] and ctc[-1] < 0.85 * ctc[0] and aligned[-1] < 0.85 * aligned[0], \
        (losses, ctc, aligned)


def _logged_losses(run):
    return [(entry["step"], entry["loss"], entry["accuracy"])
            for entry in map(json.loads, (run / "log.jsonl").read_text().splitlines())]


def test_train_resumes_and_exports_a_loadable_model(three_step_runs):
    from jaxstream.models.loading import load_model
    from jaxstream.training.config import with_vocab_size
    from jaxstream.training.spelling import init_word_embeddings

    root, cfg = three_step_runs.root, three_step_runs.cfg
    out = root / "resumed"
    # The recipe's word tokenizer sizes the decoder; spelling_init set the word rows before step 1.
    word_tokenizer = SentencePieceTokenizer(out / "tokenizer.model")
    cfg = with_vocab_size(cfg, word_tokenizer.vocab_size)
    fresh = VoxtralRealtime(cfg.model, rngs=nnx.Rngs(cfg.seed)).language_model.embed_tokens.embedding[...]
    expected = init_word_embeddings(np.asarray(fresh), word_tokenizer, cfg.seed)
    exported = load_model(root / "model_after_step_1", dtype=jnp.float32).model
    after_one_step = np.asarray(exported.language_model.embed_tokens.embedding[...])
    np.testing.assert_allclose(after_one_step, expected, atol=5 * cfg.optimizer.learning_rate)  # Adam moves <= ~lr
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1, 2, 3]  # each later run resumed where the one before stopped
    assert all(entry["cpu_seconds"] > 0 for entry in logged)  # each sitting's CPU so far: the run's cost
    # ... on the recipe's schedule: stopping early (until_step) did not shorten it.
    schedule = learning_rate_schedule(cfg.optimizer)
    assert [entry["learning_rate"] for entry in logged] == [float(schedule(step)) for step in range(3)]
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(out / "checkpoints") as manager:
        assert manager.latest_step() == 3
        saved = manager.restore(3)["weights"]["model"]
    loaded = load_model(out / "model", dtype=jnp.float32)
    assert loaded.config == cfg.model and loaded.tokenizer_path.name == "tokenizer.model"
    exported = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resumed_run_trains_on_the_batches_of_an_uninterrupted_one(three_step_runs):
    root = three_step_runs.root
    assert [step for step, _, _ in _logged_losses(root / "resumed")] == [1, 2, 3]
    assert _logged_losses(root / "resumed") == _logged_losses(root / "whole")
    for a, b in zip(jax.tree.leaves(_checkpoint_weights(root / "whole")),
                    jax.tree.leaves(_checkpoint_weights(root / "resumed")), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_run_compiles_its_step_once_per_batch_shape(three_step_runs):
    """A fresh run's first step must get arguments of the kind a step returns (committed to the device), or its
    batch's shape compiles twice: for step 1, and again for the next batch of that shape (~10 s each for the tiny
    model). Oracle: the programs the three-step runs' own step compiled for their batches of one shape."""
    shapes = three_step_runs.batch_shapes
    assert len(shapes) == 6 and len(set(shapes)) == 1
    assert three_step_runs.programs == 1


def test_train_refuses_a_target_below_the_runs_step(corpus, three_step_runs, capsys):
    from jaxstream.cli import main
    from jaxstream.errors import UserError
    from jaxstream.training import train

    corpus_dir, _ = corpus
    root, cfg = three_step_runs.root, three_step_runs.cfg
    run = root / "whole"
    with pytest.raises(UserError, match="already at step 3, past the requested last step 2"):
        train(cfg, corpus_dir, os.fspath(run), until_step=2, progress=False)
    with pytest.raises(UserError, match="already at step 3, past the requested last step 1"):
        train(cfg, corpus_dir, os.fspath(run), steps=1, progress=False)
    assert main(["train", "--config", os.fspath(root / "tiny.toml"), "--corpus", corpus_dir, "--out", os.fspath(run),
                 "--until-step", "3", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"{run} is already at step 3: nothing to train"
    assert [step for step, _, _ in _logged_losses(run)] == [1, 2, 3]


def test_resuming_with_another_architecture_names_the_differences(corpus, three_step_runs, tmp_path):
    from jaxstream.errors import UserError
    from jaxstream.training import train

    corpus_dir, _ = corpus
    root, cfg = three_step_runs.root, three_step_runs.cfg
    shutil.copytree(root / "resumed", tmp_path / "run")
    wider = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, encoder=dataclasses.replace(cfg.model.encoder, intermediate_size=96)))
    with pytest.raises(UserError, match=r"another architecture than the recipe's \[model\]: encoder.intermediate_size: "
                                        r"model 64, recipe 96; use a fresh --out$"):
        train(wider, corpus_dir, os.fspath(tmp_path / "run"), steps=5, progress=False)


def test_init_from_starts_from_the_models_weights_and_tokenizer(corpus, three_step_runs, tmp_path, monkeypatch):
    from jaxstream.errors import UserError
    from jaxstream.models.loading import load_model
    from jaxstream.training import train

    corpus_dir, _ = corpus
    root, cfg = three_step_runs.root, three_step_runs.cfg
    source = root / "whole"
    # A fine-tune starts a fresh schedule, whose first step runs at the warmup's lr of 0, where AdamW moves
    # nothing: a run stopped there must hold the source's weights, bit for bit: the exported model's from a model
    # directory, and the CTC head's too from a run directory (named relative to the working directory: Orbax
    # restores only from absolute paths). Its step is the recipe's on the recipe's first batch: the program
    # three_step_runs compiled, read back from the tests' compilation cache.
    monkeypatch.chdir(root)
    for name, init_from in (("from_model", source / "model"), ("from_run", "whole")):
        train(cfg, corpus_dir, os.fspath(tmp_path / name), until_step=1, init_from=os.fspath(init_from),
              progress=False)
        logged = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        assert [(entry["step"], entry["learning_rate"]) for entry in logged] == [(1, 0.0)]
        assert (tmp_path / name / "tokenizer.model").read_bytes() == (source / "tokenizer.model").read_bytes()
        before, after = (nnx.to_pure_dict(nnx.state(load_model(path, dtype=jnp.float32).model, nnx.Param))
                         for path in (source / "model", tmp_path / name / "model"))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    source_head, from_run_head, from_model_head = (
        _checkpoint_weights(path)["ctc_head"] for path in (source, tmp_path / "from_run", tmp_path / "from_model"))
    np.testing.assert_array_equal(from_run_head["kernel"], source_head["kernel"])
    assert not np.array_equal(from_model_head["kernel"], source_head["kernel"])  # a model carries no CTC head

    wider = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, encoder=dataclasses.replace(cfg.model.encoder, intermediate_size=96)))
    with pytest.raises(UserError, match=r"differs from the recipe's \[model\]: encoder.intermediate_size: model 64, "
                                        r"recipe 96$"):
        train(wider, corpus_dir, os.fspath(tmp_path / "wider"), steps=1, init_from=os.fspath(source / "model"),
              progress=False)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copyfile(root / "tiny.toml", other / "tokenizer.model")  # any other bytes
    with pytest.raises(UserError, match="different tokenizer"):
        train(cfg, corpus_dir, os.fspath(other), steps=1, init_from=os.fspath(source / "model"), progress=False)


def test_a_failed_init_from_writes_nothing_to_the_run(corpus, three_step_runs, tmp_path):
    from jaxstream.errors import UserError
    from jaxstream.training import train

    corpus_dir, _ = corpus
    root, cfg = three_step_runs.root, three_step_runs.cfg
    wider = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, encoder=dataclasses.replace(cfg.model.encoder, intermediate_size=96)))
    with pytest.raises(UserError, match="its architecture differs"):
        train(wider, corpus_dir, os.fspath(tmp_path / "run"), steps=1, init_from=os.fspath(root / "whole"),
              progress=False)
    assert not (tmp_path / "run").exists()  # a retry must not find the source's tokenizer there


def test_train_checks_the_corpus_audio_before_training(corpus, tmp_path):
    from jaxstream.errors import UserError
    from jaxstream.training import load_train_config, train

    corpus_dir, records = corpus
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    cfg = load_train_config(tmp_path / "tiny.toml")
    telephone, missing = tmp_path / "telephone", tmp_path / "missing"
    shutil.copytree(corpus_dir, telephone)
    shutil.copytree(corpus_dir, missing)
    audio, _ = soundfile.read(telephone / records[-1]["path"], dtype="float32")
    soundfile.write(telephone / records[-1]["path"], audio[::2], 8000)
    os.remove(missing / records[-1]["path"])
    for bad, message in ((telephone, "is sampled at 8000 Hz; training needs 16000 Hz"),
                         (missing, "cannot read the corpus audio")):
        with pytest.raises(UserError, match=message):
            train(cfg, os.fspath(bad), os.fspath(tmp_path / "run"), progress=False)
    # A held-out set may be 8 kHz (it is resampled), not incomplete.
    with pytest.raises(UserError, match="cannot read the corpus audio"):
        train(cfg, corpus_dir, os.fspath(tmp_path / "run"), eval_corpus_dir=os.fspath(missing), progress=False)
    assert not (tmp_path / "run").exists()

