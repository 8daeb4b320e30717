"""The pieces of the tiny model's training that need no corpus: delayed-streams targets, the sentencepiece
tokenizers and spelling init, the learning-rate schedule and the recipe's checks, WER, the held-out sample and its
resampling, and the training compiler options. Oracles: the front end's padding (models/audio.py), the slots written
out by hand, jiwer, sentencepiece's own encoding. Training on a corpus: test_training.py."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import soundfile

from jaxstream.models import audio as front_end
from jaxstream.models.tokenizers import SentencePieceTokenizer
from jaxstream.training import data, targets
from jaxstream.training.decode import word_error_rate
from jaxstream.training.step import OptimizerConfig, learning_rate_schedule
from training_fixtures import TINY_TOML


@pytest.mark.parametrize("num_samples", [1, 1279, 1280, 1281, 50_000])
@pytest.mark.parametrize("n_delay", [2, 6, 12])
def test_stream_slots_match_front_end_padding(num_samples, n_delay):
    padded = front_end.pad_for_offline(np.zeros(num_samples, np.float32), n_delay)
    assert targets.num_stream_slots(num_samples, n_delay) * front_end.SAMPLES_PER_SLOT == padded.size


@pytest.mark.parametrize("n_delay", [2, 6, 12])
def test_stream_tokens_prompt_markers_and_spill(n_delay):
    ends = [0.0001, 0.30, 0.33, 1.0]  # the second and third words end in the same slot: the third spills
    pieces = [[1001], [1002, 1003, 1004], [1005], [1006, 1007]]
    num_slots = targets.num_stream_slots(16000 * 2, n_delay)
    tokens, used = targets.stream_tokens(ends, pieces, n_delay, num_slots)
    prompt = front_end.prompt_length(n_delay)
    assert tokens[:prompt].tolist() == [1] + [32] * (prompt - 1)
    # Oracle: walk the slots in time; a word may start once the prediction made at the previous position
    # has seen n_delay whole slots after the slot of the word's last sample, and only on a free slot.
    expected = [32] * num_slots
    expected[0] = 1
    free = prompt
    for end, word_pieces in zip(ends, pieces):
        last_sample = int(np.ceil(end * 16000)) - 1
        position = free
        while (position - 1) - (32 + last_sample // 1280) < n_delay:
            position += 1
        for offset, token in enumerate([33] + word_pieces):
            expected[position + offset] = token
        free = position + 1 + len(word_pieces)
    assert tokens.tolist() == expected and used == free
    assert tokens[prompt] == 33  # a word ending in the first audio slot is written at the first output
    mask = targets.loss_mask(num_slots, n_delay)
    assert mask.sum() == num_slots - prompt and mask[prompt - 1] == 1 and mask[-1] == 0


def test_word_tokenizer_keeps_each_word_whole_and_encodes_any_text(tmp_path):
    from jaxstream.synth import SentenceSampler
    from jaxstream.training.spm import train_sentencepiece

    vocabulary = sorted(SentenceSampler().vocabulary)
    path = tmp_path / "word.model"
    train_sentencepiece(vocabulary, os.fspath(path), 4000, model_type="word")
    word_tokenizer = SentencePieceTokenizer(path)
    assert word_tokenizer.vocab_size == 1000 + len(vocabulary) + 256 + 3
    assert all(len(word_tokenizer.encode(word)) == 1 for word in vocabulary)
    # Unseen words fall back to bytes (their word-boundary mark too, which sentencepiece itself decodes as
    # U+2581 rather than a space); the known word after them decodes normally.
    unseen = "zyzzogeton ünïcode kitchen"
    assert word_tokenizer.decode(word_tokenizer.encode(unseen)) == "\u2581zyzzogeton\u2581ünïcode kitchen"
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(vocabulary, os.fspath(tmp_path / "x.model"), 100, model_type="char-ngram")


@pytest.mark.parametrize("cooldown", [0, 40])
def test_learning_rate_schedule_warms_up_holds_then_cools_down(cooldown):
    peak, end_fraction, warmup, total = 2e-3, 0.05, 10, 100
    schedule = learning_rate_schedule(OptimizerConfig(learning_rate=peak, warmup_steps=warmup, total_steps=total,
                                                      final_lr_fraction=end_fraction, cooldown_steps=cooldown))
    decay_start = total - cooldown if cooldown else warmup

    def expected(t):
        if t < warmup:
            return peak * t / warmup
        if t < decay_start:
            return peak
        progress = min(t - decay_start, total - decay_start) / (total - decay_start)
        return peak * (end_fraction + (1 - end_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))

    steps = [0, 5, 10, 11, 59, 60, 61, 75, 99, 100, 150]
    np.testing.assert_allclose([float(schedule(t)) for t in steps], [expected(t) for t in steps], rtol=1e-5)


def test_recipe_reads_and_checks_cooldown_steps(tmp_path):
    from jaxstream.training import load_train_config

    (tmp_path / "wsd.toml").write_text(TINY_TOML.replace("total_steps = 3", "total_steps = 3\ncooldown_steps = 2"))
    assert load_train_config(tmp_path / "wsd.toml").optimizer.cooldown_steps == 2
    (tmp_path / "bad.toml").write_text(TINY_TOML.replace("total_steps = 3", "total_steps = 3\ncooldown_steps = 3"))
    with pytest.raises(ValueError, match=r"cooldown_steps must be between 0 and total_steps - warmup_steps \(2\)"):
        load_train_config(tmp_path / "bad.toml")


def test_recipe_rejects_an_unknown_tokenizer_model_type(tmp_path):
    from jaxstream.training import load_train_config

    (tmp_path / "bad.toml").write_text(TINY_TOML.replace('model_type = "word"', 'model_type = "chars"'))
    with pytest.raises(ValueError, match=r"\[tokenizer\] model_type must be one of"):
        load_train_config(tmp_path / "bad.toml")


def test_word_error_rate_normalises_like_the_open_asr_leaderboard():
    import jiwer

    assert word_error_rate(["Twenty three apples."], ["23 apples"]) == 0.0
    refs, hyps = ["the cat sat on the mat", "hello world"], ["the cat sat on mat", "hello there world"]
    assert word_error_rate(refs, hyps) == pytest.approx(jiwer.wer(refs, hyps))


def test_spelling_init_makes_alike_words_start_alike(tmp_path):
    from jaxstream.training import spelling
    from jaxstream.training.spm import train_sentencepiece

    words = ["kitchen", "kitchens", "chicken", "bold", "bolds", "under"]
    vectors = spelling.spelling_vectors(words, 256, seed=0)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    cosine = vectors @ vectors.T
    # Oracle: shared character n-grams (counted directly) order the similarities.
    shared = lambda a, b: len(set(spelling.char_ngrams(a)) & set(spelling.char_ngrams(b)))
    assert shared("kitchen", "kitchens") > shared("kitchen", "chicken") > shared("kitchen", "bold") == 0
    assert cosine[0, 1] > cosine[0, 2] > abs(cosine[0, 3]) and cosine[3, 4] > 0.6
    np.testing.assert_array_equal(vectors, spelling.spelling_vectors(words, 256, seed=0))

    path = tmp_path / "word.model"
    train_sentencepiece(words * 3, os.fspath(path), 400, model_type="word")
    word_tokenizer = SentencePieceTokenizer(path)
    ids, found = spelling.word_rows(word_tokenizer)
    assert sorted(found) == sorted(words) and all(word_tokenizer.encode(w) == [i] for i, w in zip(ids, found))
    embedding = np.random.default_rng(1).normal(size=(word_tokenizer.vocab_size, 256)).astype(np.float32)
    initialised = spelling.init_word_embeddings(embedding, word_tokenizer, seed=0)
    others = np.setdiff1d(np.arange(word_tokenizer.vocab_size), ids)
    np.testing.assert_array_equal(initialised[others], embedding[others])  # controls and byte pieces untouched
    expected = spelling.spelling_vectors(found, 256, seed=0) * np.linalg.norm(embedding[ids], axis=1).mean()
    np.testing.assert_allclose(initialised[ids], expected, rtol=1e-5)


def test_bpe_tokenizer_spells_any_word_and_round_trips_any_text(tmp_path):
    # The tiny recipe's tokenizer (configs/tiny.toml): subwords learnt from sentences, byte fallback for the rest.
    from jaxstream.training.spm import train_sentencepiece

    sentences = ["can you turn off the lights in the kitchen before you go to bed",
                 "the meeting is on march third at ten thirty", "she walked quietly into the room",
                 "a penny saved is a penny earned", "he was brought out of retirement temporarily"] * 20
    path = tmp_path / "bpe.model"
    train_sentencepiece(sentences, os.fspath(path), 400, model_type="bpe")
    bpe = SentencePieceTokenizer(path)
    assert bpe.vocab_size <= 1000 + 400
    for text in ["turn off the kitchen lights", "zyzzogeton quixotically", "naïve café ünïcode 日本", "o'clock"]:
        ids = bpe.encode(text)
        assert all(1000 <= token < bpe.vocab_size for token in ids)
        assert bpe.decode(ids) == text  # no unknown pieces: unseen characters are bytes
    # Seen words are whole pieces; unseen ones are spelled with several.
    assert len(bpe.encode("kitchen")) == 1 and len(bpe.encode("zyzzogeton")) > 2
    # Each word encoded alone (how training lays out the stream, data.word_pieces) is its pieces in a sentence.
    words = "she turned quietly into the kitchen".split()
    assert sum(data.word_pieces(bpe, words), []) == bpe.encode(" ".join(words))


def test_words_spoken_as_one_group_are_laid_out_one_after_the_other():
    # espeak-ng speaks "in the" as one word (synth/engines.py): both words end at the same time, and the
    # second's marker and pieces follow the first's on the next free slots.
    n_delay = 6
    ends = [0.5, 1.0, 1.0]
    pieces = [[1100], [1101, 1102], [1103]]
    tokens, used = targets.stream_tokens(ends, pieces, n_delay, 120)
    first = targets.word_end_slot(1.0) + n_delay + 1
    ids = targets.StreamTokens()
    assert list(tokens[first : first + 5]) == [ids.word, 1101, 1102, ids.word, 1103] and used == first + 5


def test_held_out_evaluation_samples_every_voice(tmp_path, monkeypatch):
    """The periodic held-out WER, which picks RUN/best, is measured on `eval_utterances` utterances spread
    evenly over the held-out manifest, not its first rows: `jaxstream synth` sorts a manifest by id, so by
    speaker. Oracle: the speakers the manifest's ids name (`speaker-chapter-utterance`), each of which must
    get an equal share. The test stops `train` at the audio check of its held-out sample, before any work."""
    from jaxstream.training import load_train_config, loop, train

    def write_manifest(directory, records):
        directory.mkdir()
        (directory / "manifest.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))

    def record(speaker, chapter, index):
        utterance = f"{speaker}-{chapter}-{index:05d}"
        return {"id": utterance, "path": f"{speaker}/{chapter}/{utterance}.flac", "text": "yes", "duration": 1.0,
                "words": [{"word": "yes", "start": 0.2, "end": 0.5}]}

    write_manifest(tmp_path / "train", [record(100, 0, 0)])
    # 5 voices x 2 accents x 3 utterances, sorted by id as `generate_corpus` writes a manifest.
    voices = [(speaker, chapter) for speaker in range(9000, 9005) for chapter in range(2) for _ in range(3)]
    held_out = sorted((record(speaker, chapter, index) for index, (speaker, chapter) in enumerate(voices)),
                      key=lambda r: r["id"])
    write_manifest(tmp_path / "heldout", held_out)
    speakers = {r["id"].split("-")[0] for r in held_out}

    class Checked(Exception):
        pass

    def checked_sample(cfg) -> list[str]:
        def check_corpus_audio(records, rate=front_end.SAMPLING_RATE):
            if records[0]["path"].startswith(os.fspath(tmp_path / "heldout")):
                raise Checked([os.path.basename(r["path"]).removesuffix(".flac") for r in records])

        monkeypatch.setattr(loop, "check_corpus_audio", check_corpus_audio)
        with pytest.raises(Checked) as caught:
            train(cfg, os.fspath(tmp_path / "train"), os.fspath(tmp_path / "run"),
                  eval_corpus_dir=os.fspath(tmp_path / "heldout"), progress=False)
        return caught.value.args[0]

    (tmp_path / "tiny.toml").write_text(TINY_TOML + "eval_utterances = 10\n")
    cfg = load_train_config(tmp_path / "tiny.toml")
    sample = checked_sample(cfg)
    assert len(sample) == 10 and sample == sorted(set(sample))  # distinct, in the manifest's order
    shares = [sum(utterance.startswith(speaker + "-") for utterance in sample) for speaker in sorted(speakers)]
    assert shares == [10 // len(speakers)] * len(speakers)
    assert checked_sample(cfg) == sample  # the same utterances at every evaluation and on resume
    assert checked_sample(dataclasses.replace(cfg, eval_utterances=64)) == [r["id"] for r in held_out]
    assert not (tmp_path / "run").exists()


def test_eval_audio_at_another_rate_is_resampled_to_16khz(tmp_path, monkeypatch):
    from jaxstream.training import decode

    rng = np.random.default_rng(0)
    soundfile.write(tmp_path / "8k.flac", 0.1 * rng.standard_normal(8000).astype(np.float32), 8000)
    soundfile.write(tmp_path / "16k.flac", 0.1 * rng.standard_normal(16000).astype(np.float32), 16000)
    seen = []
    monkeypatch.setattr(decode, "transcribe_batch", lambda graphdef, params, audios, n_delay: seen.extend(audios)
                        or [[] for _ in audios])
    records = [{"path": "8k.flac", "duration": 1.0}, {"path": "16k.flac", "duration": 1.0}]
    silent = SentencePieceTokenizer.__new__(SentencePieceTokenizer)
    monkeypatch.setattr(silent, "decode", lambda ids: "", raising=False)
    decode.transcribe_corpus(None, None, silent, os.fspath(tmp_path), records, 6)
    assert [audio.size for audio in seen] == [16000, 16000]  # one second each, at 16 kHz


@pytest.mark.parametrize("setting, message", [
    ("delays_ms = [100, 480]", r"\[train\] delays_ms: delay_ms must be a multiple of 80 .*got 100"),
    ("delays_ms = []", r"\[train\] delays_ms must be a non-empty list"),
    ("eval_delay_ms = 500", r"\[train\] eval_delay_ms: delay_ms must be a multiple of 80 .*got 500"),
    ("seed = -1", r"\[train\] seed must be an integer >= 0, got -1"),
    ("long_stream_fraction = 1.5", r"\[train\] long_stream_fraction must be a share between 0 and 1, got 1.5"),
    ("long_stream_fraction = 0.1\nctc_targets = \"phonemes\"", r"long_stream_fraction needs ctc_targets"),
    ("long_stream_seconds = 0", r"\[train\] long_stream_seconds must be > 0, got 0"),
    ("long_streams_from_step = 1.5", r"\[train\] long_streams_from_step must be an integer >= 0, got 1.5"),
])
def test_recipe_checks_its_delays_seed_and_long_streams(tmp_path, setting, message):
    from jaxstream.training import load_train_config

    recipe = TINY_TOML.replace("delays_ms = [160, 480]", "") + setting + "\n"
    (tmp_path / "bad.toml").write_text(recipe)
    with pytest.raises(ValueError, match=message):
        load_train_config(tmp_path / "bad.toml")


def test_xla_gradients_run_and_agree_under_the_training_compiler_options():
    """Training steps compile with `training_compiler_options()` (on CPU, YNNPACK for dots only). Under it,
    autodiff's sum of the query blocks' key/value gradient slices compiled into a program that crashed the
    process (388 frames: 7 query blocks; from 2 sessions on, and 2 compile in a third of the time 16 take), so
    this runs in a subprocess: the gradients of a multi-block chunk run there and equal those of XLA's default
    compilation."""
    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jaxstream.models.layers import init_kv_cache
        from jaxstream.tpu_kernels.ring_attention.api import ring_attention
        from jaxstream.training.step import training_compiler_options
        rng = np.random.default_rng(0)
        sessions, chunk, heads, head_dim, window = 2, 388, 2, 64, 128
        q, k, v = (jnp.asarray(rng.standard_normal((sessions, chunk, heads, head_dim)), jnp.float32) for _ in range(3))
        k_pages, v_pages = init_kv_cache(1, 2, heads, window, head_dim, jnp.float32)[0]
        table, lengths = jnp.ones((sessions, 1), jnp.int32), jnp.full((sessions,), 124, jnp.int32)
        num_new = jnp.full((sessions,), chunk, jnp.int32)
        def loss(q, k, v):
            out, _, _ = ring_attention(q, k, v, k_pages, v_pages, table, lengths, num_new, window=window,
                                       implementation="xla")
            return jnp.mean(out ** 2)
        grad = jax.grad(loss, argnums=(0, 1, 2))
        options = training_compiler_options()
        got = jax.jit(grad, compiler_options=options)(q, k, v)
        expected = jax.jit(grad)(q, k, v)
        print(options is not None, max(float(jnp.max(jnp.abs(g - e))) for g, e in zip(got, expected)))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    applied, difference = result.stdout.split()
    assert applied == "True" and float(difference) < 1e-6, result.stdout

