"""Start-up first runs (jaxstream/engine/first_runs.py): every realtime program runs once at each attention reach
bucket a stream meets early, judged by the XLA path's own bucket choice, and the runs leave the device state
and the page pools as they found them."""
import jax
import jax.numpy as jnp
import numpy as np

from engine_fixtures import long_window_tiny_voxtral
from jaxstream.engine import first_runs, steps
from jaxstream.engine.builders import build_realtime_core
from jaxstream.engine.config import EngineConfig
from jaxstream.tpu_kernels.ring_attention import reach_buckets
from jaxstream.tpu_kernels.ring_attention.xla import reach_bucket


def _bucket(old_positions: int, window: int) -> int:
    """The branch the XLA path takes for one session with new rows and `old_positions` behind it."""
    return int(reach_bucket(jnp.array([old_positions], jnp.int32), jnp.array([1], jnp.int32), window))


def _covered(lengths, enc_window, dec_window, downsample):
    return ({_bucket(n * downsample, enc_window) for n in lengths}, {_bucket(n, dec_window) for n in lengths})


def test_decode_lengths_reach_every_encoder_bucket_and_the_early_decoder_ones():
    # Voxtral Realtime's windows: 750 encoder frames (5 buckets), 8,192 decoder slots (8 buckets).
    lengths = first_runs.decode_lengths(750, 8192, 4)
    encoder, decoder = _covered(lengths, 750, 8192, 4)
    assert encoder == set(range(len(reach_buckets(750))))
    early = {i for i, reach in enumerate(reach_buckets(8192)) if reach <= first_runs.WARM_SLOTS}
    assert decoder == early and len(early) == 4  # 64 ... 512 slots; 1,024 and beyond are met once, later


def test_prefill_lengths_start_where_prompts_start_one_per_pair_of_buckets():
    # Chunks of 16 from the 31-slot prefix to the longest prompt (71 slots): encoder frames 124, 188, 252, i.e.
    # buckets 128, 256 and 256 of the 750-frame window; the decoder's 64-position bucket throughout.
    assert first_runs.prefill_lengths(31, 71, 16, 750, 8192, 4) == [31, 47]
    assert first_runs.prefill_lengths(0, 39, 48, 750, 8192, 4) == [0]
    assert first_runs.prefill_lengths(31, 71, 16, 12, 96, 4) == [31]  # windows of one bucket each: one run


def test_windows_of_one_bucket_each_run_once():
    assert first_runs.decode_lengths(128, 128, 4) == [31]


def test_the_engine_runs_each_program_at_each_length_and_leaves_its_state_as_it_was(monkeypatch):
    model, tokenizer = long_window_tiny_voxtral(encoder_window=512, decoder_window=1024)
    calls = []
    run = steps.Programs.run

    def recording_run(self, key, batch):
        calls.append((key, set(batch["dec_lengths"].tolist()), set(batch["num_slots"].tolist()),
                      set(batch["slot"].tolist())))
        return run(self, key, batch)

    monkeypatch.setattr(steps.Programs, "run", recording_run)
    config = EngineConfig(max_sessions=2, page_size=16, encoder_page_size=16, batch_buckets=(2,),
                          realtime_step_buckets=(1, 4), realtime_prefill_buckets=((2, 16),))
    core = build_realtime_core(model, config, tokenizer)
    cfg = model.cfg
    lengths = first_runs.decode_lengths(512, 1024, cfg.downsample_factor)
    encoder, decoder = _covered(lengths, 512, 1024, cfg.downsample_factor)
    assert encoder == set(range(4)) and decoder == set(range(4))  # 64, 128, 256, 511 / 64 ... 512 of 1,023
    for k in (1, 4):
        runs = [(n, slots, rows) for key, n, slots, rows in calls if key == ("decode", 2, k)]
        assert [n for n, _, _ in runs] == [{length} for length in lengths]
        assert all(slots == {k} and rows == {-1} for _, slots, rows in runs)  # every row live, no slot row
    assert any(key == ("prefill", 2, 16) for key, *_ in calls)
    # Nothing kept: pages back in their pools, no session slot row written, the null page still zeros.
    assert core.at_baseline()
    state = jax.device_get(core.cache.state)
    for name, rows in state["slots"].items():
        assert not np.any(rows[: config.max_sessions]), name
    for stack in state["stacks"].values():
        for k_pages, v_pages in stack:
            assert not np.any(k_pages[0]) and not np.any(v_pages[0])


def test_a_text_engine_runs_each_program_at_each_early_bucket(monkeypatch):
    from jaxstream.engine.builders import build_text_core
    from jaxstream.engine.testing import ToyLM, toy_config

    calls = []
    run = steps.Programs.run

    def recording_run(self, key, batch):
        calls.append((key, set(batch["lengths"].tolist()), set(batch["num_new"].tolist())))
        return run(self, key, batch)

    monkeypatch.setattr(steps.Programs, "run", recording_run)
    config = EngineConfig(max_sessions=2, page_size=16, batch_buckets=(2,), prefill_buckets=((2, 8),),
                          max_num_batched_tokens=64)
    core = build_text_core(ToyLM(toy_config(vocab_size=97, window=1024)), config)
    assert {_bucket(length, 1024) for length in first_runs.early_reaches(1024)} == set(range(4))  # 64 ... 512
    for key, new in ((("text", 2, 1), 1), (("text", 2, 8), 8)):
        runs = [(lengths, num_new) for called, lengths, num_new in calls if called == key]
        assert runs == [({length}, {new}) for length in (64, 128, 256, 512)]
    assert core.at_baseline()
    for k_pages, v_pages in jax.device_get(core.cache.state)["stacks"]["text"]:
        assert not np.any(k_pages[0]) and not np.any(v_pages[0])
