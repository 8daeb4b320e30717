"""Tokenizers against mistral-common (committed fixture pairs and live decoding), the raw tekken.json
bytes, and sentencepiece itself on a tiny model trained here."""
import base64
import io
import json
import random
from pathlib import Path

import mistral_common
import numpy as np
import pytest
import sentencepiece
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

from jaxstream.engine.text_generation import prompt_token_ids
from jaxstream.models.tokenizers import (
    HFTokenizer,
    SentencePieceTokenizer,
    TekkenTokenizer,
    load_tokenizer,
)

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_TEKKEN = FIXTURES / "voxtral_tiny" / "tekken.json"
BUNDLED_TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
UTF8_TEXTS = [
    "café naïve — привет мир, 日本語のテキスト 😀👍🏽 done",
    " Ünïcödé ∑ 𝔘 e\u0301 ½ ﬁ",
]


def rows(padded: np.ndarray) -> list[list[int]]:
    return [[int(i) for i in row if i >= 0] for row in padded]


def stream_decode(tokenizer, ids) -> tuple[list[str], str]:
    decoder = tokenizer.stream_decoder()
    deltas = [decoder.push(token_id) for token_id in ids]
    deltas.append(decoder.flush())
    assert decoder.text == "".join(deltas)
    # `push_many` over runs of ids (what the schedulers call) gives the same text as one push per id.
    for run in (2, 3, len(ids) or 1):
        batched = tokenizer.stream_decoder()
        parts = [batched.push_many(ids[i : i + run]) for i in range(0, len(ids), run)]
        assert "".join(parts) + batched.flush() == decoder.text
    return deltas, decoder.text


# ------------------------------------------------------------------------------------------------ tekken


@pytest.fixture(scope="module")
def tiny_tekken():
    return load_tokenizer(FIXTURES / "voxtral_tiny")


def test_tekken_matches_mistral_common_fixture_pairs(tiny_tekken):
    reference = np.load(FIXTURES / "voxtral_tiny_reference.npz")
    for ids, text in zip(rows(reference["tok_decode_ids"]), reference["tok_decode_text"]):
        assert tiny_tekken.decode(ids) == str(text)
        assert stream_decode(tiny_tekken, ids)[1] == str(text)
    for text, ids in zip(reference["tok_encode_text"], rows(reference["tok_encode_ids"])):
        assert tiny_tekken.encode(str(text)) == ids


def test_tekken_special_ids_and_audio_config(tiny_tekken):
    assert isinstance(tiny_tekken, TekkenTokenizer)
    assert (tiny_tekken.bos_id, tiny_tekken.eos_id) == (1, 2)
    assert (tiny_tekken.streaming_pad_id, tiny_tekken.streaming_word_id) == (32, 33)
    assert tiny_tekken.vocab_size == 1100
    assert tiny_tekken.is_control(999) and not tiny_tekken.is_control(1000)
    config = tiny_tekken.audio_config
    assert (config.sampling_rate, config.frame_rate, config.num_mel_bins, config.hop_length, config.window_size) == (
        16000, 12.5, 128, 160, 400)
    assert (config.transcription_delay_ms, config.n_left_pad_tokens, config.default_n_delay) == (480, 32, 6)
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tiny_tekken.decode([1100])


@pytest.fixture(scope="module")
def utf8_tekken_path(tmp_path_factory) -> Path:
    """The fixture tekken.json with the first 3000 ranks of mistral-common's bundled vocab: all 256 bytes plus
    merges, among them partial UTF-8 sequences such as b"\\xe2\\x80" and b" \\xd0"."""
    data = json.loads(FIXTURE_TEKKEN.read_text(encoding="utf-8"))
    num_vocab = 3000
    data["vocab"] = json.loads(BUNDLED_TEKKEN.read_text(encoding="utf-8"))["vocab"][:num_vocab]
    data["config"].update(num_vocab_tokens=num_vocab, default_vocab_size=1000 + num_vocab)
    path = tmp_path_factory.mktemp("utf8_tekken") / "tekken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def raw_tekken_bytes(path: Path) -> dict[int, bytes]:
    """Independent oracle: token id -> bytes straight from the JSON (id = rank + 1000)."""
    vocab = json.loads(path.read_text(encoding="utf-8"))["vocab"]
    return {entry["rank"] + 1000: base64.b64decode(entry["token_bytes"]) for entry in vocab}


