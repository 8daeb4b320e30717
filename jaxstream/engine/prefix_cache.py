"""The silent-prefix cache of transcription streams: the start every stream shares, computed once.

Every Voxtral Realtime stream begins with 32 slots of left-pad silence under the same prompt ids (BOS, then
`[STREAMING_PAD]`), and the features of the first 31 of them come from the padding alone
(`models.audio.silent_prefix_slots`). Their encoder KV and conv-stem state are the same in every stream;
their decoder KV depends only on the delay (the decoder's time conditioning). So the engine computes them
once per delay at start-up, into pages held out of the pools, and a new stream's first prefill copies
those pages into its own and starts at slot 31: with the default 480 ms delay a stream's prompt costs 8
slots of compute instead of 39. That is a third of the positions of a 3.5 s utterance, but batched prefill
positions are cheap next to the sequential decode steps: with the tiny model on a 2-core CPU the engine
saves a few percent of its time, and a burst of streams starting together waits less.

The cached pages are the ones an uncached stream would write (same programs, same inputs, same
positions), so outputs are those of the full prefill up to the usual batch-order rounding. The cache
holds whole pages: a copied page's positions past the prefix are rewritten by the stream before any query
can reach them. It is off when a window is shorter than the prefix (the ring would wrap inside it).
"""
import math

import numpy as np

from jaxstream.engine import steps
from jaxstream.engine.kv_cache import NULL_PAGE, DeviceCache
from jaxstream.engine.transcription_session import transcription_prompt
from jaxstream.models.audio import ALLOWED_DELAYS_MS, n_delay_from_ms, offline_features, silent_prefix_slots

RESERVED_SLOTS = 1  # the device slot row whose conv state the cached prefix leaves behind


def prefix_layout(model_cfg, specs, enabled: bool) -> tuple[int, dict[str, int]]:
    """(slots, pages a stream's copy of it spans per stack) of the prefix cache of a model over stacks `specs`
    (name -> `StackSpec`); (0, no pages) when disabled or when a window cannot hold the prefix."""
    slots = silent_prefix_slots(model_cfg.n_left_pad_tokens) if enabled else 0
    positions = {"encoder": model_cfg.downsample_factor * slots, "decoder": slots}
    if not slots or any(positions[name] > specs[name].ring for name in positions):
        return 0, {name: 0 for name in positions}
    return slots, {name: math.ceil(positions[name] / specs[name].page_size) for name in positions}


def held_out_pages(model_cfg, specs, enabled: bool) -> dict[str, int]:
    """Pages per pool the prefix cache holds: one copy of the encoder's, one of the decoder's per delay."""
    _, pages = prefix_layout(model_cfg, specs, enabled)
    return {"encoder": pages["encoder"], "decoder": len(delays()) * pages["decoder"]}


def delays() -> list[int]:
    """Every delay (in slots) a stream may ask for: each gets its own cached decoder pages."""
    return sorted({n_delay_from_ms(ms) for ms in ALLOWED_DELAYS_MS})


class PrefixCache:
    """The cached prefix's pages and slot row, and what a stream's first prefill copies from them.

    `build` (at start-up, and again if a failed dispatch consumed the device state) runs the ordinary
    prefill program over the silent slots once per delay; `fill` writes the copy instructions of the rows
    starting from the prefix into a prefill batch."""

    def __init__(self, cache: DeviceCache, model_cfg, enabled: bool):
        self.model_cfg = model_cfg
        self.slots, pages = prefix_layout(model_cfg, cache.specs, enabled)
        self.row = cache.max_sessions  # the reserved slot row
        # Pages per batch row of the copy fields (at least one, all null, when the cache is off).
        self.pages_per_row = (max(1, pages["encoder"]), max(1, pages["decoder"]))
        self.encoder_pages = np.zeros(self.pages_per_row[0], np.int32)
        # Decoder pages per delay: row n_delay of this table (null for delays never cached).
        self.decoder_pages = np.zeros((max(delays()) + 1, self.pages_per_row[1]), np.int32)
        if self.slots:
            if cache.state["slots"]["conv1"].shape[0] <= self.row:
                raise ValueError("the device cache has no reserved slot row for the prefix cache")
            held_out = held_out_pages(model_cfg, cache.specs, enabled)
            self.encoder_pages[:] = cache.pools["encoder"].pin(held_out["encoder"])
            self.decoder_pages[delays()] = cache.pools["decoder"].pin(held_out["decoder"]).reshape(len(delays()), -1)

    def build(self, programs: steps.Programs, prefill_buckets) -> None:
        """Computes the prefix of every delay into the held-out pages, with the smallest prefill bucket that
        holds it (in pieces if none does)."""
        if not self.slots:
            return
        cfg, specs = self.model_cfg, programs.cache.specs
        rows, chunk = min(prefill_buckets, key=lambda bucket: (bucket[1] < self.slots, bucket[0], bucket[1]))
        mel = offline_features(np.zeros(0, np.float32), 1, n_left_pad_tokens=cfg.n_left_pad_tokens)
        mel = mel[: cfg.mel_frames_per_token * self.slots]
        ids = transcription_prompt(cfg, 1)[: self.slots]  # the same for every delay
        tables = {name: np.full(spec.pages_per_window, NULL_PAGE, np.int32) for name, spec in specs.items()}
        tables["encoder"][: len(self.encoder_pages)] = self.encoder_pages
        for n_delay in delays():
            tables["decoder"][: self.pages_per_row[1]] = self.decoder_pages[n_delay]
            for start in range(0, self.slots, chunk):
                count = min(chunk, self.slots - start)
                batch = steps.realtime_batch(rows, chunk, cfg, specs["encoder"].pages_per_window,
                                             specs["decoder"].pages_per_window, with_tokens=True,
                                             prefix_pages=self.pages_per_row)
                frames = cfg.mel_frames_per_token
                batch["mel"][0, : frames * count] = mel[frames * start : frames * (start + count)]
                batch["token_ids"][0, :count] = ids[start : start + count]
                batch["slot"][0] = batch["conv_from"][0] = self.row
                batch["num_slots"][0] = count
                batch["enc_table"][0], batch["dec_table"][0] = tables["encoder"], tables["decoder"]
                batch["dec_lengths"][0] = start
                batch["n_delay"][0] = n_delay
                programs.run(("prefill", rows, chunk), batch)

    def fill(self, batch: dict, starts: np.ndarray, enc_tables: np.ndarray, dec_tables: np.ndarray,
             n_delay: np.ndarray) -> None:
        """Adds a prefill batch's prefix fields. Its first `len(starts)` rows have these first positions,
        page tables and delays: those starting at the prefix copy it and start their conv stem from the
        cache's slot row; every other row copies nothing and reads its own slot row."""
        batch["conv_from"] = batch["slot"].copy()
        for key, pages in zip(("prefix_enc", "prefix_dec"), self.pages_per_row):
            batch[key] = np.zeros((len(batch["slot"]), 2, pages), np.int32)
        if not self.slots:
            return
        copying = np.flatnonzero(starts == self.slots)
        enc, dec = self.pages_per_row
        batch["prefix_enc"][copying, 0] = self.encoder_pages
        batch["prefix_enc"][copying, 1] = enc_tables[copying, :enc]
        batch["prefix_dec"][copying, 0] = self.decoder_pages[n_delay[copying].astype(np.int64)]
        batch["prefix_dec"][copying, 1] = dec_tables[copying, :dec]
        batch["conv_from"][copying] = self.row
