"""First runs of the step programs at start-up, so that no stream pays for them while serving.

A compiled program's first run at an attention reach bucket (the XLA path switches between static numbers of
old positions, `ring_attention.reach_buckets`) costs more than its later runs: on XLA:CPU YNNPACK builds the
runtimes of that branch's dots and fresh temporary memory faults in. The random mid-size Voxtral
(benchmarks/vs_transformers.py --build-mid) took 93-144 ms for its first 24-row 80 ms step at a new bucket and
43-67 ms for the next ones; 24 paced streams saw ticks of 95-135 ms whenever the batch's longest stream crossed
into a bucket, their p99 tick was 202-236 ms (`jaxstream bench --streams 24 --seconds 10`, three runs) and
their tokens waited up to 0.4-0.9 s. Running each program once per bucket at start-up moves that cost into
the engine's build.

The runs cover the buckets a stream reaches in its first `WARM_SLOTS` slots (every encoder bucket: the
encoder window, 15 s, fills first); a text LM's programs run at its window's buckets up to as many positions.
Further buckets cost more to run than their first-run surplus (a 24-row K = 16 step at the whole 8,191-position
reach takes ~3.8 s on the 2-core CPU), and a process meets each of them once, when its first stream gets that
long.
"""
import jax
import numpy as np

from jaxstream.engine import steps
from jaxstream.tpu_kernels.ring_attention import reach_bucket, reach_buckets

# 41 s of audio: a voice-agent turn; the decoder buckets past it are met once per process, by long streams.
WARM_SLOTS = 512


def decode_lengths(enc_window: int, dec_window: int, downsample: int) -> list[int]:
    """Decoder lengths (slots behind each row) whose decode steps select every encoder reach bucket and every
    decoder bucket up to `WARM_SLOTS`, one length per distinct pair: a length of r slots needs r old decoder
    positions and r x `downsample` encoder frames (both capped by their windows)."""
    lengths = set(early_reaches(dec_window)) | {reach // downsample for reach in reach_buckets(enc_window)}
    return _one_per_bucket_pair(lengths, enc_window, dec_window, downsample)


def prefill_lengths(start: int, longest_prompt: int, chunk: int, enc_window: int, dec_window: int,
                    downsample: int) -> list[int]:
    """Where a prompt's prefill chunks start (from the first slot not in the cached prefix, `chunk` apart),
    one per distinct pair of reach buckets."""
    starts = range(start, max(start + 1, longest_prompt), chunk)
    return _one_per_bucket_pair(starts, enc_window, dec_window, downsample)


def _one_per_bucket_pair(lengths, enc_window: int, dec_window: int, downsample: int) -> list[int]:
    """The shortest of `lengths` for each (encoder, decoder) pair of buckets the XLA path chooses for them."""
    chosen = {}
    for length in sorted(lengths):
        pair = (_bucket(length * downsample, enc_window), _bucket(length, dec_window))
        chosen.setdefault(pair, length)
    return sorted(chosen.values())


def _bucket(old_positions: int, window: int) -> int:
    """The reach bucket of one session with new rows and `old_positions` behind it (the XLA path's own rule)."""
    return int(reach_bucket(np.array([old_positions], np.int32), np.array([1], np.int32), window))


def early_reaches(window: int) -> list[int]:
    """The reach buckets up to `WARM_SLOTS`: as lengths (positions behind each row), each selects its own."""
    return [reach for reach in reach_buckets(window) if reach <= WARM_SLOTS]


def run_once_per_bucket(programs: steps.Programs, key, batch: dict, lengths, *, tables: dict[str, str],
                        length_key: str) -> None:
    """Runs program `key` on `batch` (every row live, no row owning per-slot state) once per length in
    `lengths`, set as the batch's `length_key`; each stack's page table (`tables`: stack -> batch key) points
    every entry at one page borrowed from its pool, given back afterwards (a page's old contents never reach
    a session, which reads only positions it wrote)."""
    cache = programs.cache
    borrowed = {name: cache.pools[name].allocate(1) for name in tables}
    try:
        batch = dict(batch)
        for name, table_key in tables.items():
            batch[table_key] = np.full_like(batch[table_key], borrowed[name][0])
        for length in lengths:
            batch[length_key] = np.full_like(batch[length_key], length)
            jax.block_until_ready(programs.run(key, batch))
    finally:
        for name, pages in borrowed.items():
            cache.pools[name].release(pages)