@pytest.mark.parametrize("text", UTF8_TEXTS, ids=["mixed-scripts-emoji", "combining-math"])
def test_tekken_multibyte_characters_split_across_tokens(utf8_tekken_path, text):
    tokenizer = load_tokenizer(utf8_tekken_path)
    raw = raw_tekken_bytes(utf8_tekken_path)
    ids = tokenizer.encode(text)
    assert all(token_id >= 1000 for token_id in ids)
    assert b"".join(raw[i] for i in ids) == text.encode("utf-8")
    # The case under test really occurs: some tokens are not valid UTF-8 on their own.
    assert any(not is_valid_utf8(raw[i]) for i in ids)
    assert tokenizer.decode(ids) == Tekkenizer.from_file(utf8_tekken_path).decode(ids) == text

    deltas, streamed = stream_decode(tokenizer, ids)
    assert streamed == text and not any("\ufffd" in delta for delta in deltas)
    emitted = ""
    for count, delta in enumerate(deltas[:-1], start=1):
        emitted += delta  # exactly the complete characters of the bytes so far
        assert emitted == b"".join(raw[i] for i in ids[:count]).decode("utf-8", errors="ignore")


def is_valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_tekken_control_ids_inside_a_character_and_truncated_tail(utf8_tekken_path):
    tokenizer = load_tokenizer(utf8_tekken_path)
    raw = raw_tekken_bytes(utf8_tekken_path)
    text = UTF8_TEXTS[0]
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    interleaved = []
    for token_id in ids:  # control ids land inside split characters too: the byte stream still decodes
        interleaved += rng.choice([[], [32], [33], [32, 32]]) + [token_id]
    assert tokenizer.decode(interleaved + [2]) == text
    assert stream_decode(tokenizer, interleaved)[1] == text

    cut = next(k for k in range(1, len(ids)) if not is_valid_utf8(b"".join(raw[i] for i in ids[:k])))
    expected = b"".join(raw[i] for i in ids[:cut]).decode("utf-8", errors="replace")
    assert expected.endswith("\ufffd")
    assert tokenizer.decode(ids[:cut]) == expected
    deltas, streamed = stream_decode(tokenizer, ids[:cut])
    assert streamed == expected and deltas[-1].endswith("\ufffd")


def test_tekken_decode_can_keep_control_ids_by_name_as_mistral_common(utf8_tekken_path):
    """`skip_special_tokens=False` (vLLM's /detokenize): mistral-common's SpecialTokenPolicy.KEEP, each run of text ids
    decoded on its own (a character split by a control id is two U+FFFD, as there)."""
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

    tokenizer = load_tokenizer(utf8_tekken_path)
    raw = raw_tekken_bytes(utf8_tekken_path)
    text_ids = tokenizer.encode(UTF8_TEXTS[0])
    cut = next(k for k in range(1, len(text_ids)) if not is_valid_utf8(b"".join(raw[i] for i in text_ids[:k])))
    ids = [1, *text_ids[:cut], 32, *text_ids[cut:], 33, 2]
    kept = tokenizer.decode(ids, skip_special_tokens=False)
    assert kept == Tekkenizer.from_file(utf8_tekken_path).decode(ids, SpecialTokenPolicy.KEEP)
    assert kept.startswith("<s>") and kept.endswith("[STREAMING_WORD]</s>") and "\ufffd[STREAMING_PAD]\ufffd" in kept
    assert tokenizer.decode(ids) == UTF8_TEXTS[0]


def test_tekken_without_audio_block_or_streaming_specials(utf8_tekken_path, tmp_path):
    data = json.loads(utf8_tekken_path.read_text(encoding="utf-8"))
    del data["audio"]
    for special in data["special_tokens"]:
        if special["token_str"] in ("[STREAMING_PAD]", "[STREAMING_WORD]"):
            special["token_str"] = f"<SPECIAL_{special['rank']}>"
    path = tmp_path / "text_only.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    tokenizer = load_tokenizer(path)
    assert tokenizer.audio_config is None
    assert tokenizer.streaming_pad_id is None and tokenizer.streaming_word_id is None
    assert tokenizer.decode(tokenizer.encode("plain text")) == "plain text"


# ----------------------------------------------------------------------------------------- sentencepiece


WORDS = ("the quick brown fox jumps over a lazy dog hello world streaming audio "
         "café naïve straße привет мир").split()
RARE = ["日本語", "😀", "ß∑", "ÿ"]


def train_spm(directory: Path, byte_fallback: bool) -> sentencepiece.SentencePieceProcessor:
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    sentences += RARE  # seen once: below the 0.98 character coverage, so they fall back to bytes
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, model_type="bpe", byte_fallback=byte_fallback,
        vocab_size=330 if byte_fallback else 150,  # byte fallback needs 256 byte pieces on top
        character_coverage=0.98, minloglevel=2, num_threads=1,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> tuple[Path, sentencepiece.SentencePieceProcessor]:
    directory = tmp_path_factory.mktemp("spm")
    return directory, train_spm(directory, byte_fallback=True)


