"""Training batches from a synthetic corpus: delayed-streams tokens, mel features, loss masks.

Every stream starts with the same 31 slots of silence (the left pad minus its last slot, whose last mel
frame already reads the first 40 audio samples), so their encoder pass is shared by the whole batch (see
`step.py`); a batch holds the mel from slot 31 on. Streams are cut 4 slots after their last text piece
(the rest of the right pad is pure STREAMING_PAD and costs compute without teaching anything new) and
grouped into length buckets so only a few shapes are ever compiled.
"""
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import soundfile

from jaxstream.errors import UserError
from jaxstream.models import audio as front_end
from jaxstream.models.tokenizers import Tokenizer
from jaxstream.synth.long_streams import join_utterances
from jaxstream.training import targets, vtlp

SHARED_PREFIX_SLOTS = front_end.N_LEFT_PAD_TOKENS - 1
# Classes of the auxiliary character CTC: 0 is the blank, then these characters (space between words).
CTC_CHARACTERS = "abcdefghijklmnopqrstuvwxyz' "
CTC_CLASSES = 1 + len(CTC_CHARACTERS)
_FRAMES_PER_SLOT = 4
_CHAR_BUCKET = 64
_TAIL_SLOTS = 4
BUCKET_SLOTS = 16


class Batch(NamedTuple):
    mel: np.ndarray  # [B, 8 * (T - 31), 128] float32: slots 31 .. T-1
    tokens: np.ndarray  # [B, T] int32
    mask: np.ndarray  # [B, T] float32 (1 where the logits are trained on the next token)
    n_delay: np.ndarray  # [B] float32
    chars: np.ndarray  # [B, max labels] int32: the transcript as CTC classes (characters or phonemes)
    char_padding: np.ndarray  # [B, max labels] float32: 1 past each row's labels
    frames_valid: np.ndarray  # [B] int32: encoder frames of each row from slot 31 on (the rest is padding)


class Example(NamedTuple):
    mel: np.ndarray  # [8 * (T - 31), 128]: the stream's mel from slot 31 on
    tokens: np.ndarray  # [T] int32
    mask: np.ndarray  # [T] float32
    text: str


