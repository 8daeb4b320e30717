"""VoxtralRealtime vs transformers fixtures (tests/make_reference_fixtures.py): offline forward, streaming
audio_step/text_step with random chunking over shuffled paged rings, greedy generation, the 4B shape.

The fixture's decoder window (96) covers its whole streams, so that every position sees the prompt; the
decoder's sliding window is checked against the fixture's narrow-window reference (same weights, window 16)."""
import dataclasses
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxstream.models import (
    VOXTRAL_MINI_4B, CheckpointMismatchError, VoxtralRealtime, config_from_hf, hf_name_map, init_conv_state,
    init_kv_cache, load_hf_weights, num_parameters,
)
from jaxstream.models.audio import StreamingLogMel, offline_features
from jaxstream.models.checkpoint_metadata import config_from_dict, config_to_dict
from jaxstream.models.loading import abstract_model
from jaxstream.models.voxtral import time_condition

FIXTURES = Path(__file__).parent / "fixtures"
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def vox():
    cfg = config_from_hf(json.loads((FIXTURES / "voxtral_tiny" / "config.json").read_text()))
    model = nnx.eval_shape(lambda: VoxtralRealtime(cfg, rngs=nnx.Rngs(0)))  # the checkpoint fills it
    load_hf_weights(model, load_file(FIXTURES / "voxtral_tiny" / "model.safetensors"))
    graphdef, state = nnx.split(model)
    ref = dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))
    delays = [int(d) for d in ref["delays"]]
    # Both delays run as one batch of two sessions; the shorter stream is padded at its end, which a
    # causal model never sees from earlier positions.
    slots = [ref[f"input_ids_d{d}"].shape[1] for d in delays]
    total = max(slots)
    mel = np.zeros((len(delays), 8 * total, cfg.encoder.num_mel_bins), np.float32)
    ids = np.zeros((len(delays), total), np.int32)
    for s, d in enumerate(delays):
        mel[s, : 8 * slots[s]] = ref[f"features_d{d}"][0].T
        ids[s, : slots[s]] = ref[f"input_ids_d{d}"][0]
    return SimpleNamespace(cfg=cfg, model=model, graphdef=graphdef, state=state, ref=ref, delays=delays,
                           slots=slots, mel=mel, ids=ids, n_delay=np.asarray(delays, np.float32))


def method(graphdef, name, donate=()):
    """Jitted pure function (state, *args) -> model.<name>(*args), as the engine builds its steps."""
    def call(state, *args, **kwargs):
        return getattr(nnx.merge(graphdef, state), name)(*args, **kwargs)
    return jax.jit(call, donate_argnums=donate)


