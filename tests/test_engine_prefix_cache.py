"""The silent-prefix cache (engine/prefix_cache.py): a stream that starts from the cached left-pad slots gives
the tokens of the dense offline model run over its whole padded input (the oracle: no pages, no rings, no
cache), at several delays batched together; the cache's pages stay out of the pools; and after a failed
dispatch consumed the device state the cache is rebuilt, not read back as zeros."""
import asyncio
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.builders import load_pretrained
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.transcription_session import transcription_prompt
from jaxstream.models import loading
from jaxstream.models.audio import (
    ALLOWED_DELAYS_MS, load_audio, n_delay_from_ms, offline_features, prompt_length, silent_prefix_slots,
)
from jaxstream.models.voxtral import VoxtralRealtime

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE = load_audio(loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav")[:28_000]
DELAYS_MS = (160, 480, 960)
CONFIG = dict(max_sessions=3, page_size=16, encoder_page_size=32, batch_buckets=(3,), realtime_step_buckets=(1, 4),
              realtime_prefill_buckets=((3, 32),))

pytestmark = pytest.mark.usefixtures("engine_returns_to_baseline")


@pytest.fixture(scope="module")
def wide():
    """The random tiny Voxtral fixture's weights with windows that hold the prefix (its own are 12 and 96
    frames, shorter than the 124 encoder frames of the cached prefix)."""
    loaded, tokenizer, _ = load_pretrained(FIXTURES / "voxtral_tiny", EngineConfig(), dtype="float32")
    cfg = loaded.cfg
    cfg = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, sliding_window=256),
                              text=dataclasses.replace(cfg.text, sliding_window=256))
    model = VoxtralRealtime(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(wide):
    model, tokenizer = wide
    engine = AsyncEngine(model, config=EngineConfig(**CONFIG), tokenizer=tokenizer)
    yield engine
    engine.close()


def dense_greedy(model, audio, delay_ms) -> tuple[list[int], list[float]]:
    """Greedy decoding with `offline_logits` over the whole padded input, one position at a time (causal:
    the logits at p do not see later ids or audio), fed up to the second-to-last slot as the engine does."""
    n_delay = n_delay_from_ms(delay_ms)
    mel = offline_features(audio, n_delay, n_left_pad_tokens=model.cfg.n_left_pad_tokens)
    total = mel.shape[0] // model.cfg.mel_frames_per_token
    prompt = transcription_prompt(model.cfg, n_delay)
    ids = np.zeros(total, np.int32)
    ids[: len(prompt)] = prompt
    logits_of = jax.jit(lambda ids: model.offline_logits(jnp.asarray(mel)[None], ids[None],
                                                         jnp.array([float(n_delay)]))[0])
    tokens, logprobs = [], []
    for position in range(len(prompt) - 1, total - 1):
        logits = np.asarray(logits_of(jnp.asarray(ids)), np.float64)[position]
        token = int(np.argmax(logits))
        tokens.append(token)
        logprobs.append(float(logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()))
        if token == model.cfg.eos_id:
            break
        ids[position + 1] = token
    return tokens, logprobs


async def test_streams_from_the_cached_prefix_give_the_dense_models_tokens(engine, wide):
    model, _ = wide
    assert engine.core.prefix.slots == silent_prefix_slots() == 31
    assert prompt_length(n_delay_from_ms(min(DELAYS_MS))) > engine.core.prefix.slots

    async def run(delay_ms):
        session = await engine.start_transcription(delay_ms)
        for start in range(0, len(SAMPLE), 1280):
            await session.append(SAMPLE[start : start + 1280])
        await session.finish()
        return [event async for event in session][-1]

    dones = await asyncio.gather(*(run(delay) for delay in DELAYS_MS))  # three delays in one batch
    for delay, done in zip(DELAYS_MS, dones):
        tokens, logprobs = dense_greedy(model, SAMPLE, delay)
        assert done.token_ids == tokens, delay
        np.testing.assert_allclose(done.logprobs, logprobs, atol=2e-4)


async def test_the_cached_prefix_holds_its_pages_out_of_the_pools(engine):
    metrics = engine.metrics()
    prefix = engine.core.prefix
    decoder_pages = prefix.decoder_pages[prefix.decoder_pages != 0]
    pools = engine.core.cache.pools
    assert {name: metrics.pages_total[name] for name in pools} == {
        "encoder": CONFIG["max_sessions"] * engine.core.cache.specs["encoder"].pages_per_window,
        "decoder": CONFIG["max_sessions"] * engine.core.cache.specs["decoder"].pages_per_window}
    # Two pages of 16 positions hold the 31 prefix positions, per allowed delay.
    assert len(set(decoder_pages.tolist())) == len(decoder_pages) == 2 * len(ALLOWED_DELAYS_MS)
    await engine.transcribe(SAMPLE)
    free = {name: set(pool._free[: pool.num_free].tolist()) for name, pool in pools.items()}  # noqa: SLF001
    assert not free["encoder"] & set(prefix.encoder_pages.tolist())
    assert not free["decoder"] & set(decoder_pages.tolist())


async def test_a_consumed_device_state_rebuilds_the_cached_prefix(engine):
    expected = (await engine.transcribe(SAMPLE)).token_ids
    engine._send(engine.core.reset_device_state)  # noqa: SLF001 - what a failed dispatch does, between ticks
    await engine.wait_until_idle()
    assert (await engine.transcribe(SAMPLE)).token_ids == expected


async def test_the_cache_is_off_where_a_window_cannot_hold_the_prefix():
    """The transformers fixture's own windows (12 encoder frames) are shorter than the prefix: streams then
    compute every slot, and the cache holds nothing."""
    engine = AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", EngineConfig(**CONFIG), dtype="float32")
    try:
        assert engine.core.prefix.slots == 0
        assert engine.metrics().pages_total["encoder"] == engine.core.cache.specs["encoder"].num_pages - 1
    finally:
        engine.close()
