"""Flax NNX model definitions, the audio front end, tokenizers and checkpoint loaders."""
