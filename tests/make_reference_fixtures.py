"""Generate the transformers reference fixtures that the model parity tests read.

Run by hand from the repository root (CI never runs this script; it only reads the committed files):

    pip install torch==2.13.0 transformers mistral-common[audio]
    python tests/make_reference_fixtures.py                 # every fixture
    python tests/make_reference_fixtures.py --only voxtral  # voxtral_tiny* (+ versions.json) only
    python tests/make_reference_fixtures.py --only text     # mistral_tiny*, llama_tiny* (+ versions.json) only
    python tests/make_reference_fixtures.py --only qwen     # qwen2_tiny*, qwen3_tiny* only

The committed fixtures were made with torch 2.13.0+cpu, transformers 5.23.0, mistral-common 1.13.1 and
numpy 2.3 (exact versions in tests/fixtures/versions.json and in every npz under the key `versions`).
Everything is float32, CPU, eager attention and seeded, so a rerun reproduces the same numbers.
Every parameter of every model is perturbed by N(0, 0.2**2) after HF init so that biases, norm weights
and the ada-norm terms are exercised (0.2 rather than 0.05 so that the greedy paths do not collapse onto
one repeated token). Each npz is written with `np.savez_compressed`; string entries are
numpy unicode arrays, so `np.load(path)` works without `allow_pickle`.

Files under tests/fixtures/ (V = 1100, P = prompt length = 33 + n_delay, S = decoder positions):

voxtral_tiny/            complete "HF format + tekken.json" model directory
    config.json, generation_config.json, model.safetensors   `save_pretrained` output (legacy on-disk names:
                         audio_tower.*, language_model.model.*, multi_modal_projector.*; tied lm_head absent)
    preprocessor_config.json                                   VoxtralRealtimeFeatureExtractor defaults
    tekken.json          v13 tekken: 1000 specials + the first 100 ranks of mistral-common's bundled
                         tekken_240911.json vocab (bytes 0..99 only, so no BPE merges), audio block with
                         transcription_delay_ms 480 and 32 left-pad tokens
    Tiny config: audio hidden 32 / ffn 64 / 2 layers / 4 heads x head_dim 12 / 128 mel / sliding window 12 /
    rope theta 1e6; text vocab 1100 / hidden 64 / ffn 96 / 2 layers / 4 q + 2 kv heads x head_dim 24 /
    sliding window 96 / rope theta 1e6 / tied embeddings; downsample 4, 8 mel frames per token.
    The decoder window (96) is at least the number of decoder positions S of every reference stream below
    (91 for d6, 87 for d2), so every generated position attends to the whole prompt, BOS at position 0
    included: [STREAMING_PAD] in place of BOS changes the logits of every generated position (by > 1e-3)
    and the d6 greedy tokens (tests/test_voxtral_prompt.py). The encoder window
    (12 frames) stays far shorter than the streams (364 frames), so the encoder ring still wraps; the
    decoder's sliding window is exercised by the narrow_window_* entries below instead.

voxtral_tiny_reference.npz
    audio                      (52800,)   raw synthetic 3.3 s audio (noise + tones + a silent gap)
    versions                   ()         JSON string of the library versions
    delays                     (2,)       the n_delay values below: [6, 2] (480 ms and 160 ms)
    for each n_delay d in `delays` (key suffix _d6 / _d2):
    padded_audio_d{d}          (N,)       mistral-common AudioEncoder.pad(audio): 40960 zeros left, right
                               zeros to a multiple of 1280 plus (d + 11) * 1280; N = 116480 (d6), 111360 (d2)
    features_d{d}              (1, 128, T_mel)  fe(padded_audio, center=True); T_mel = N / 160 = 8 S
    prompt_ids_d{d}            (1, P)     BOS + [STREAMING_PAD] * (32 + d), from mistral-common
    input_ids_d{d}             (1, S)     prompt + random ids in [1000, 1100)
    logits_d{d}                (1, S, V)  full-sequence forward of input_ids + features
    hidden_states_d{d}         (3, 1, S, 64)  decoder hidden states: input embeds (text + audio), after layer 0,
                               post-final-norm output (HF does not return the raw last-layer output)
    conv_stem_d{d}             (1, T_mel/2, 32)  audio_tower.embedder(features) (conv1 + conv2, GELU)
    encoder_output_d{d}        (1, T_mel/2, 32)  get_audio_features(...).last_hidden_state (after final norm)
    adapter_output_d{d}        (1, S, 64) get_audio_features(...).pooler_output
    t_cond_d{d}                (64,)      time_embedding(d) = [cos, sin]
    generate_d{d}              (1, S)     greedy generate(prompt, features): prompt + S - P new tokens (no EOS hit)
    generate_text_d{d}         ()         mistral-common decode of generate_d{d} (ids < 1000 skipped)
    generate_logits_d{d}       (S-P, V)   the logits that produced each new token of generate
    incremental_logits_d{d}    (S-P+1, V) manual cached run: row 0 = logits at position P-1 after the prefill
                               (prompt + features[..., :8P]); row k = logits at position P-1+k after feeding
                               the previous greedy token with features[..., 8(P-1+k) : 8(P+k)] and all three
                               caches (decoder past_key_values, encoder_past_key_values, padding_cache)
    incremental_tokens_d{d}    (S-P+1,)   argmax of each row; equals generate_d{d}[0, P:] plus one more token
                               (generate never feeds the last audio slot)
    decoder sliding window exercised (same weights, text sliding_window overridden to narrow_window):
    narrow_window              ()         16
    narrow_window_hidden_d6    (1, S, 64) post-final-norm decoder output of the full forward of input_ids_d6 +
                               features_d6 with that window; logits = narrow_window_hidden_d6 @ embed_tokens.T
    front end in isolation (VoxtralRealtimeFeatureExtractor, one unbatched input each):
    mel_filters                (201, 128) Slaney mel filter bank
    fe_input_16000             (16000,)   fe_output_16000_center      (128, 100)  center=True
    fe_input_12345             (12345,)   fe_output_12345_center      (128, 77)   center=True
    fe_input_1680              (1680,)    fe_output_1680_nocenter     (128, 8)    center=False
    tokenizer cases (mistral-common on voxtral_tiny/tekken.json):
    tok_decode_ids             (K, L)     int32 ids, right-padded with -1 (drop the -1s)
    tok_decode_text            (K,)       decode(ids) with special tokens ignored (control ids < 1000 dropped)
    tok_decode_text_keep       (K,)       decode(ids, SpecialTokenPolicy.KEEP)
    tok_encode_text            (J,)       texts made of bytes < 100 (the only ones this vocab covers)
    tok_encode_ids             (J, L2)    encode(text, bos=False, eos=False), right-padded with -1

mistral_tiny/  (config.json, generation_config.json, model.safetensors)  MistralForCausalLM: vocab 256,
    hidden 64, ffn 96, 2 layers, 4 q + 2 kv heads x head_dim 24, sliding window 8, rope theta 1e4, untied.
llama_tiny/    (same files)  LlamaForCausalLM: vocab 256, hidden 64, ffn 96, 2 layers, 8 q + 2 kv heads x
    head_dim 16, no sliding window, rope theta 5e5, tied embeddings.
qwen2_tiny/    (same files)  Qwen2ForCausalLM: vocab 256, hidden 64, ffn 96, 2 layers, 4 q + 2 kv heads x
    head_dim 16, q/k/v biases, rope theta 1e6, rms eps 1e-6, tied embeddings.
qwen3_tiny/    (same files)  Qwen3ForCausalLM: vocab 256, hidden 64, ffn 96, 2 layers, 4 q + 2 kv heads x
    head_dim 24, per-head q/k RMSNorm, attention_bias (all four projections), rope theta 1e6, untied.
    (Made later than the others, with the versions their npz records: versions.json is not rewritten by
    `--only qwen`.)
mistral_tiny_reference.npz, llama_tiny_reference.npz, qwen2_tiny_reference.npz, qwen3_tiny_reference.npz
    input_ids                  (1, 40)    random ids in [3, 256) (length > 2 x the Mistral window)
    logits                     (1, 40, 256)
    prompt_ids                 (1, 5)     input_ids[:, :5]
    generate                   (1, 29)    greedy generate(prompt_ids, max_new_tokens=24), EOS stopping off
    generate_logits            (24, 256)  the logits that produced each new token
    versions                   ()         JSON string

versions.json                  the same library versions.

Every greedy path is checked to have a top-1/top-2 logit margin of at least 1e-3, so f32 re-implementations
reproduce the argmax tokens exactly. Scale for tolerances: Voxtral logits have std ~1.5 and |max| ~7, and
transformers' own cached run differs from its uncached forward by ~1e-5 (absolute), so ~1e-4 absolute is a
fair f32 tolerance for logits. The script also asserts: the streaming front end (centred first chunk, then
1680-sample chunks without centring) equals the offline features to ~1e-7, VoxtralRealtimeProcessor and
MistralCommonBackend load from voxtral_tiny/, and every saved model reloads with identical logits.
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mistral_common
import numpy as np
import torch
import transformers
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy, SpecialTokens
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralCommonBackend,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    VoxtralRealtimeConfig,
    VoxtralRealtimeFeatureExtractor,
    VoxtralRealtimeForConditionalGeneration,
    VoxtralRealtimeProcessor,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Larger than the 0.05 of the spec's recipe: at 0.05 the tiny models' greedy paths collapse onto one or
# two repeated tokens, which would hide token-feedback bugs; at 0.2 they switch tokens often.
PERTURB_STD = 0.2
MIN_GREEDY_MARGIN = 1e-3
SAMPLE_RATE = 16000
SAMPLES_PER_TOKEN = 1280
MEL_PER_TOKEN = 8
HOP = 160
LEFT_PAD_TOKENS = 32
DELAYS = (6, 2)
# The tiny decoder's attention window. It must be >= the decoder positions of every reference stream (S = 91
# for d6, 87 for d2) so that the last generated position still sees BOS at position 0 (a position q attends
# to kv > q - window); 96 is the next multiple of 32. The sliding window itself is tested with NARROW_WINDOW.
DECODER_WINDOW = 96
NARROW_WINDOW = 16
VOXTRAL_VOCAB = 1100
NUM_SPECIAL = 1000

# Ranks the Voxtral Realtime runtime depends on; the other SpecialTokens names get free ranks.
FIXED_SPECIAL_RANKS = {
    0: SpecialTokens.unk, 1: SpecialTokens.bos, 2: SpecialTokens.eos, 3: SpecialTokens.begin_inst,
    4: SpecialTokens.end_inst, 5: SpecialTokens.begin_tools, 6: SpecialTokens.end_tools,
    7: SpecialTokens.begin_tool_results, 8: SpecialTokens.end_tool_results, 9: SpecialTokens.tool_calls,
    10: SpecialTokens.img, 11: SpecialTokens.pad, 12: SpecialTokens.img_break, 13: SpecialTokens.img_end,
    14: SpecialTokens.prefix, 15: SpecialTokens.middle, 16: SpecialTokens.suffix,
    17: SpecialTokens.begin_system, 18: SpecialTokens.end_system, 19: SpecialTokens.begin_tool_content,
    24: SpecialTokens.audio, 25: SpecialTokens.begin_audio, 32: SpecialTokens.streaming_pad,
    33: SpecialTokens.streaming_word, 34: SpecialTokens.audio_to_text,
}

TEKKEN_AUDIO_BLOCK = {
    "sampling_rate": SAMPLE_RATE,
    "frame_rate": 12.5,
    "audio_encoding_config": {"num_mel_bins": 128, "hop_length": HOP, "window_size": 400},
    "chunk_length_s": None,
    "transcription_format": "streaming",
    "transcription_delay_ms": 480,
    "streaming_look_ahead_ms": 2.5,
    "streaming_look_back_ms": 52.5,
    "streaming_n_left_pad_tokens": LEFT_PAD_TOKENS,
}


def library_versions() -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mistral_common": mistral_common.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


def perturb_parameters(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(PERTURB_STD * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def check_greedy_margins(logits: np.ndarray, what: str) -> float:
    """Fails when two logits tie so closely that an f32 re-implementation could pick another argmax."""
    top2 = np.sort(logits.reshape(-1, logits.shape[-1]), axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    if margin < MIN_GREEDY_MARGIN:
        raise SystemExit(f"{what}: greedy margin {margin:.2e} < {MIN_GREEDY_MARGIN}; pick another seed")
    return margin


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    array = tensor.detach().cpu().numpy()
    return array.astype(np.float32) if array.dtype.kind == "f" else array


def padded_int_rows(rows: list[list[int]]) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), -1, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


# --------------------------------------------------------------------------------------------- tokenizer


def write_tiny_tekken(path: Path) -> None:
    bundled = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    source = json.loads(bundled.read_text(encoding="utf-8"))
    num_vocab = VOXTRAL_VOCAB - NUM_SPECIAL
    names = {rank: f"<SPECIAL_{rank}>" for rank in range(NUM_SPECIAL)}
    names.update({rank: str(name) for rank, name in FIXED_SPECIAL_RANKS.items()})
    # mistral-common looks up every SpecialTokens name ([ARGS], [CALL_ID], [THINK], ...), so the ones the
    # runtime does not use still need a rank; 35.. is free.
    unused_names = [name for name in SpecialTokens if name not in FIXED_SPECIAL_RANKS.values()]
    names.update({rank: str(name) for rank, name in zip(range(35, NUM_SPECIAL), unused_names)})
    tekken = {
        "config": {
            "pattern": source["config"]["pattern"],
            "num_vocab_tokens": num_vocab,
            "default_vocab_size": VOXTRAL_VOCAB,
            "default_num_special_tokens": NUM_SPECIAL,
            "version": "v13",
        },
        "vocab": source["vocab"][:num_vocab],
        "special_tokens": [
            {"rank": rank, "token_str": names[rank], "is_control": True} for rank in range(NUM_SPECIAL)
        ],
        "audio": TEKKEN_AUDIO_BLOCK,
    }
    path.write_text(json.dumps(tekken, ensure_ascii=True, separators=(",", ":")), encoding="utf-8")


def load_and_check_tekken(path: Path) -> MistralTokenizer:
    tokenizer = MistralTokenizer.from_file(str(path))
    instruct = tokenizer.instruct_tokenizer
    tekkenizer = instruct.tokenizer
    expected = {0: "<unk>", 1: "<s>", 2: "</s>", 11: "<pad>", 24: "[AUDIO]", 25: "[BEGIN_AUDIO]",
                32: "[STREAMING_PAD]", 33: "[STREAMING_WORD]", 34: "[REPEAT_AUDIO_TEXT]"}
    for rank, token in expected.items():
        assert tekkenizer.get_special_token(token) == rank, (token, rank)
    assert tekkenizer.n_words == VOXTRAL_VOCAB
    assert (tekkenizer.bos_id, tekkenizer.eos_id, tekkenizer.pad_id) == (1, 2, 11)
    audio_encoder = instruct.audio_encoder
    config = audio_encoder.audio_config
    assert config.n_left_pad_tokens == LEFT_PAD_TOKENS
    assert config.get_num_delay_tokens() == 6 and config.get_num_delay_tokens(480) == 6
    assert config.get_num_delay_tokens(160) == 2
    assert config.raw_audio_length_per_tok == SAMPLES_PER_TOKEN and config.audio_length_per_tok == MEL_PER_TOKEN
    assert audio_encoder.special_ids.streaming_pad == 32
    return tokenizer


def tokenizer_cases(tokenizer: MistralTokenizer) -> dict:
    tekkenizer = tokenizer.instruct_tokenizer.tokenizer
    decode_cases = [
        [1, 32, 32, 33, 1040, 1065, 1066, 33, 1032, 1097, 1098, 2],
        [1072, 1069, 1076, 1076, 1079],
        [32, 32, 32, 33, 1083, 33, 1049, 1050, 1051, 1046],
        [33, 1010, 1032, 1099, 1000 + ord("A"), 34, 11, 1000 + ord(" "), 1000 + ord("B")],
        [2],
    ]
    encode_texts = ["HELLO WORLD", " A 12, B 3.5!", "abc ABC", "X\nY\tZ"]
    return {
        "tok_decode_ids": padded_int_rows(decode_cases),
        "tok_decode_text": np.array([tekkenizer.decode(ids, SpecialTokenPolicy.IGNORE) for ids in decode_cases]),
        "tok_decode_text_keep": np.array([tekkenizer.decode(ids, SpecialTokenPolicy.KEEP) for ids in decode_cases]),
        "tok_encode_text": np.array(encode_texts),
        "tok_encode_ids": padded_int_rows([tekkenizer.encode(t, bos=False, eos=False) for t in encode_texts]),
    }


# -------------------------------------------------------------------------------------------- front end


def synthetic_audio(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / SAMPLE_RATE
    chirp = np.sin(2 * np.pi * (300 * t + 400 * t**2))
    tones = 0.3 * np.sin(2 * np.pi * 440 * t) * (t < 1.2) + 0.4 * chirp * (t > 1.6)
    audio = tones + 0.05 * rng.standard_normal(num_samples)
    audio[int(1.2 * SAMPLE_RATE) : int(1.6 * SAMPLE_RATE)] = 0.0  # digital silence hits the -6.5 log clamp
    return audio.astype(np.float32)


def extract(fe: VoxtralRealtimeFeatureExtractor, audio: np.ndarray, center: bool) -> torch.Tensor:
    return fe(audio, sampling_rate=SAMPLE_RATE, center=center, return_tensors="pt")["input_features"]


def frontend_cases(fe: VoxtralRealtimeFeatureExtractor) -> dict:
    arrays = {"mel_filters": fe.mel_filters.astype(np.float32)}
    for length, center, expected_frames in ((16000, True, 100), (12345, True, 77), (1680, False, 8)):
        audio = synthetic_audio(length, seed=length)
        features = to_numpy(extract(fe, audio, center)[0])
        assert features.shape == (128, expected_frames), features.shape
        arrays[f"fe_input_{length}"] = audio
        arrays[f"fe_output_{length}_{'center' if center else 'nocenter'}"] = features
    return arrays


def check_streaming_features(fe, audio: np.ndarray, features: torch.Tensor, n_delay: int) -> float:
    """HF's streaming front end (first chunk centred, then 1680-sample chunks) must equal the offline one."""
    first_samples = (MEL_PER_TOKEN * (n_delay + 1) - 1) * HOP + 200
    first = np.concatenate([np.zeros(LEFT_PAD_TOKENS * SAMPLES_PER_TOKEN, np.float32), audio[:first_samples]])
    chunks = [extract(fe, first, center=True)]
    mel = MEL_PER_TOKEN * (n_delay + 1)
    tail = np.concatenate([audio, np.zeros(features.shape[-1] * HOP, np.float32)])
    while sum(c.shape[-1] for c in chunks) < features.shape[-1]:
        chunks.append(extract(fe, tail[mel * HOP - 200 : mel * HOP - 200 + 1680], center=False))
        mel += MEL_PER_TOKEN
    streamed = torch.cat(chunks, dim=-1)[..., : features.shape[-1]]
    error = float((streamed - features).abs().max())
    assert error < 1e-5, error
    return error


