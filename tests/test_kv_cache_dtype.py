"""`EngineConfig.kv_cache_dtype` (`--kv-cache-dtype`, vLLM's): KV pages stored in fp8 while the model computes in its
own dtype. The kernels' side (every implementation against the float64 oracle over fp8-rounded keys and values) is in
tests/ring_attention_base.py; here, the engines: a text LM's greedy tokens and logprobs against one offline forward
over fp8 pages, the embedded speech model's transcript against the sample's text, the pools' bytes, and the flag
from every command."""
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from engine_fixtures import BYTE_BPE_EOS, byte_bpe_llama
from jaxstream.cli import main
from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import KV_CACHE_DTYPES, EngineConfig
from jaxstream.engine.requests import SamplingParams
from jaxstream.errors import InvalidRequestError, UserError
from jaxstream.commands.transcribe import KV_CACHE_DTYPE_CHOICES
from jaxstream.models import contiguous_page_table, init_kv_cache, loading
from jaxstream.models.audio import load_audio

SAMPLE = loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav"
SAMPLE_TEXT = "he who has imagination without learning has wings but no feet"


def test_kv_cache_dtype_values():
    assert KV_CACHE_DTYPE_CHOICES == tuple(KV_CACHE_DTYPES)  # the parsers' copy (they do not import jax)
    with pytest.raises(InvalidRequestError, match="EngineConfig.kv_cache_dtype must be one of 'auto', 'bfloat16'"):
        EngineConfig(kv_cache_dtype="int8")
    # The C++ kernel takes float32 pages only: named explicitly, an fp8 cache is refused in one line.
    with pytest.raises(InvalidRequestError, match="attention_impl 'cpu' cannot run here: the C[+][+] kernel takes "
                                                  "float32 pages, not float8_e4m3fn"):
        EngineConfig(kv_cache_dtype="fp8", attention_impl="cpu")


@pytest.fixture(scope="module")
def text_engine():
    # One decode and one prefill program: a prompt is prefilled in pieces of 64.
    engine = AsyncEngine(byte_bpe_llama(), config=EngineConfig(max_sessions=1, prefill_buckets=((1, 64),),
                                                               kv_cache_dtype="fp8"), eos_token_id=BYTE_BPE_EOS)
    yield engine
    engine.close()


def _oracle_logprobs(engine, context, page_dtype) -> np.ndarray:
    """Log-softmax [len(context), V] of one offline forward over `context`, its KV pages in `page_dtype`."""
    cfg = engine.model_config
    window = cfg.attention_window
    table, num_pages = contiguous_page_table(1, window, window)
    cache = init_kv_cache(cfg.num_layers, num_pages, cfg.num_kv_heads, window, cfg.head_dim, dtype=page_dtype)
    logits, _ = byte_bpe_llama()(jnp.asarray([context], jnp.int32), cache, jnp.asarray(table),
                                 jnp.zeros(1, jnp.int32), jnp.asarray([len(context)], jnp.int32))
    logits = np.asarray(logits[0], np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


async def test_text_generation_over_fp8_pages_equals_one_forward_over_them(text_engine):
    """A 200-token prompt (prefilled in pieces of 64) and 24 greedy tokens (decode steps) over an fp8 (e4m3) cache:
    each token is the argmax, and its logprob the log-softmax, of one offline forward of the whole context over fp8
    pages. The chunk's own keys are rounded before they are attended to, so how the context was cut into dispatches
    does not change the outputs. (e5m2: the kernels' tests.)"""
    engine = text_engine
    assert engine.core.cache.dtype == jnp.float8_e4m3fn
    prompt = [int(i) for i in np.random.default_rng(0).integers(3, 300, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)
    tokens, logprobs = [], []
    async for out in engine.generate(prompt, params):
        tokens += out.outputs[0].token_ids
        logprobs += out.outputs[0].logprobs  # the sampled tokens' (logprobs=0)
    expected = _oracle_logprobs(engine, prompt + tokens[:-1], jnp.float8_e4m3fn)[len(prompt) - 1:]
    assert tokens == [int(i) for i in expected.argmax(-1)]
    np.testing.assert_allclose(logprobs, expected[np.arange(len(tokens)), tokens], atol=1e-4)


async def test_the_embedded_model_transcribes_its_sample_over_an_fp8_cache():
    """The tiny model with fp8 (e4m3) KV pages: the sample's exact text at the default delay (at all 11 delays it was
    trained at, 160-960 ms, when measured), with pages of a quarter of float32's bytes."""
    # One decode program (the whole file is queued at once: 16-step catch-up dispatches).
    config = EngineConfig(max_sessions=1, kv_cache_dtype="fp8", realtime_step_buckets=(16,))
    engine = AsyncEngine.from_pretrained("tiny", config=config)
    try:
        assert engine.core.cache.dtype == jnp.float8_e4m3fn
        for spec in engine.core.cache.specs.values():
            assert spec.bytes_per_page(engine.core.cache.dtype) * 4 == spec.bytes_per_page(jnp.float32)
        assert (await engine.transcribe(load_audio(SAMPLE))).text == SAMPLE_TEXT
    finally:
        engine.close()


def test_fp8_pages_double_bfloat16_pools_in_the_same_memory(monkeypatch):
    """Pools fitted to a device's memory: an fp8 cache gets twice the pages of a bfloat16 one."""
    from jaxstream.engine import builders, kv_cache, sharding

    monkeypatch.setattr(builders, "_free_device_bytes", lambda placement: 2e9)
    spec = kv_cache.stack_spec("text", num_layers=26, num_kv_heads=8, head_dim=128, page_size=64, ring=8192,
                               num_pages=None, max_sessions=64)
    pages = {dtype: builders.fit_pools([spec], EngineConfig(dtype="bfloat16", kv_cache_dtype=dtype),
                                       sharding.Placement(None, "tp"))[0].num_pages - 1
             for dtype in ("auto", "fp8")}
    assert abs(pages["fp8"] - 2 * pages["auto"]) <= 1


@pytest.mark.parametrize("command", ["transcribe", "eval", "bench", "serve", "serve-toml"])
@pytest.mark.parametrize("field,value", [("kv_cache_dtype", "fp8"), ("quantization", "int8")])
def test_the_precision_flags_reach_the_engine(monkeypatch, tmp_path, command, field, value):
    """`--kv-cache-dtype fp8` and `--quantization int8` (or a server TOML's `[engine]` keys) are the EngineConfig the
    engine loads with."""
    import logging

    configs = []

    def from_pretrained(model, config=None, **kwargs):
        configs.append(config)
        raise UserError("this test loads no model")

    monkeypatch.setattr(AsyncEngine, "from_pretrained", from_pretrained)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(SAMPLE, corpus / "a.wav")
    (corpus / "a.txt").write_text(SAMPLE_TEXT)
    (tmp_path / "server.toml").write_text(f'[engine]\n{field} = "{value}"\n')
    flag = ["--" + field.replace("_", "-"), value]
    serve = ["serve", "--host", "127.0.0.1", "--port", "0"]
    argv = {"transcribe": ["transcribe", str(SAMPLE), *flag], "eval": ["eval", str(corpus), *flag],
            "bench": ["bench", *flag], "serve": serve + flag,
            "serve-toml": serve + ["--config", str(tmp_path / "server.toml")]}[command]
    level = logging.getLogger("jaxstream").level  # serve sets its own
    try:
        assert main(argv) == 2
    finally:
        logging.getLogger("jaxstream").setLevel(level)
    assert [getattr(config, field) for config in configs] == [value]
