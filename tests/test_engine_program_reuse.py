"""An engine built again in the same process reuses the first one's traced and compiled programs (steps.py's
process-wide jitted steps, kv_cache's offload and restore), and both engines, alive at once and sharing the
executables, still give transformers' tokens. A different program shape compiles as before."""
import asyncio
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxstream.engine.async_engine import AsyncEngine
from jaxstream.engine.config import EngineConfig
from jaxstream.models.audio import n_delay_from_ms, prompt_length

FIXTURES = Path(__file__).parent / "fixtures"
# Buckets no other test module uses (3 and 5 steps a dispatch), so that this process has not made them before.
CONFIG = dict(max_sessions=2, page_size=4, encoder_page_size=4, batch_buckets=(2,), realtime_step_buckets=(3,),
              realtime_prefill_buckets=((2, 40),))
# What an engine's start-up compiles: its step programs and the cache's offload and restore programs.
ENGINE_PROGRAMS = ("jit(_merged_step)", "jit(_offload_session)", "jit(_restore_session)")


@pytest.fixture
def compiled(caplog):
    """The names of the programs XLA compiles (JAX's compile log; its persistent cache off, so that a program
    the process does not hold is compiled, not loaded from disk)."""
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.log_compiles(True), caplog.at_level(logging.WARNING):
            yield lambda: [record.getMessage().split(" of ")[1].split(" ")[0] for record in caplog.records
                           if record.getMessage().startswith("Finished XLA compilation of ")]
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)


def _engine(**changes) -> AsyncEngine:
    return AsyncEngine.from_pretrained(FIXTURES / "voxtral_tiny", config=EngineConfig(**{**CONFIG, **changes}),
                                       dtype="float32")


async def test_a_second_engine_reuses_the_programs_and_both_give_transformers_tokens(compiled, caplog):
    first = _engine()
    try:
        # Its 3-step decode program at least (other modules' engines may have made the prefill program and the
        # cache's offload and restore for these shapes already).
        assert "jit(_merged_step)" in compiled()
        caplog.clear()
        second = _engine()
        try:
            assert not [name for name in compiled() if name in ENGINE_PROGRAMS]
            reference = dict(np.load(FIXTURES / "voxtral_tiny_reference.npz"))
            delays = (480, 160)
            results = await asyncio.gather(*(engine.transcribe(reference["audio"], delay_ms=delay)
                                             for engine in (first, second) for delay in delays))
            for (engine, delay), result in zip([(e, d) for e in (first, second) for d in delays], results):
                n_delay = n_delay_from_ms(delay)
                assert result.token_ids == reference[f"generate_d{n_delay}"][0, prompt_length(n_delay):].tolist()
        finally:
            await second.shutdown()
    finally:
        await first.shutdown()


async def test_another_bucket_compiles_its_own_program(compiled):
    engine = _engine(realtime_step_buckets=(5,))  # a decode program of 5 steps a dispatch: no engine made it yet
    try:
        assert "jit(_merged_step)" in compiled()
    finally:
        await engine.shutdown()


def test_a_step_with_unhashable_arguments_gets_a_jitted_step_of_its_own():
    """A step (or model structure) that cannot be a key is jitted afresh, as every engine's was before."""
    import functools

    from jaxstream.engine import steps

    def step(model, state, batch, *, table):
        return batch, state

    shared = functools.partial(step, table=(1, 2))
    assert steps._jitted_step(shared, None, None, {}) is steps._jitted_step(functools.partial(step, table=(1, 2)),
                                                                           None, None, {})
    unhashable = functools.partial(step, table=[1, 2])
    assert steps._jitted_step(unhashable, None, None, {}) is not steps._jitted_step(unhashable, None, None, {})