# ---------------------------------------------------------------------------------------------- voxtral


def build_voxtral() -> VoxtralRealtimeForConditionalGeneration:
    rope = {"rope_type": "default", "rope_theta": 1e6}
    config = VoxtralRealtimeConfig(
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          head_dim=12, num_mel_bins=128, sliding_window=12, rms_norm_eps=1e-5,
                          rope_parameters=rope),
        text_config=dict(vocab_size=VOXTRAL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=DECODER_WINDOW,
                         rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True),
        downsample_factor=4, audio_length_per_tok=MEL_PER_TOKEN, default_num_delay_tokens=6,
    )
    config._attn_implementation = "eager"  # the constructor takes no attn_implementation; default is sdpa
    torch.manual_seed(0)
    model = VoxtralRealtimeForConditionalGeneration(config).eval()
    perturb_parameters(model, seed=1)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    return model


def incremental_run(model, prompt_ids: torch.Tensor, features: torch.Tensor, n_delay: int) -> np.ndarray:
    """The cached step-by-step reference: prefill the prompt, then one token + 8 mel frames per step."""
    num_positions = features.shape[-1] // MEL_PER_TOKEN
    prompt_len = prompt_ids.shape[1]
    out = model(input_ids=prompt_ids, input_features=features[..., : MEL_PER_TOKEN * prompt_len],
                num_delay_tokens=n_delay, use_cache=True)
    rows = [out.logits[0, -1]]
    for position in range(prompt_len, num_positions):
        previous = rows[-1].argmax().reshape(1, 1)
        frames = features[..., MEL_PER_TOKEN * position : MEL_PER_TOKEN * (position + 1)]
        out = model(input_ids=previous, input_features=frames, num_delay_tokens=n_delay, use_cache=True,
                    past_key_values=out.past_key_values, encoder_past_key_values=out.encoder_past_key_values,
                    padding_cache=out.padding_cache)
        rows.append(out.logits[0, -1])
    return to_numpy(torch.stack(rows))


