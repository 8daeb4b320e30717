"""Host work per tick of the realtime transcription scheduler, driven directly (no event loop, no front
end): N streams of the tiny model each receive one 80 ms slot per tick, as in paced real time, and the
engine thread's CPU time and wall time (minus the device wait) are reported per tick.

    python benchmarks/scheduler_tick.py --streams 64,256 --ticks 60
    python benchmarks/scheduler_tick.py --streams 256 --admission window,demand   # the two admission rules

CPU time is the robust number on a shared machine: it does not grow while the thread waits for a core. The
part spent inside XLA's calls (dispatching the program, reading its results) is shown apart from the rest,
the scheduler's own work.
"""
import argparse
import time

import numpy as np

from jaxstream import allocator
from jaxstream.engine.builders import build_realtime_core, freeze_startup_heap
from jaxstream.engine.config import EngineConfig
from jaxstream.engine.transcription_session import AudioBacklog, transcription_prompt
from jaxstream.models import loading


def run(streams: int, ticks: int, seed: int = 0, admission: str = "demand") -> dict:
    directory = loading.resolve_model_dir("tiny")
    loaded = loading.load_model(directory, dtype="float32")
    tokenizer = loading.load_checkpoint_tokenizer(directory, loaded.tokenizer_path)
    config = EngineConfig(max_sessions=streams, batch_buckets=(streams,), realtime_step_buckets=(1,),
                          realtime_prefill_buckets=((min(streams, 16), 48),), realtime_admission=admission)
    core = build_realtime_core(loaded.model, config, tokenizer)
    freeze_startup_heap()  # as `jaxstream serve` does
    cfg = loaded.model.cfg
    n_delay = 6
    prompt = transcription_prompt(cfg, n_delay)
    rng = np.random.default_rng(seed)
    slot_shape = (cfg.mel_frames_per_token, cfg.encoder.num_mel_bins)
    events = []
    for i in range(streams):
        core.add_session(f"s{i}", n_delay=n_delay, prompt_ids=prompt, sink=events.append,
                         backlog=AudioBacklog())
        core.add_audio(f"s{i}", rng.standard_normal((len(prompt), *slot_shape)).astype(np.float32), 0.0)
    while core.has_work():  # prefill every prompt, then one slot per stream per tick
        core.step()
    # Part of the tick's CPU is XLA's, not the scheduler's: XLA:CPU runs the start of a program on the calling
    # thread when the device is idle (a dispatch made while the previous one runs took ~0.2 ms at 256 rows,
    # one made after it ~0.5), and reading a finished program's [256, 1] outputs took 75-90 us each (2 us
    # from a toy program). The scheduler records the CPU inside those calls (TickStats.device_call_cpu_s);
    # it is reported apart.
    first = core.ticks_recorded
    with_commands = []  # the engine thread's CPU per tick including the append commands it applies
    for _ in range(ticks):
        # Each tick's mel is made just before it is appended, as a server's front end makes it (a slab of
        # all ticks made up front is read from memory, not cache: host wall per tick 4.7 ms instead of 2.8
        # at 256 streams).
        slots = rng.standard_normal((streams, 1, *slot_shape)).astype(np.float32)
        cpu_start = time.thread_time()
        core.add_audio_many([(f"s{i}", slots[i], 1280.0, None) for i in range(streams)])  # as the engine thread
        core.step()
        with_commands.append(time.thread_time() - cpu_start)
    stats = core.tick_stats.window(first + 2, core.ticks_recorded)  # the first ticks warm the programs up
    # A tick is recorded by the call that collects it, and the loop's first call only dispatches (the
    # prefill loop left nothing in flight): the records are those of the last calls.
    cpu = np.array([t.host_cpu_s for t in stats]) * 1e3
    commands = np.array(with_commands[-len(stats):]) * 1e3
    xla = np.array([t.device_call_cpu_s for t in stats]) * 1e3
    host = np.array([t.host_s for t in stats]) * 1e3
    rows = np.array([t.rows for t in stats])
    return {"streams": streams, "admission": admission, "ticks": len(stats), "rows_p50": float(np.median(rows)),
            "cpu_ms_p50": float(np.percentile(cpu, 50)), "cpu_ms_p99": float(np.percentile(cpu, 99)),
            "host_ms_p50": float(np.percentile(host, 50)), "host_ms_p99": float(np.percentile(host, 99)),
            "with_commands_ms_p50": float(np.percentile(commands, 50)),
            "xla_calls_ms_p50": float(np.percentile(xla, 50)),
            "scheduler_ms_p50": float(np.percentile(cpu - xla, 50))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--streams", default="64,256", help="concurrent streams, one run each (default: 64,256)")
    parser.add_argument("--ticks", type=int, default=60, help="ticks per run (default: 60)")
    parser.add_argument("--admission", default="demand", help="EngineConfig.realtime_admission values, one run "
                        "each (default: demand)")
    args = parser.parse_args()
    allocator.reexecute_with_tcmalloc()  # on the allocator the jaxstream commands use
    for streams in (int(n) for n in args.streams.split(",")):
        for admission in args.admission.split(","):
            start = time.perf_counter()
            _report(run(streams, args.ticks, admission=admission), start)


def _report(result: dict, start: float) -> None:
    print(f"streams={result['streams']} ({result['admission']} admission): {result['ticks']} ticks, median "
          f"{result['rows_p50']:g} rows; host CPU per tick p50/p99 {result['cpu_ms_p50']:.2f} / "
          f"{result['cpu_ms_p99']:.2f} ms (in XLA's calls p50 {result['xla_calls_ms_p50']:.2f}, the scheduler p50 "
          f"{result['scheduler_ms_p50']:.2f}); host wall (tick minus device wait) p50/p99 "
          f"{result['host_ms_p50']:.2f} / "
          f"{result['host_ms_p99']:.2f} ms; CPU with the append commands p50 {result['with_commands_ms_p50']:.2f} ms "
          f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