SPM_TEXTS = ["hello world", "  the café  привет 日本語 😀 ÿ!", "naïve straße ß∑ fox", "x"]


@pytest.mark.parametrize("text", SPM_TEXTS, ids=["ascii", "spaces-bytes", "latin", "one-char"])
def test_sentencepiece_round_trip_and_id_layout(spm_dir, text):
    directory, sp = spm_dir
    tokenizer = load_tokenizer(directory)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == 1000 + sp.get_piece_size()
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.streaming_pad_id, tokenizer.streaming_word_id) == (
        1, 2, 32, 33)
    spm_ids = sp.encode(text)
    ids = tokenizer.encode(text)
    assert ids == [1000 + i for i in spm_ids]
    expected = sp.decode(spm_ids)
    assert tokenizer.decode(ids) == expected
    with_controls = [1, 32] + [x for token_id in ids for x in (token_id, 33)] + [2]
    assert tokenizer.decode(with_controls) == expected
    deltas, streamed = stream_decode(tokenizer, with_controls)
    assert streamed == expected and not any("\ufffd" in delta for delta in deltas)


def primed_text(tokenizer, prompt, ids) -> str:
    """The text a session's detokenizer gives for `ids` generated after `prompt`."""
    decoder = tokenizer.stream_decoder()
    decoder.prime(prompt)
    return "".join(decoder.push(token_id) for token_id in ids) + decoder.flush()


def check_text_continues_the_prompt(tokenizer, ids, prefix=()):
    """vLLM's rule: prompt text + generated text == decode(prompt + generated), at every cut of `ids` that does
    not end the prompt inside a character."""
    checked = 0
    for cut in range(len(ids) + 1):
        prompt = [*prefix, *ids[:cut]]
        if "\ufffd" in tokenizer.decode(prompt):
            continue
        assert tokenizer.decode(prompt) + primed_text(tokenizer, prompt, ids[cut:]) == tokenizer.decode(
            prompt + ids[cut:]), (prompt, ids[cut:])
        checked += 1
    assert checked > 1


@pytest.mark.parametrize("text", SPM_TEXTS, ids=["ascii", "spaces-bytes", "latin", "one-char"])
def test_sentencepiece_text_continues_the_prompt(spm_dir, text):
    """The space sentencepiece strips at the start of a text is a word's space after a prompt with text."""
    tokenizer = load_tokenizer(spm_dir[0])
    ids = tokenizer.encode(text)
    check_text_continues_the_prompt(tokenizer, ids, prefix=[1])
    check_text_continues_the_prompt(tokenizer, ids)


def test_sentencepiece_byte_fallback_pieces_are_exercised(spm_dir):
    directory, sp = spm_dir
    spm_ids = sp.encode(SPM_TEXTS[1])
    assert sum(sp.is_byte(i) for i in spm_ids) >= 4


def test_sentencepiece_unknown_piece_maps_to_control_unk(tmp_path):
    sp = train_spm(tmp_path, byte_fallback=False)
    tokenizer = SentencePieceTokenizer(tmp_path / "tokenizer.model")
    spm_ids = sp.encode("hello ☃ world")
    assert sp.unk_id() in spm_ids
    ids = tokenizer.encode("hello ☃ world")
    assert ids == [0 if i == sp.unk_id() else 1000 + i for i in spm_ids]
    # The unknown piece has no bytes: decoding drops it (sentencepiece itself would print " ⁇ ").
    assert tokenizer.decode(ids) == sp.decode([i for i in spm_ids if i != sp.unk_id()])


# ------------------------------------------------------------------------------------- tokenizer.json


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here on the UTF-8 texts (300 ids: 256 bytes, 41 merges, so
    many characters span several tokens); ids 0..2 are the special <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(UTF8_TEXTS, trainer)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_tokenizer_json_round_trips_and_streams_utf8(hf_tokenizer_dir):
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 300
    assert [tokenizer.is_control(i) for i in (0, 1, 2, 3)] == [True, True, True, False]
    held_back = 0
    for text in UTF8_TEXTS:
        ids = tokenizer.encode(text)
        assert min(ids) > 2  # text ids only: no BOS / EOS added
        assert tokenizer.decode(ids) == text
        deltas, streamed = stream_decode(tokenizer, ids)
        assert streamed == text
        held_back += deltas[:-1].count("")  # a token that ends inside a character shows nothing yet
        assert tokenizer.decode([1] + ids + [2]) == stream_decode(tokenizer, [1] + ids + [2])[1] == text
    assert held_back > 0


