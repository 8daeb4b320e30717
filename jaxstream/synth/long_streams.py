"""Long-stream test sets: a corpus's utterances joined back to back into streams of up to N seconds.

A served stream runs for minutes, past the decoder's window (10.2 s for the tiny model), while a corpus's
utterances last a few seconds each. `join_corpus` rewrites a written corpus as streams of consecutive
utterances (in manifest order, so mostly one voice after another), each stream one audio file with every
word's time shifted by the audio before it, listed in a JSONL manifest that `jaxstream eval` reads.
"""
import json
import os

import numpy as np
import soundfile

from jaxstream.synth.corpus import MANIFEST_NAME

STREAMS_DIR = "streams"


def group_streams(records: list[dict], seconds: float) -> list[list[dict]]:
    """Consecutive records, grouped while their durations add up to at most `seconds` (a longer record alone)."""
    groups: list[list[dict]] = []
    total = 0.0
    for record in records:
        if groups and total + record["duration"] <= seconds:
            groups[-1].append(record)
            total += record["duration"]
        else:
            groups.append([record])
            total = record["duration"]
    return groups


def join_utterances(records: list[dict], audios: list[np.ndarray], rate: int) -> tuple[np.ndarray, list[dict], str]:
    """Utterances back to back: (their audio, their words with times shifted by the audio before them, their
    texts joined). Training's long-stream rows are made this way too (`training/data.py`)."""
    words, offset = [], 0.0
    for record, audio in zip(records, audios):
        words += [{**w, "start": w["start"] + offset, "end": w["end"] + offset} for w in record["words"]]
        offset += audio.size / rate
    return np.concatenate(audios), words, " ".join(record["text"] for record in records)


def join_corpus(corpus_dir: str, records: list[dict], out_dir: str, seconds: float) -> list[dict]:
    """Writes `records` (a `jaxstream synth` manifest's, audio under `corpus_dir`) as streams under `out_dir`:
    OUT/streams/stream-NNNN.flac and OUT/manifest.jsonl. Returns the streams' records. ValueError when the
    records' audio comes at more than one sampling rate."""
    os.makedirs(os.path.join(out_dir, STREAMS_DIR), exist_ok=True)
    streams, rates = [], set()
    for index, group in enumerate(group_streams(records, seconds)):
        audios = []
        for record in group:
            audio, rate = soundfile.read(os.path.join(corpus_dir, record["path"]), dtype="float32")
            rates.add(rate)
            if len(rates) > 1:
                raise ValueError(f"cannot join audio at {sorted(rates)} Hz into one stream")
            audios.append(audio)
        audio, words, text = join_utterances(group, audios, rate)
        path = os.path.join(STREAMS_DIR, f"stream-{index:04d}.flac")
        soundfile.write(os.path.join(out_dir, path), audio, rate, format="FLAC")
        streams.append({"id": f"stream-{index:04d}", "path": path, "text": text,
                        "words": [{**w, "start": round(w["start"], 4), "end": round(w["end"], 4)} for w in words],
                        "duration": round(audio.size / rate, 4), "utterances": [r["id"] for r in group],
                        "voices": [r["voice"] for r in group]})
    with open(os.path.join(out_dir, MANIFEST_NAME), "w") as f:
        f.writelines(json.dumps(stream) + "\n" for stream in streams)
    return streams