def shuffled_page_table(rng, num_sessions, window):
    pages_per_window = -(-window // PAGE_SIZE)
    pages = 1 + rng.permutation(num_sessions * pages_per_window).astype(np.int32)
    return jnp.asarray(pages.reshape(num_sessions, pages_per_window)), 1 + num_sessions * pages_per_window


@pytest.fixture(scope="module")
def offline(vox):
    return method(vox.graphdef, "offline_logits")


def test_offline_logits_match_transformers(vox, offline):
    logits = np.asarray(offline(vox.state, jnp.asarray(vox.mel), jnp.asarray(vox.ids), jnp.asarray(vox.n_delay)))
    errors = [np.abs(logits[s, : vox.slots[s]] - vox.ref[f"logits_d{d}"][0]).max() for s, d in enumerate(vox.delays)]
    print("max |logits - transformers| per delay:", errors)
    assert max(errors) <= 1e-4


def test_encoder_adapter_and_t_cond_match_transformers(vox):
    cfg = vox.cfg

    def encode(state, mel):
        model = nnx.merge(vox.graphdef, state)
        num_sessions = mel.shape[0]
        conv_state, (enc_cache, enc_table), _ = model.init_caches(num_sessions)
        zeros = jnp.zeros((num_sessions,), jnp.int32)
        num_frames = jnp.full((num_sessions,), mel.shape[1], jnp.int32)
        stem, _ = model.audio_tower.embedder(mel, conv_state, num_frames)
        encoded, _, _ = model.audio_tower(mel, conv_state, enc_cache, enc_table, zeros, num_frames)
        adapter, _, _ = model.audio_step(mel, conv_state, enc_cache, enc_table, zeros, num_frames // 8)
        return stem, encoded, adapter

    stem, encoded, adapter = map(np.asarray, jax.jit(encode)(vox.state, jnp.asarray(vox.mel)))
    t_cond = np.asarray(time_condition(jnp.asarray(vox.n_delay), cfg.text.hidden_size, jnp.float32))
    for s, d in enumerate(vox.delays):
        frames = 4 * vox.slots[s]
        np.testing.assert_allclose(stem[s, :frames], vox.ref[f"conv_stem_d{d}"][0], atol=1e-5)
        np.testing.assert_allclose(encoded[s, :frames], vox.ref[f"encoder_output_d{d}"][0], atol=1e-5)
        np.testing.assert_allclose(adapter[s, : vox.slots[s]], vox.ref[f"adapter_output_d{d}"][0], atol=1e-5)
        np.testing.assert_allclose(t_cond[s], vox.ref[f"t_cond_d{d}"], atol=1e-6)


def test_streaming_random_chunks_match_offline_and_generate(vox, offline):
    """Both delays stream side by side: audio in random slot chunks (C in {1, 4}, random valid counts incl. 0,
    garbage in padding rows), prompt prefill in random pieces, then one greedy token per 80 ms slot."""
    cfg, rng = vox.cfg, np.random.default_rng(0)
    num_sessions = len(vox.delays)
    enc, text = cfg.encoder, cfg.text
    enc_table, enc_pages = shuffled_page_table(rng, num_sessions, enc.sliding_window)
    dec_table, dec_pages = shuffled_page_table(rng, num_sessions, text.attention_window)
    enc_cache = init_kv_cache(enc.num_layers, enc_pages, enc.num_heads, PAGE_SIZE, enc.head_dim)
    cache = init_kv_cache(text.num_layers, dec_pages, text.num_kv_heads, PAGE_SIZE, text.head_dim)
    conv_state = init_conv_state(cfg, num_sessions)
    audio_step = method(vox.graphdef, "audio_step", donate=(2, 3))
    text_step = method(vox.graphdef, "text_step", donate=(4,))
    n_delay = jnp.asarray(vox.n_delay)

    prompts = [list(vox.ref[f"prompt_ids_d{d}"][0]) for d in vox.delays]
    tokens = [list(p) for p in prompts]
    embeds = [[] for _ in range(num_sessions)]  # audio embeddings of the slots encoded so far
    written = [0] * num_sessions  # decoder positions written
    step_logits = [[] for _ in range(num_sessions)]
    while any(written[s] < vox.slots[s] for s in range(num_sessions)):
        chunk = int(rng.choice([1, 4]))
        num_slots = [min(int(rng.integers(0, chunk + 1)), vox.slots[s] - len(embeds[s])) for s in range(num_sessions)]
        mel = rng.standard_normal((num_sessions, 8 * chunk, enc.num_mel_bins)).astype(np.float32)
        for s, n in enumerate(num_slots):
            mel[s, : 8 * n] = vox.mel[s, 8 * len(embeds[s]) : 8 * (len(embeds[s]) + n)]
        enc_lengths = jnp.asarray([4 * len(e) for e in embeds], jnp.int32)
        audio, conv_state, enc_cache = audio_step(vox.state, jnp.asarray(mel), conv_state, enc_cache, enc_table,
                                                  enc_lengths, jnp.asarray(num_slots, jnp.int32))
        for s, n in enumerate(num_slots):
            embeds[s].extend(np.asarray(audio[s, :n]))

        chunk = int(rng.choice([1, 4]))
        num_new = [min(chunk, len(tokens[s]) - written[s], len(embeds[s]) - written[s]) for s in range(num_sessions)]
        ids = rng.integers(0, text.vocab_size, (num_sessions, chunk)).astype(np.int32)
        audio_in = rng.standard_normal((num_sessions, chunk, text.hidden_size)).astype(np.float32)
        for s, n in enumerate(num_new):
            if n:
                ids[s, :n] = tokens[s][written[s] : written[s] + n]
                audio_in[s, :n] = embeds[s][written[s] : written[s] + n]
        logits_at = jnp.asarray([max(n - 1, 0) for n in num_new], jnp.int32)
        logits, cache = text_step(vox.state, jnp.asarray(ids), jnp.asarray(audio_in), n_delay, cache, dec_table,
                                  jnp.asarray(written, jnp.int32), jnp.asarray(num_new, jnp.int32), logits_at=logits_at)
        for s, n in enumerate(num_new):
            written[s] += n
            if n and written[s] == len(tokens[s]):
                step_logits[s].append(np.asarray(logits[s]))
                tokens[s].append(int(np.argmax(logits[s])))

    one_shot_ids = np.zeros_like(vox.ids)
    for s in range(num_sessions):
        one_shot_ids[s, : vox.slots[s]] = tokens[s][: vox.slots[s]]
    one_shot = np.asarray(offline(vox.state, jnp.asarray(vox.mel), jnp.asarray(one_shot_ids), n_delay))
    for s, d in enumerate(vox.delays):
        prompt_len, slots = len(prompts[s]), vox.slots[s]
        generated, streamed = tokens[s][prompt_len:], np.stack(step_logits[s])
        assert generated[: slots - prompt_len] == list(vox.ref[f"generate_d{d}"][0, prompt_len:])
        assert generated == list(vox.ref[f"incremental_tokens_d{d}"])
        np.testing.assert_allclose(streamed, vox.ref[f"incremental_logits_d{d}"], atol=1e-4)
        np.testing.assert_allclose(streamed[:-1], vox.ref[f"generate_logits_d{d}"], atol=1e-4)
        error = np.abs(streamed - one_shot[s, prompt_len - 1 : slots]).max()
        print(f"delay {d}: streaming vs one-shot max |logits diff| = {error:.2e}")
        assert error <= 1e-5


@pytest.fixture(scope="module")
def narrow(vox):
    """The fixture's weights with the decoder window cut to the reference's `narrow_window` (16 < S = 91)."""
    window = int(vox.ref["narrow_window"])
    cfg = dataclasses.replace(vox.cfg, text=dataclasses.replace(vox.cfg.text, sliding_window=window))
    model = nnx.eval_shape(lambda: VoxtralRealtime(cfg, rngs=nnx.Rngs(0)))
    tensors = load_file(FIXTURES / "voxtral_tiny" / "model.safetensors")
    load_hf_weights(model, tensors)
    graphdef, state = nnx.split(model)
    # The reference stores the post-final-norm output; the head is tied to the embedding.
    expected = vox.ref["narrow_window_hidden_d6"][0] @ tensors["language_model.model.embed_tokens.weight"].T
    slots = vox.ref["input_ids_d6"].shape[1]
    assert window < slots and np.abs(expected[window:] - vox.ref["logits_d6"][0, window:]).max() > 0.1
    return SimpleNamespace(cfg=cfg, graphdef=graphdef, state=state, window=window, expected=expected, slots=slots)


def test_narrow_decoder_window_offline_matches_transformers(vox, narrow):
    mel, ids = vox.ref["features_d6"][0].T[None], vox.ref["input_ids_d6"]
    logits = method(narrow.graphdef, "offline_logits")(narrow.state, jnp.asarray(mel), jnp.asarray(ids, jnp.int32),
                                                        jnp.asarray([6.0]))
    np.testing.assert_allclose(np.asarray(logits)[0], narrow.expected, atol=1e-4)


def test_narrow_decoder_window_streaming_wraps_the_ring(vox, narrow):
    """Teacher-forced text_step over a shuffled 4-page ring that wraps ~6 times, two sessions with their own
    random chunk sizes (0..4, garbage in the padding rows), audio embeddings from the reference adapter."""
    rng, num_sessions, text = np.random.default_rng(1), 2, narrow.cfg.text
    table, num_pages = shuffled_page_table(rng, num_sessions, narrow.window)
    cache = init_kv_cache(text.num_layers, num_pages, text.num_kv_heads, PAGE_SIZE, text.head_dim)
    text_step = method(narrow.graphdef, "text_step", donate=(4,))
    ids, audio = vox.ref["input_ids_d6"][0], vox.ref["adapter_output_d6"][0]
    written, chunk = [0] * num_sessions, 4
    while min(written) < narrow.slots:
        num_new = [min(int(rng.integers(0, chunk + 1)), narrow.slots - w) for w in written]
        batch_ids = rng.integers(0, text.vocab_size, (num_sessions, chunk)).astype(np.int32)
        batch_audio = rng.standard_normal((num_sessions, chunk, text.hidden_size)).astype(np.float32)
        for s, (w, n) in enumerate(zip(written, num_new)):
            batch_ids[s, :n], batch_audio[s, :n] = ids[w : w + n], audio[w : w + n]
        logits, cache = text_step(narrow.state, jnp.asarray(batch_ids), jnp.asarray(batch_audio),
                                  jnp.full((num_sessions,), 6.0), cache, table, jnp.asarray(written, jnp.int32),
                                  jnp.asarray(num_new, jnp.int32))
        logits = np.asarray(logits)
        for s, (w, n) in enumerate(zip(written, num_new)):
            np.testing.assert_allclose(logits[s, :n], narrow.expected[w : w + n], atol=1e-4)
            written[s] += n


def test_voxtral_mini_4b_parameter_count():
    # abstract_model avoids flax's per-parameter RNG bookkeeping, which is quadratic at this size.
    abstract = abstract_model(VOXTRAL_MINI_4B)
    count = num_parameters(abstract)
    print(f"Voxtral-Mini-4B parameters: {count / 1e9:.4f} B")
    assert round(count / 1e9, 2) == 4.43
    assert round(num_parameters(abstract.audio_tower) / 1e6, 1) == 970.4
    assert round(num_parameters(abstract.language_model) / 1e9, 3) == 3.434
    embedding = abstract.language_model.embed_tokens.embedding
    assert embedding.shape == (131072, 3072)
    assert abstract.audio_tower.layers[0].self_attn.k_proj.bias is None
    assert abstract.audio_tower.layers[0].self_attn.q_proj.bias.shape == (2048,)
    # The HF name map covers exactly the module's parameters, with consistent layouts (711 tensors on disk).
    names = hf_name_map(VOXTRAL_MINI_4B)
    assert len(names) == 711
    params = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    assert {entry.path for entry in names.values()} == set(params)
    for entry in names.values():
        assert entry.transform(np.broadcast_to(np.float32(0), entry.shape)).shape == params[entry.path].shape


@pytest.mark.parametrize("pad", [0, -3])
def test_a_config_without_left_padding_is_refused(vox, pad):
    """Voxtral Realtime pads every stream with 32 silent slots. Without any, the streaming features of the
    first slot differ from the offline ones (the centred STFT reflects real samples where the stream has
    zeros) and the silent-prefix cache spans -1 slots, so the engine could not start: refused where every
    config is built, a jaxstream.json checkpoint's included, in one clear line."""
    with pytest.raises(ValueError, match=r"n_left_pad_tokens must be at least 1 .*got " + str(pad)):
        dataclasses.replace(vox.cfg, n_left_pad_tokens=pad)
    with pytest.raises(ValueError, match=r"n_left_pad_tokens must be at least 1"):
        config_from_dict({**config_to_dict(vox.cfg), "n_left_pad_tokens": pad})


def test_one_slot_of_left_padding_streams_as_offline():
    """The smallest left padding the config accepts gives the streaming front end the offline features
    (`offline_features`, the oracle) from the first slot on."""
    pcm = (np.random.default_rng(0).standard_normal(16000) * 0.3).astype(np.float32)
    stream = StreamingLogMel(6, n_left_pad_tokens=1)
    for begin in range(0, pcm.size, 1000):
        stream.push(pcm[begin:begin + 1000])
    stream.finish()
    np.testing.assert_allclose(stream.take().reshape(-1, 128), offline_features(pcm, 6, n_left_pad_tokens=1),
                               rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def bad_input_call(vox):
    model = vox.model
    conv_state, (enc_cache, enc_table), (cache, table) = model.init_caches(1)
    ones = jnp.ones((1,), jnp.int32)
    zeros = jnp.zeros((1,), jnp.int32)
    return SimpleNamespace(
        audio=functools.partial(model.audio_step, conv_state=conv_state, enc_cache=enc_cache,
                                enc_page_table=enc_table, enc_lengths=zeros, num_slots=ones),
        text=functools.partial(model.text_step, cache=cache, page_table=table, lengths=zeros, num_new=ones),
        mel=jnp.zeros((1, 8, vox.cfg.encoder.num_mel_bins)), conv_state=conv_state,
        ids=jnp.ones((1, 1), jnp.int32), embeds=jnp.zeros((1, 1, vox.cfg.text.hidden_size)))


@pytest.mark.parametrize("delay_slots", [0.0, 4.5, 16.0, 29.0])
def test_unsupported_delay_is_rejected(bad_input_call, delay_slots):
    with pytest.raises(ValueError, match="unsupported transcription delay"):
        bad_input_call.text(bad_input_call.ids, bad_input_call.embeds, jnp.asarray([delay_slots]))


def test_bad_shapes_are_rejected(vox, bad_input_call):
    call = bad_input_call
    with pytest.raises(ValueError, match="mel must be"):
        call.audio(jnp.zeros((1, 12, vox.cfg.encoder.num_mel_bins)))
    with pytest.raises(ValueError, match="mel must be"):
        call.audio(jnp.zeros((1, 8, 80)))
    with pytest.raises(ValueError, match="conv_state.conv1"):
        call.audio(call.mel, conv_state=call.conv_state._replace(conv1=jnp.zeros((1, 3, 128))))
    with pytest.raises(ValueError, match="num_slots must have shape"):
        call.audio(call.mel, num_slots=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="audio_embeds must have shape"):
        call.text(call.ids, jnp.zeros((1, 2, vox.cfg.text.hidden_size)), jnp.asarray([6.0]))
    with pytest.raises(ValueError, match="n_delay must have shape"):
        call.text(call.ids, call.embeds, jnp.asarray([6.0, 6.0]))
    with pytest.raises(ValueError, match="cache has 1 layers"):
        call.text(call.ids, call.embeds, jnp.asarray([6.0]), cache=call.text.keywords["cache"][:1])
    with pytest.raises(ValueError, match="mel must be"):
        vox.model.offline_logits(jnp.zeros((1, 16, 128)), jnp.ones((1, 3), jnp.int32), jnp.asarray([6.0]))


def test_checkpoint_mismatch_names_the_tensors(vox):
    tensors = load_file(FIXTURES / "voxtral_tiny" / "model.safetensors")
    broken = dict(tensors)
    del broken["audio_tower.layers.1.self_attn.q_proj.bias"]
    broken["language_model.model.norm.weight"] = np.ones((63,), np.float32)
    broken["audio_tower.layers.0.self_attn.k_proj.bias"] = np.zeros((48,), np.float32)
    model = nnx.eval_shape(lambda: VoxtralRealtime(vox.cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointMismatchError) as error:
        load_hf_weights(model, broken)
    message = str(error.value)
    assert "1 missing: audio_tower.layers.1.self_attn.q_proj.bias" in message
    assert "language_model.model.norm.weight (63,) (expected (64,))" in message
    assert "1 unexpected: audio_tower.layers.0.self_attn.k_proj.bias" in message
    # A tied head's duplicate and rotary buffers are accepted and ignored.
    extra = dict(tensors, **{"language_model.lm_head.weight": tensors["language_model.model.embed_tokens.weight"]})
    load_hf_weights(model, extra)
    np.testing.assert_array_equal(np.asarray(model.audio_tower.embedder.conv1.kernel[...]),
                                  tensors["audio_tower.embedder.conv1.weight"].transpose(2, 1, 0))