def test_tokenizer_json_flush_completes_a_cut_character(hf_tokenizer_dir):
    tokenizer = load_tokenizer(hf_tokenizer_dir / "tokenizer.json")
    ids = tokenizer.encode("ab😀")
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    deltas, streamed = stream_decode(tokenizer, ids[:cut])
    assert streamed == tokenizer.decode(ids[:cut]) and deltas[-1].endswith("\ufffd")


def metaspace_tokenizer_json(path: Path):
    """A Llama-2 / Mistral style tokenizer.json: Metaspace pre-tokenizer, byte fallback, and a decoder whose Strip
    drops the space of a text's first word (ids 0..2 <unk> <s> </s>, 3 + b the byte b, then words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"\u2581{word}": 259 + i for i, word in enumerate(["a", "b", "the", "fox"])}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, **words, "a": 263}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1, right=0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))


def test_tokenizer_json_metaspace_text_continues_the_prompt(tmp_path):
    """The first generated word keeps its space (it was stripped: the decoder never saw the prompt); a prompt
    tail that starts inside a character is stepped back over, as vLLM does."""
    metaspace_tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2)
    chars = [3 + b for b in "\u00e9\u20ac\U0001F600".encode()]
    assert tokenizer.decode([1, 259]) + primed_text(tokenizer, [1, 259], [260, 263, 261]) == "a ba the"
    assert primed_text(tokenizer, [1, 259], [260]) == " b"
    assert primed_text(tokenizer, [1], [260]) == "b"  # no text before it: stripped, as decode([1, 260]) is
    check_text_continues_the_prompt(tokenizer, [259, 260, *chars, 261, 262, 263, *chars, 259], prefix=[1])
    check_text_continues_the_prompt(tokenizer, [259] * 30 + chars + [261, 262])


def test_tokenizer_json_stream_survives_bytes_out_of_utf8_order(tmp_path):
    """Byte-fallback output whose bytes are not UTF-8 in order (a character's lead byte, then a word) broke
    tokenizers' DecodeStream ("Invalid prefix encountered"), and the engine failed the request. vLLM starts a
    fresh stream at that token (FastIncrementalDetokenizer._protected_step); so does HFStreamDecoder: later tokens'
    text still comes (the fresh stream's first word without its space, as vLLM's), and `flush` adds only what the
    fresh stream holds back."""
    metaspace_tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2)
    x, lead = 3 + ord("x"), 3 + 0xC3
    decoder = tokenizer.stream_decoder()
    decoder.prime([1, 259])
    assert [decoder.push(token) for token in (x, lead, 261, 262, lead)] == ["x", "", "the", " fox", ""]
    assert decoder.flush() == "\ufffd" and decoder.text == "xthe fox\ufffd"


def test_tokenizer_json_byte_level_text_continues_the_prompt(hf_tokenizer_dir):
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    for text in UTF8_TEXTS:
        check_text_continues_the_prompt(tokenizer, tokenizer.encode(text), prefix=[1])


def test_tokenizer_json_special_ids(hf_tokenizer_dir, tmp_path):
    path = hf_tokenizer_dir / "tokenizer.json"
    plain = HFTokenizer(path)
    assert (plain.bos_id, plain.eos_id, plain.streaming_pad_id, plain.streaming_word_id) == (None,) * 4
    (tmp_path / "tokenizer.json").write_bytes(path.read_bytes())
    # tokenizer_config.json names them as strings or as AddedToken dicts; explicit ids win.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    named = load_tokenizer(tmp_path)
    assert (named.bos_id, named.eos_id) == (1, 2)
    assert HFTokenizer(tmp_path / "tokenizer.json", eos_id=0).eos_id == 0
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        plain.decode([300])


@pytest.mark.parametrize("post_processor, prefix", [
    (None, (1,)),  # a hand-made tokenizer.json: BOS, as the checkpoint declares it
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}, ()),  # Qwen, GPT-2
    ({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                               {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}, (1,)),  # Llama 3, Mistral
], ids=["none", "byte-level", "template"])
def test_a_prompt_starts_with_what_the_tokenizers_post_processor_adds(hf_tokenizer_dir, tmp_path, post_processor,
                                                                      prefix):
    """vLLM tokenizes a prompt with the tokenizer's special tokens: Qwen's tokenizer.json adds none, though its
    checkpoint declares `bos_token_id` 151643 (it used to start every Qwen prompt)."""
    from tokenizers import Tokenizer

    spec = json.loads((hf_tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": post_processor}))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2)
    assert tokenizer.prompt_prefix == prefix
    if post_processor is not None:  # the tokenizers library's own encoding is the oracle
        text = UTF8_TEXTS[0]
        expected = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
        assert prompt_token_ids(tokenizer, text, first=True) == expected
    assert prompt_token_ids(tokenizer, "ab", first=False) == tokenizer.encode("ab")


# ------------------------------------------------------------------------------------------ load_tokenizer


def test_load_tokenizer_picks_the_implementation(spm_dir, tmp_path):
    directory, _ = spm_dir
    assert isinstance(load_tokenizer(directory / "tokenizer.model"), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(FIXTURE_TEKKEN), TekkenTokenizer)
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.model").write_bytes((directory / "tokenizer.model").read_bytes())
    (both / "tekken.json").write_bytes(FIXTURE_TEKKEN.read_bytes())
    assert isinstance(load_tokenizer(both), TekkenTokenizer)
    (both / "tokenizer.json").write_text("not read: the Voxtral-layout tokenizers come first")
    assert isinstance(load_tokenizer(both), TekkenTokenizer)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="expected one of tekken.json, tokenizer.model, tokenizer.json"):
        load_tokenizer(tmp_path)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a b c")
    with pytest.raises(ValueError, match="unrecognised tokenizer file"):
        load_tokenizer(vocab)


def test_tekken_text_outside_a_truncated_vocab_is_a_clear_error(tiny_tekken):
    # The fixture keeps only byte ranks 0..99, so 'z' (byte 122) has no token: tiktoken would panic.
    with pytest.raises(ValueError, match="cannot be encoded"):
        tiny_tekken.encode("zebra")


def test_unreadable_tokenizer_files_are_one_line_user_errors(tmp_path):
    from jaxstream.errors import UserError

    for name in ("tokenizer.model", "tokenizer.json", "tekken.json"):
        (tmp_path / name).write_bytes(b"\x00 not a tokenizer")
        with pytest.raises(UserError) as err:
            load_tokenizer(tmp_path / name)
        assert isinstance(err.value, ValueError)  # callers that caught ValueError still do
        message = str(err.value)
        assert message.startswith(f"cannot read tokenizer {tmp_path / name}: ") and "\n" not in message


# ------------------------------------------------------------------------------------- text no tokenizer encodes
def test_every_tokenizer_refuses_a_lone_surrogate_with_a_value_error(utf8_tekken_path, spm_dir, hf_tokenizer_dir,
                                                                     capfd):
    """JSON's "\\ud800" is a Python str but no Unicode character: tokenizer.json's Rust encoder raised TypeError
    (a server's 500), tiktoken panicked (printing a Rust backtrace to stderr) and sentencepiece encoded something.
    Every kind now refuses it alike, naming the character and where it is."""
    for tokenizer in (load_tokenizer(utf8_tekken_path), load_tokenizer(spm_dir[0]),
                      load_tokenizer(hf_tokenizer_dir / "tokenizer.json")):
        with pytest.raises(ValueError, match=r"lone UTF-16 surrogate \(U\+DC00\) at character 3"):
            tokenizer.encode("abc\udc00 def")
        assert tokenizer.encode("abc def")  # and encodes what it can
    assert "panicked" not in capfd.readouterr().err


def test_tokenizer_json_token_bytes_are_the_pieces_own(hf_tokenizer_dir, tmp_path):
    """Logprobs' `bytes` let a client rebuild a character split over tokens: each token's own bytes, joined, are the
    text's UTF-8. They were the token decoded alone, U+FFFD for every piece of a multi-byte character (a byte-level
    BPE's, Llama 3's) or a byte-fallback byte (Llama 2's)."""
    tokenizer = load_tokenizer(hf_tokenizer_dir / "tokenizer.json")
    for text in UTF8_TEXTS:
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert any(not is_valid_utf8(tokenizer.token_bytes(i)) for text in UTF8_TEXTS for i in tokenizer.encode(text))
    assert tokenizer.token_bytes(1) == b""  # a special token
    metaspace_tokenizer_json(tmp_path / "tokenizer.json")
    metaspace = HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2)
    euro = "\u20ac".encode()
    assert [metaspace.token_bytes(i) for i in (259, 3 + euro[0], 3 + euro[1], 3 + euro[2], 261, 263)] == \
        [b" a", euro[:1], euro[1:2], euro[2:], b" the", b"a"]