def voxtral_delay_reference(model, fe, tokenizer: MistralTokenizer, audio: np.ndarray, n_delay: int) -> dict:
    instruct = tokenizer.instruct_tokenizer
    delay_ms = n_delay * 80
    padded = instruct.audio_encoder.pad(audio, SAMPLE_RATE, transcription_delay_ms=delay_ms).astype(np.float32)
    prompt = instruct.start() + instruct.audio_encoder.encode_streaming_tokens(delay_ms)
    assert prompt == [1] + [32] * (LEFT_PAD_TOKENS + n_delay)
    features = extract(fe, padded, center=True)
    num_positions = features.shape[-1] // MEL_PER_TOKEN
    assert features.shape[-1] == MEL_PER_TOKEN * num_positions == padded.shape[0] // HOP
    # Every position must attend to the whole prompt (BOS at 0), or the reference hides prompt bugs.
    assert model.config.text_config.sliding_window >= num_positions, (model.config.text_config.sliding_window,
                                                                      num_positions)
    rng = np.random.default_rng(100 + n_delay)
    text_ids = rng.integers(NUM_SPECIAL, VOXTRAL_VOCAB, num_positions - len(prompt)).tolist()
    input_ids = torch.tensor([prompt + text_ids])
    prompt_ids = torch.tensor([prompt])

    full = model(input_ids=input_ids, input_features=features, num_delay_tokens=n_delay, output_hidden_states=True)
    audio_out = model.get_audio_features(input_features=features)
    conv_stem = model.model.audio_tower.embedder(features)
    t_cond = model.model.time_embedding(torch.full((1,), float(n_delay)))
    generated = model.generate(input_ids=prompt_ids, input_features=features, num_delay_tokens=n_delay,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
    sequence = generated.sequences
    generate_logits = to_numpy(torch.cat(generated.logits, dim=0))
    assert sequence.shape == (1, num_positions), "generate stopped early (EOS?); pick another seed"
    incremental = incremental_run(model, prompt_ids, features, n_delay)
    incremental_tokens = incremental.argmax(-1)
    assert (incremental_tokens[:-1] == to_numpy(sequence[0, len(prompt):])).all()
    assert np.abs(incremental[:-1] - generate_logits).max() < 1e-4

    # The cached run must also agree with one uncached forward over the greedy sequence.
    greedy_ids = torch.tensor([prompt + incremental_tokens[:-1].tolist()])
    greedy_full = model(input_ids=greedy_ids, input_features=features, num_delay_tokens=n_delay).logits
    full_vs_incremental = float(np.abs(to_numpy(greedy_full[0, len(prompt) - 1 :]) - incremental).max())
    assert full_vs_incremental < 1e-4, full_vs_incremental
    margin = min(check_greedy_margins(incremental, f"voxtral d{n_delay} incremental"),
                 check_greedy_margins(generate_logits, f"voxtral d{n_delay} generate"))
    streaming_error = check_streaming_features(fe, audio, features, n_delay)
    text_fraction = float((incremental_tokens >= NUM_SPECIAL).mean())
    print(f"voxtral d{n_delay}: S={num_positions} T_mel={features.shape[-1]} greedy margin {margin:.2e} "
          f"full-vs-incremental {full_vs_incremental:.1e} streaming-fe {streaming_error:.1e} "
          f"text-token fraction {text_fraction:.2f}")

    suffix = f"_d{n_delay}"
    arrays = {
        "padded_audio": padded,
        "features": to_numpy(features),
        "prompt_ids": to_numpy(prompt_ids),
        "input_ids": to_numpy(input_ids),
        "logits": to_numpy(full.logits),
        "hidden_states": to_numpy(torch.stack(full.hidden_states)),
        "conv_stem": to_numpy(conv_stem),
        "encoder_output": to_numpy(audio_out.last_hidden_state),
        "adapter_output": to_numpy(audio_out.pooler_output),
        "t_cond": to_numpy(t_cond),
        "generate": to_numpy(sequence),
        "generate_text": np.array(tokenizer.decode(sequence[0].tolist(), SpecialTokenPolicy.IGNORE)),
        "generate_logits": generate_logits,
        "incremental_logits": incremental,
        "incremental_tokens": incremental_tokens.astype(np.int64),
    }
    return {key + suffix: value for key, value in arrays.items()}


def narrow_window_reference(model, arrays: dict) -> dict:
    """The same weights with the decoder's sliding window cut to NARROW_WINDOW, run over input_ids_d6: keeps a
    transformers reference for the decoder's sliding window (DECODER_WINDOW covers the whole stream)."""
    config = copy.deepcopy(model.config)
    config.text_config.sliding_window = NARROW_WINDOW
    narrow = VoxtralRealtimeForConditionalGeneration(config).eval()
    narrow.load_state_dict(model.state_dict())
    input_ids, features = torch.from_numpy(arrays["input_ids_d6"]), torch.from_numpy(arrays["features_d6"])
    out = narrow(input_ids=input_ids, input_features=features, num_delay_tokens=6, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    embed = narrow.model.language_model.embed_tokens.weight
    assert (hidden @ embed.T - out.logits).abs().max() < 1e-4  # logits = post-final-norm output @ E^T
    # The narrow window must agree with the full one while it covers everything, and then change the logits.
    full = arrays["logits_d6"][0]
    logits = to_numpy(out.logits[0])
    assert np.abs(logits[:NARROW_WINDOW] - full[:NARROW_WINDOW]).max() < 1e-4
    change = float(np.abs(logits[NARROW_WINDOW:] - full[NARROW_WINDOW:]).max())
    assert change > 0.1, change
    print(f"voxtral narrow window {NARROW_WINDOW}: max |logits - full-window logits| {change:.2f}")
    return {"narrow_window": np.array(NARROW_WINDOW, np.int64), "narrow_window_hidden_d6": to_numpy(hidden)}


def check_processor(model_dir: Path, fe, audio: np.ndarray, reference: dict) -> None:
    """The HF processor's streaming path, loaded from the fixture dir, gives the same prompt and features."""
    processor = VoxtralRealtimeProcessor.from_pretrained(str(model_dir))
    assert processor.num_delay_tokens == 6 and processor.num_samples_first_audio_chunk == 9000
    first = processor(audio[: processor.num_samples_first_audio_chunk], is_streaming=True,
                      is_first_audio_chunk=True, return_tensors="pt")
    assert first["input_ids"].tolist() == reference["prompt_ids_d6"].tolist()
    features = to_numpy(first["input_features"])
    assert features.shape == (1, 128, 312)
    assert np.abs(features - reference["features_d6"][..., :312]).max() < 1e-5
    backend = MistralCommonBackend.from_pretrained(str(model_dir))
    ids = reference["tok_decode_ids"][0]
    assert backend.decode(ids[ids >= 0].tolist(), skip_special_tokens=True) == reference["tok_decode_text"][0]


def make_voxtral() -> None:
    model_dir = FIXTURES / "voxtral_tiny"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tiny_tekken(model_dir / "tekken.json")
    tokenizer = load_and_check_tekken(model_dir / "tekken.json")
    fe = VoxtralRealtimeFeatureExtractor()
    fe.save_pretrained(str(model_dir))
    model = build_voxtral()
    model.save_pretrained(str(model_dir))

    audio = synthetic_audio(52800, seed=0)
    arrays = {"audio": audio, "delays": np.array(DELAYS, np.int64)}
    with torch.no_grad():
        for n_delay in DELAYS:
            arrays.update(voxtral_delay_reference(model, fe, tokenizer, audio, n_delay))
        reloaded = VoxtralRealtimeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        again = reloaded(input_ids=torch.from_numpy(arrays["input_ids_d6"]),
                         input_features=torch.from_numpy(arrays["features_d6"]), num_delay_tokens=6).logits
        assert np.abs(to_numpy(again) - arrays["logits_d6"]).max() < 1e-5, "save/load round trip differs"
        arrays.update(narrow_window_reference(model, arrays))
    arrays.update(frontend_cases(fe))
    arrays.update(tokenizer_cases(tokenizer))
    check_processor(model_dir, fe, audio, arrays)
    save_npz(FIXTURES / "voxtral_tiny_reference.npz", arrays)


# ------------------------------------------------------------------------------------------- text LMs


def make_text_lm(name: str, model_class, config, seed: int) -> None:
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_parameters(model, seed=seed + 1)
    model_dir = FIXTURES / name
    model.save_pretrained(str(model_dir))
    rng = np.random.default_rng(seed)
    input_ids = torch.from_numpy(rng.integers(3, config.vocab_size, (1, 40)))
    prompt_ids = input_ids[:, :5]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        generated = model.generate(input_ids=prompt_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
        reloaded = model_class.from_pretrained(str(model_dir), dtype=torch.float32)
        assert torch.allclose(reloaded(input_ids=input_ids).logits, logits, atol=1e-5)
    generate_logits = to_numpy(torch.cat(generated.logits, dim=0))
    assert generated.sequences.shape == (1, 29)
    margin = check_greedy_margins(generate_logits, f"{name} generate")
    print(f"{name}: greedy margin {margin:.2e}")
    save_npz(FIXTURES / f"{name}_reference.npz", {
        "input_ids": to_numpy(input_ids),
        "logits": to_numpy(logits),
        "prompt_ids": to_numpy(prompt_ids),
        "generate": to_numpy(generated.sequences),
        "generate_logits": generate_logits,
    })


def make_text_lms() -> None:
    mistral = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, sliding_window=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )
    make_text_lm("mistral_tiny", MistralForCausalLM, mistral, seed=10)
    llama = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}, tie_word_embeddings=True,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )
    make_text_lm("llama_tiny", LlamaForCausalLM, llama, seed=20)