def word_pieces(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's text ids, encoded alone (sentencepiece gives the same pieces inside a sentence)."""
    return [tokenizer.encode(word) for word in words]


def load_example(corpus_dir: str, record: dict, tokenizer: Tokenizer, n_delay: int, *, cut_tail: bool = True,
                 mel_filters: np.ndarray = front_end.MEL_FILTERS) -> Example:
    """One utterance at one delay as an `Example` (T = its stream's slots, cut after the last piece);
    `mel_filters` replaces the front end's filterbank (a VTLP-warped one, `training/vtlp.py`)."""
    return stream_example(_read_audio(corpus_dir, record), record["words"], record["text"], tokenizer, n_delay,
                          cut_tail=cut_tail, mel_filters=mel_filters)


def load_long_example(corpus_dir: str, records: list[dict], tokenizer: Tokenizer, n_delay: int, *,
                      mel_filters: np.ndarray = front_end.MEL_FILTERS) -> Example:
    """Several utterances as one stream, back to back (`synth.long_streams.join_utterances`): each keeps its own
    lead and tail silence (0.2-1.0 s between sentences in a `jaxstream synth` corpus)."""
    audio, words, text = join_utterances(records, [_read_audio(corpus_dir, record) for record in records],
                                         front_end.SAMPLING_RATE)
    return stream_example(audio, words, text, tokenizer, n_delay, mel_filters=mel_filters)


def _read_audio(corpus_dir: str, record: dict) -> np.ndarray:
    audio, rate = soundfile.read(os.path.join(corpus_dir, record["path"]), dtype="float32")
    if rate != front_end.SAMPLING_RATE:
        raise ValueError(f"{record['path']}: expected {front_end.SAMPLING_RATE} Hz audio, got {rate}")
    return audio


def stream_example(audio: np.ndarray, words: list[dict], text: str, tokenizer: Tokenizer, n_delay: int, *,
                   cut_tail: bool = True, mel_filters: np.ndarray = front_end.MEL_FILTERS) -> Example:
    """The `Example` of 16 kHz `audio` whose `words` (dicts with "word" and "end" in seconds) spell `text`."""
    num_slots = targets.num_stream_slots(audio.size, n_delay)
    tokens, used = targets.stream_tokens([w["end"] for w in words], word_pieces(tokenizer, [w["word"] for w in words]),
                                         n_delay, num_slots)
    if cut_tail:
        num_slots = min(num_slots, max(used, front_end.prompt_length(n_delay)) + _TAIL_SLOTS)
    padded = targets.padded_audio(audio, n_delay)
    # Start two hops before slot 31 so its first frame's window (200 samples each side) lies in the slice.
    lead_frames = 2
    start = SHARED_PREFIX_SLOTS * front_end.SAMPLES_PER_SLOT - lead_frames * front_end.HOP_LENGTH
    mel = front_end.log_mel(padded[start : num_slots * front_end.SAMPLES_PER_SLOT + front_end.WINDOW_SIZE],
                            mel_filters=mel_filters)
    mel = mel[lead_frames : lead_frames + (num_slots - SHARED_PREFIX_SLOTS) * front_end.MEL_FRAMES_PER_SLOT]
    return Example(mel, tokens[:num_slots], targets.loss_mask(num_slots, n_delay), text)


def ctc_classes(text: str) -> np.ndarray:
    """Text -> CTC class ids (characters outside the set are dropped)."""
    return np.array([1 + CTC_CHARACTERS.index(c) for c in text.lower() if c in CTC_CHARACTERS], np.int32)


def collate(examples: list[Example], n_delays: list[int], num_slots: int,
            ctc_labels: list[np.ndarray] | None = None) -> Batch:
    """Pads examples (from `load_example`) into one batch of `num_slots` slots; the auxiliary CTC's targets
    are `ctc_labels` (one row per example), by default each transcript's characters."""
    batch = len(examples)
    mel = np.full((batch, (num_slots - SHARED_PREFIX_SLOTS) * front_end.MEL_FRAMES_PER_SLOT, front_end.NUM_MEL_BINS),
                  _silence_mel_value(), np.float32)
    tokens = np.full((batch, num_slots), targets.StreamTokens().pad, np.int32)
    mask = np.zeros((batch, num_slots), np.float32)
    for row, example in enumerate(examples):
        mel[row, : example.mel.shape[0]] = example.mel
        tokens[row, : example.tokens.size] = example.tokens
        mask[row, : example.mask.size] = example.mask
    if ctc_labels is None:
        ctc_labels = [ctc_classes(example.text) for example in examples]
    chars, char_padding = _padded_rows(ctc_labels)
    frames_valid = np.array([(e.tokens.size - SHARED_PREFIX_SLOTS) * _FRAMES_PER_SLOT for e in examples], np.int32)
    return Batch(mel, tokens, mask, np.asarray(n_delays, np.float32), chars, char_padding, frames_valid)


def _padded_rows(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids -> (ids [B, W], padding [B, W]); W rounded up so few shapes get compiled."""
    width = -(-max(max(row.size for row in rows), 1) // _CHAR_BUCKET) * _CHAR_BUCKET
    ids = np.zeros((len(rows), width), np.int32)
    padding = np.ones((len(rows), width), np.float32)
    for index, row in enumerate(rows):
        ids[index, : row.size] = row
        padding[index, : row.size] = 0.0
    return ids, padding


def _samples(record: dict) -> int:
    return int(round(record["duration"] * front_end.SAMPLING_RATE))


def _silence_mel_value() -> float:
    """The normalised log-mel of digital silence (-0.625): the floor (1.5 - 8 + 4) / 4."""
    return (front_end.GLOBAL_LOG_MEL_MAX - 8.0 + 4.0) / 4.0


def bucket_slots(num_slots: int) -> int:
    return -(-num_slots // BUCKET_SLOTS) * BUCKET_SLOTS


class LongStreams(NamedTuple):
    """Batches of several utterances a row (`load_long_example`): from training step `from_step` on, a `fraction`
    of the batches; each row is utterances drawn at random and kept while their audio stays within `seconds`.
    A served stream outlives the decoder's window, and a model that never heard one loses words once its window
    no longer holds the stream's start. Long batches hold half the rows (a row costs about three usual ones) and
    are padded to one length, so they compile one program (per CTC label width)."""
    fraction: float
    seconds: float
    from_step: int = 0


class BatchStream:
    """An endless stream of training batches, built in a background thread (numpy/FFT release the GIL).

    Each batch draws one length bucket (proportionally to its size), then `batch_size` utterances of it,
    each at a delay drawn from `delays_slots` and, with `vtlp_range = (low, high)`, its features warped by
    a VTLP factor drawn uniformly from that range. `ctc_labels` maps a record to its CTC target (by default
    the transcript's characters; `phonemes.PhonemeLexicon.ctc_labels` for phonemes). The stream starts at
    training step `first_step`; each step's batch is drawn from its own generator, seeded by (seed, step), so a
    resumed run trains on the batches an uninterrupted one would have. With `long_streams`, whether a step's
    batch is a long one, and its utterances, come from a generator of their own, so the other batches stay
    those of a stream without.
    """

    def __init__(self, corpus_dir: str, records: list[dict], tokenizer: Tokenizer, *, batch_size: int,
                 delays_slots: tuple[int, ...], seed: int, first_step: int = 1, prefetch: int = 4,
                 vtlp_range: tuple[float, ...] = (), ctc_labels: Callable[[dict], np.ndarray] | None = None,
                 long_streams: LongStreams | None = None):
        self.corpus_dir, self.records, self.tokenizer, self.ctc_labels = corpus_dir, records, tokenizer, ctc_labels
        self.batch_size, self.delays, self.vtlp_range = batch_size, delays_slots, vtlp_range
        self.seed, self.next_step = seed, first_step
        max_delay = max(delays_slots)
        self.buckets: dict[int, list[int]] = {}
        for index, record in enumerate(records):
            self.buckets.setdefault(bucket_slots(targets.num_stream_slots(_samples(record), max_delay)),
                                    []).append(index)
        self.long_streams = long_streams
        if long_streams is not None:
            if ctc_labels is not None:
                raise ValueError("long streams train the auxiliary CTC on characters only")
            self._long_samples = int(long_streams.seconds * front_end.SAMPLING_RATE)
            # A slot of margin: a record's duration is rounded, its audio may hold a few samples more.
            self._long_slots = bucket_slots(targets.num_stream_slots(self._long_samples + front_end.SAMPLES_PER_SLOT,
                                                                     max_delay))
            self._long_pool = [i for i, record in enumerate(records) if _samples(record) <= self._long_samples]
            if not self._long_pool:
                raise ValueError(f"no utterance is as short as the long streams' {long_streams.seconds} s")
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True)
        self._thread.start()

    def _make(self, step: int) -> Batch:
        if self.long_streams is not None and step >= self.long_streams.from_step:
            long_rng = np.random.default_rng([self.seed, step, 1])
            if long_rng.random() < self.long_streams.fraction:
                return self._make_long(long_rng)
        rng = np.random.default_rng([self.seed, step])
        keys = sorted(self.buckets)
        sizes = np.array([len(self.buckets[k]) for k in keys], np.float64)
        bucket = self.buckets[keys[rng.choice(len(keys), p=sizes / sizes.sum())]]
        chosen = rng.choice(bucket, size=self.batch_size, replace=len(bucket) < self.batch_size)
        n_delays = [int(rng.choice(self.delays)) for _ in chosen]
        examples = [load_example(self.corpus_dir, self.records[i], self.tokenizer, d,
                                 mel_filters=self._mel_filters(rng)) for i, d in zip(chosen, n_delays)]
        num_slots = bucket_slots(max(example.tokens.size for example in examples))
        labels = None if self.ctc_labels is None else [self.ctc_labels(self.records[i]) for i in chosen]
        return collate(examples, n_delays, num_slots, labels)

    def _make_long(self, rng: np.random.Generator) -> Batch:
        rows = []
        for _ in range(max(self.batch_size // 2, 1)):
            chosen, samples = [], 0
            while True:  # the first draw always fits: the pool holds only utterances that fit alone
                index = int(rng.choice(self._long_pool))
                if samples + _samples(self.records[index]) > self._long_samples:
                    break
                chosen.append(index)
                samples += _samples(self.records[index])
            rows.append(chosen)
        n_delays = [int(rng.choice(self.delays)) for _ in rows]
        examples = [load_long_example(self.corpus_dir, [self.records[i] for i in row], self.tokenizer, d,
                                      mel_filters=self._mel_filters(rng)) for row, d in zip(rows, n_delays)]
        return collate(examples, n_delays, self._long_slots)

    def _mel_filters(self, rng: np.random.Generator) -> np.ndarray:
        if not self.vtlp_range:
            return front_end.MEL_FILTERS
        return vtlp.warped_mel_filters(float(rng.uniform(*self.vtlp_range)))

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                self._put(self._make(self.next_step))
                self.next_step += 1
        except Exception as error:  # handed to the consumer: a dead loader must not leave training waiting
            self._put(error)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self._queue.get()
        if isinstance(batch, (ValueError, soundfile.LibsndfileError)):  # the corpus's audio: a wrong rate, a bad file
            raise UserError(f"the training batch loader failed: {batch}") from None
        if isinstance(batch, Exception):
            raise RuntimeError(f"the training batch loader failed: {batch}") from batch
        return batch

    def close(self) -> None:
        self._stop.set()
