"""Synthetic speech corpora for training and testing the embedded tiny model (espeak-ng, offline).

`generate_corpus` writes a LibriSpeech-style corpus plus a JSONL manifest with exact word timings;
`SentenceSampler` draws sentences from the packaged word lists; `synthesize_words` drives espeak-ng.
"""
from jaxstream.synth.corpus import CorpusSpec, generate_corpus, read_manifest
from jaxstream.synth.espeak import HELD_OUT_VARIANTS, TRAIN_VARIANTS, VoiceSpec, synthesize_words
from jaxstream.synth.words import SentenceSampler, is_held_out_sentence, number_words

__all__ = [
    "CorpusSpec", "HELD_OUT_VARIANTS", "SentenceSampler", "TRAIN_VARIANTS", "VoiceSpec", "generate_corpus",
    "is_held_out_sentence", "number_words", "read_manifest", "synthesize_words",
]
