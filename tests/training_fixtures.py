"""The tests' tiny training recipe (a `jaxstream train --config` file: a one-layer model, 3 steps), which
test_training.py and test_training_recipe.py edit and train."""

TINY_TOML = """
[model.encoder]
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 1
head_dim = 32
sliding_window = 64
[model.text]
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 2
num_kv_heads = 1
head_dim = 16
sliding_window = 32
[tokenizer]
model_type = "word"
vocab_size = 4000
[optimizer]
learning_rate = 0.003
warmup_steps = 1
total_steps = 3
[train]
batch_size = 2
delays_ms = [160, 480]
eval_every = 100
checkpoint_every = 1
spelling_init = true
"""