def make_qwen_lms() -> None:
    qwen2 = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )
    make_text_lm("qwen2_tiny", Qwen2ForCausalLM, qwen2, seed=40)
    qwen3 = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, attention_bias=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )
    make_text_lm("qwen3_tiny", Qwen3ForCausalLM, qwen3, seed=50)


# ------------------------------------------------------------------------------------------------ main


def save_npz(path: Path, arrays: dict) -> None:
    arrays = {**arrays, "versions": np.array(json.dumps(library_versions(), sort_keys=True))}
    np.savez_compressed(path, **arrays)
    print(f"wrote {path.relative_to(FIXTURES.parent.parent)} ({path.stat().st_size / 1e6:.2f} MB)")
    for key, value in sorted(arrays.items()):
        print(f"    {key:28s} {value.dtype}{list(value.shape)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("voxtral", "text", "qwen"),
                        help="regenerate only the Voxtral fixtures, the Mistral / Llama ones or the Qwen ones "
                             "(default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "voxtral"):
        make_voxtral()
    if args.only in (None, "text"):
        make_text_lms()
    if args.only in (None, "qwen"):
        make_qwen_lms()
    if args.only != "qwen":  # the Qwen fixtures came later: their npz records their versions
        (FIXTURES / "versions.json").write_text(json.dumps(library_versions(), indent=2, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    print(f"tests/fixtures total {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
