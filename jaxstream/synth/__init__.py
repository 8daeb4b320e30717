"""Synthetic speech corpora for training and testing the embedded tiny model (offline).

`generate_corpus` writes a LibriSpeech-style corpus plus a JSONL manifest with word timings. Word-list
corpora (the first tiny model's): `SentenceSampler` draws word sequences from the packaged lists and
`synthesize_words` has espeak-ng speak each word alone. Sentence corpora (v2, the shipped model's and the
default of `jaxstream synth`): `sentences` draws natural sentences (WordNet, fortunes, numbers; `normalize`
makes them spoken words), `engines` speaks them whole with espeak-ng or Festival (flite for held-out sets),
`pico` with SVOX Pico (word times from `alignment`), `spoken` assembles an utterance, `augment` adds rooms, noise, microphone bands and phone lines.
`long_streams` joins a corpus's utterances into long streams (`jaxstream synth --join-seconds`).
"""
from jaxstream.synth.corpus import CorpusSpec, generate_corpus, read_manifest
from jaxstream.synth.espeak import HELD_OUT_VARIANTS, TRAIN_VARIANTS, VoiceSpec, synthesize_words
from jaxstream.synth.words import SentenceSampler, is_held_out_sentence, number_words

__all__ = [
    "CorpusSpec", "HELD_OUT_VARIANTS", "SentenceSampler", "TRAIN_VARIANTS", "VoiceSpec", "generate_corpus",
    "is_held_out_sentence", "number_words", "read_manifest", "synthesize_words",
]
