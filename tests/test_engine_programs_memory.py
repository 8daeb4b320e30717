"""Every compiled step program updates the KV state in place: XLA aliases the donated state whole to the program's
output and keeps no copy of it (`Programs.memory`, XLA's own account). A program that copied a page pool would
need its size again in temporaries: on an accelerator that halves the sessions the pools can hold, or fails to
fit (Voxtral 4B's pools are most of a GPU's memory)."""
import jax

from engine_fixtures import long_window_tiny_voxtral
from jaxstream.engine.builders import build_realtime_core, build_text_core
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.testing import ToyLM, toy_config


def _assert_in_place(programs, state) -> None:
    """The state aliased whole, and temporaries under the smallest stack's size: a copy of any pool would not fit.
    (The XLA reference path gathers every row's window, whole pools' worth at these sizes: the kernels' programs
    are the ones checked.)"""
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))
    smallest_stack = min(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(stack))
                         for stack in state["stacks"].values())
    for key in programs.keys():
        memory = programs.memory(key)
        assert memory.alias_size_in_bytes == state_bytes, (key, memory)
        assert memory.temp_size_in_bytes < smallest_stack, (key, memory.temp_size_in_bytes, smallest_stack)


def test_realtime_programs_update_the_kv_state_in_place():
    model, tokenizer = long_window_tiny_voxtral(encoder_window=512, decoder_window=1024)
    config = EngineConfig(max_sessions=4, page_size=16, encoder_page_size=16, batch_buckets=(4,),
                          realtime_step_buckets=(1, 4), realtime_prefill_buckets=((4, 16),))
    core = build_realtime_core(model, config, tokenizer)
    _assert_in_place(core.programs, core.cache.state)


def test_text_programs_update_the_kv_state_in_place():
    config = EngineConfig(max_sessions=4, page_size=16, batch_buckets=(4,), prefill_buckets=((4, 8),),
                          max_num_batched_tokens=64)
    core = build_text_core(ToyLM(toy_config(vocab_size=97, window=1024)), config)
    _assert_in_place(core.programs, core.cache.state)
