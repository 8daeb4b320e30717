"""Tokenizers with Voxtral's id layout, and an incremental UTF-8-safe detokenizer.

Both implementations share the layout of Voxtral Realtime's tekken tokenizer: ids below 1000 are control
ids (0 `<unk>`, 1 `<s>`, 2 `</s>`, 11 `<pad>`, 32 `[STREAMING_PAD]`, 33 `[STREAMING_WORD]`, ...) and are
skipped when decoding; ids from 1000 up are text pieces, each standing for a byte string. Text is the
UTF-8 decoding of the concatenated bytes of all text ids, so a character whose bytes span several tokens
(or tokens separated by control ids) decodes correctly.

- `TekkenTokenizer`: Mistral's `tekken.json` through mistral-common (id = tiktoken rank + 1000).
- `SentencePieceTokenizer`: a sentencepiece `.model` (for small self-trained models), remapped into the
  same layout: the spm unk/bos/eos/pad pieces become ids 0/1/2/11 and every other spm piece i becomes
  id 1000 + i (so spm ids 0..2 leave ids 1000..1002 unused). Ids 32 and 33 are the streaming controls,
  as in tekken. Train the model with `byte_fallback=True`: an unknown piece has no bytes and is dropped.

A Hugging Face `tokenizer.json` (`HFTokenizer`, through the `tokenizers` library) keeps the model's own
id layout instead: its special tokens are its control ids, and text comes from the library's decoder.

`Tokenizer.chat_template` turns a conversation into prompt ids (chat_templates.py): a tokenizer.json's is the jinja
template transformers finds beside it, a tekken tokenizer's is mistral-common's chat encoding; None without one.
`chat_template_for(source)` is the one a server serves when it is given a template of its own (`--chat-template`).

`load_tokenizer(path)` takes a `tekken.json` / `tokenizer.model` / `tokenizer.json` file or a directory
holding one. A file that cannot be read as its kind raises `TokenizerFileError`, a `UserError` naming the file.
"""
import abc
import codecs
import contextlib
import dataclasses
import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path

from jaxstream.models.chat_templates import (
    ChatTemplate, JinjaChatTemplate, MistralChatTemplate, find_chat_template, named_special_tokens,
)
from jaxstream.models.errors import UserError

NUM_CONTROL_IDS = 1000
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 11
STREAMING_PAD_ID, STREAMING_WORD_ID = 32, 33
_SPM_SPACE = "\u2581"
# vLLM primes its incremental detokenizer with the shortest prompt tail of 4 to 23 ids that starts on a
# character boundary (decodes without U+FFFD), else with the whole prompt.
_PRIME_MIN_IDS, _PRIME_MAX_IDS = 4, 23


class TokenizerFileError(UserError, ValueError):
    """A tokenizer file that cannot be read as its kind; the one-line message names the file."""


@contextlib.contextmanager
def _reading(path: Path):
    """Turns a library's failure to read `path` into a `TokenizerFileError`: each library has its own (json's
    and pydantic's ValueErrors, `tokenizers`' bare Exception, sentencepiece's OSError / RuntimeError)."""
    try:
        yield
    except Exception as exc:
        text = str(exc).strip()
        first_line = text.splitlines()[0] if text else type(exc).__name__
        raise TokenizerFileError(f"cannot read tokenizer {path}: {first_line}") from None


def check_encodable(text: str, what: str = "text") -> None:
    """ValueError when `text` holds a lone UTF-16 surrogate (no Unicode character: no UTF-8 for it), naming where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character "
                         f"{exc.start}: it is no Unicode character, so it cannot be tokenized") from None


class Tokenizer(abc.ABC):
    """Common interface: `encode` gives text ids only (no BOS/EOS); `decode` skips control ids unless told not to."""

    bos_id: int | None  # None only for a tokenizer.json whose checkpoint names no BOS / EOS
    eos_id: int | None
    # The EOS the tokenizer's own config names (a tokenizer.json's tokenizer_config.json `eos_token`), which vLLM
    # takes as the model's EOS where a checkpoint declares several; None: the checkpoint's first declared id is.
    named_eos_id: int | None = None
    streaming_pad_id: int | None  # None for tokenizers without the realtime controls (text-only tekken)
    streaming_word_id: int | None
    vocab_size: int
    # sentencepiece drops the space its dummy prefix put before the first piece; tekken keeps every byte.
    strips_leading_space: bool = False
    chat_template: ChatTemplate | None = None
    special_tokens: dict[str, str] = {}  # the named special tokens a jinja chat template sees (`bos_token`, ...)

    @property
    def prompt_prefix(self) -> tuple[int, ...]:
        """The ids a prompt's text follows: what vLLM's `tokenizer.encode(prompt)` (special tokens added) puts
        before the text's ids. BOS for Mistral's and sentencepiece tokenizers."""
        return () if self.bos_id is None else (self.bos_id,)

    def encode(self, text: str) -> list[int]:
        """Text -> text ids (all >= 1000). ValueError for text no tokenizer can encode: a lone UTF-16 surrogate, which
        JSON's \\ud800 escapes and Python's str carry but is no Unicode character (the Rust tokenizers refuse it with a
        TypeError, or a panic)."""
        check_encodable(text)
        return self._encode(text)

    @abc.abstractmethod
    def _encode(self, text: str) -> list[int]:
        """`encode` for text that holds only Unicode characters."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; b"" for control ids. Raises ValueError outside the vocabulary."""

    def is_control(self, token_id: int) -> bool:
        return token_id < NUM_CONTROL_IDS

    def token_string(self, token_id: int) -> str:
        """The text a token stands for, as logprobs show it: its bytes as UTF-8 (a piece of a character as U+FFFD;
        `token_bytes` keeps its bytes), a control token by its name."""
        data = self.token_bytes(token_id)
        if data or not self.is_control(token_id):
            return data.decode("utf-8", "replace")
        return self._control_name(token_id)

    def _control_name(self, token_id: int) -> str:
        return ""

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of all text ids, decoding their concatenated bytes as UTF-8, control ids skipped; or, with
        `skip_special_tokens=False` (vLLM's /detokenize), control ids by name between the texts of the runs of text
        ids around them, as mistral-common decodes with SpecialTokenPolicy.KEEP."""
        if not skip_special_tokens:
            return "".join("".join(map(self._control_name, run)) if control else self.decode(run)
                           for control, run in itertools.groupby(ids, self.is_control))
        decoder = self.stream_decoder()
        return decoder.push_many(ids) + decoder.flush()

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def chat_template_for(self, source: str | None) -> ChatTemplate | None:
        """The chat template to serve: jinja `source` when given (a server's own template), else the tokenizer's."""
        if source is None:
            return self.chat_template
        return JinjaChatTemplate(source, self.special_tokens, self.encode)

    def _checked(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        return token_id


class StreamDecoder:
    """Incremental detokenizer: `push` one id at a time, get back only complete UTF-8 text.

    Bytes of a character split across tokens are held until the character is complete; invalid byte
    sequences become U+FFFD exactly as in a one-shot `bytes.decode("utf-8", "replace")`. The deltas of all
    `push` calls plus `flush()` concatenate to `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._token_bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.strips_leading_space
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._parts)

    def prime(self, prompt_ids: Iterable[int]) -> None:
        """Continues the text of a prompt (returned by nothing), as vLLM's detokenizer starts after the prompt:
        the prompt's text followed by the deltas is `tokenizer.decode(prompt_ids + ids)`. So the space that
        sentencepiece strips at the start of a text is kept after a prompt with text, and a character whose
        bytes the prompt begins is completed by the first deltas."""
        data = b"".join(map(self._token_bytes, prompt_ids))
        if data:
            self._strip_space = False
            self._utf8.decode(data)

    def push(self, token_id: int) -> str:
        return self.push_many((token_id,))

    def push_many(self, token_ids: Iterable[int]) -> str:
        """`push` of each id in turn, in one go (one UTF-8 decode of their joined bytes): the deltas joined."""
        data = b"".join(map(self._token_bytes, token_ids))
        if self._strip_space and data:
            self._strip_space = False
            data = data.removeprefix(b" ")
        delta = self._utf8.decode(data)
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """End of the token stream: an incomplete trailing character becomes U+FFFD."""
        delta = self._utf8.decode(b"", final=True)
        if delta:
            self._parts.append(delta)
        return delta


@dataclasses.dataclass(frozen=True)
class TekkenAudioConfig:
    """The `audio` block of a tekken.json (Voxtral: 16000 Hz, 12.5 Hz, 128 mel, hop 160, window 400)."""

    sampling_rate: int
    frame_rate: float
    num_mel_bins: int
    hop_length: int
    window_size: int
    transcription_delay_ms: float | None  # the model's default delay; None for non-streaming models
    n_left_pad_tokens: int | None

    @property
    def default_n_delay(self) -> int | None:
        if self.transcription_delay_ms is None:
            return None
        return round(self.transcription_delay_ms * self.frame_rate / 1000)


class TekkenTokenizer(Tokenizer):
    """Mistral's tekken tokenizer (`tekken.json`) via mistral-common."""

    def __init__(self, path: str | os.PathLike):
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        with _reading(path):
            tekkenizer = Tekkenizer.from_file(Path(path))
        if tekkenizer.num_special_tokens != NUM_CONTROL_IDS:
            raise TokenizerFileError(
                f"{path}: expected {NUM_CONTROL_IDS} special tokens (the Voxtral id layout), "
                f"got {tekkenizer.num_special_tokens}"
            )
        self._tekkenizer = tekkenizer
        self.vocab_size = tekkenizer.n_words
        self.bos_id = tekkenizer.bos_id
        self.eos_id = tekkenizer.eos_id
        self.streaming_pad_id = self._special_or_none("[STREAMING_PAD]")
        self.streaming_word_id = self._special_or_none("[STREAMING_WORD]")
        self._bytes = [b""] * NUM_CONTROL_IDS + [
            tekkenizer.id_to_byte_piece(token_id) for token_id in range(NUM_CONTROL_IDS, self.vocab_size)
        ]
        self.audio_config = self._audio_config(tekkenizer.audio)
        self.chat_template = MistralChatTemplate(path)

    @property
    def tekkenizer(self):
        """mistral-common's Tekkenizer (what its llguidance wrapper reads: structured outputs)."""
        return self._tekkenizer

    def chat_template_for(self, source: str | None) -> ChatTemplate:
        """mistral-common's encoding whatever `source` says: the text of a jinja template would be tokenized as
        plain text, its control tokens too (vLLM ignores a template given for a Mistral tokenizer as well)."""
        return self.chat_template

    def _special_or_none(self, name: str) -> int | None:
        try:
            return self._tekkenizer.get_special_token(name)
        except ValueError:
            return None

    @staticmethod
    def _audio_config(audio) -> TekkenAudioConfig | None:
        if audio is None:
            return None
        return TekkenAudioConfig(
            sampling_rate=audio.sampling_rate,
            frame_rate=audio.frame_rate,
            num_mel_bins=audio.encoding_config.num_mel_bins,
            hop_length=audio.encoding_config.hop_length,
            window_size=audio.encoding_config.window_size,
            transcription_delay_ms=audio.transcription_delay_ms,
            n_left_pad_tokens=audio.streaming_n_left_pad_tokens,
        )

    def _control_name(self, token_id: int) -> str:
        return self._tekkenizer.id_to_piece(token_id)

    def _encode(self, text: str) -> list[int]:
        try:
            return self._tekkenizer.encode(text, bos=False, eos=False)
        except BaseException as exc:  # tiktoken panics (a BaseException) on bytes a truncated vocab lacks
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"text {text[:40]!r} cannot be encoded with this tekken vocabulary: {exc}") from None

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[self._checked(token_id)]


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model remapped into the Voxtral id layout (see the module docstring)."""

    strips_leading_space = True

    def __init__(self, path: str | os.PathLike):
        import sentencepiece

        with _reading(path):
            self._sp = sentencepiece.SentencePieceProcessor(model_file=os.fspath(path))
        num_pieces = self._sp.get_piece_size()
        self.vocab_size = NUM_CONTROL_IDS + num_pieces
        self.bos_id, self.eos_id = BOS_ID, EOS_ID
        self.streaming_pad_id, self.streaming_word_id = STREAMING_PAD_ID, STREAMING_WORD_ID
        self._control_ids = {
            spm_id: control_id
            for spm_id, control_id in (
                (self._sp.unk_id(), UNK_ID), (self._sp.bos_id(), BOS_ID),
                (self._sp.eos_id(), EOS_ID), (self._sp.pad_id(), PAD_ID),
            )
            if spm_id >= 0
        }
        self._bytes = [b""] * NUM_CONTROL_IDS + [self._piece_bytes(spm_id) for spm_id in range(num_pieces)]

    def _piece_bytes(self, spm_id: int) -> bytes:
        if self._sp.is_control(spm_id) or self._sp.is_unknown(spm_id):
            return b""
        piece = self._sp.id_to_piece(spm_id)
        if self._sp.is_byte(spm_id):  # byte-fallback pieces are spelled <0xAB>
            return bytes([int(piece[3:5], 16)])
        return piece.replace(_SPM_SPACE, " ").encode("utf-8")

    def _encode(self, text: str) -> list[int]:
        return [self._control_ids.get(spm_id, NUM_CONTROL_IDS + spm_id) for spm_id in self._sp.encode(text)]

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[self._checked(token_id)]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) in the model's own id layout.

    Its special tokens are its control ids. `bos_id` / `eos_id` are the ones given (the loader passes those
    the checkpoint's generation_config.json / config.json declare), else those a tokenizer_config.json
    beside the file names, else None; `named_eos_id` is always the tokenizer_config.json's own.
    Text comes from the library's decoder, so every tokenizer family (byte-level BPE, sentencepiece-style
    byte fallback, WordPiece, ...) decodes exactly as transformers decodes it.
    """

    def __init__(self, path: str | os.PathLike, *, bos_id: int | None = None, eos_id: int | None = None):
        import tokenizers

        path = Path(path)
        with _reading(path):
            self._tokenizer = tokenizers.Tokenizer.from_file(os.fspath(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                                      if token.special)
        named = self._named_special_ids(path.parent / "tokenizer_config.json")
        self.bos_id = bos_id if bos_id is not None else named.get("bos_token")
        self.named_eos_id = named.get("eos_token")
        self.eos_id = eos_id if eos_id is not None else self.named_eos_id
        self.streaming_pad_id = self.streaming_word_id = None
        self.special_tokens = named_special_tokens(path.parent)
        self.chat_template = self.chat_template_for(find_chat_template(path.parent))
        spec = json.loads(self._tokenizer.to_str())
        self._piece_bytes = _piece_bytes_rule(spec.get("decoder"))
        self._prompt_prefix = self._special_prefix() if spec.get("post_processor") is not None else None

    def to_json(self) -> str:
        """The tokenizer.json as the library holds it (what llguidance's own tokenizer reads: structured outputs)."""
        return self._tokenizer.to_str()

    @property
    def prompt_prefix(self) -> tuple[int, ...]:
        """What the tokenizer's post-processor puts before a text's ids: `<|begin_of_text|>` for Llama 3 and
        `<s>` for Mistral's tokenizer.json (a TemplateProcessing), nothing for Qwen's and GPT-2's (ByteLevel), whose
        checkpoints still declare a `bos_token_id` that transformers uses only to start an empty prompt. A
        tokenizer.json without a post-processor (a hand-made one) gets BOS when one is known."""
        return super().prompt_prefix if self._prompt_prefix is None else self._prompt_prefix

    def _special_prefix(self) -> tuple[int, ...] | None:
        """The ids the post-processor puts before a text's; None (BOS when known) where its output does not hold
        the text's ids in one run, which no tokenizer we know does."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        return None if start is None else tuple(full[:start])

    def _named_special_ids(self, config_path: Path) -> dict[str, int]:
        """`bos_token` / `eos_token` of a tokenizer_config.json (a string, or an AddedToken dict) -> ids."""
        if not config_path.is_file():
            return {}
        with _reading(config_path):
            config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise TokenizerFileError(f"cannot read tokenizer {config_path}: expected a JSON object")
        ids = {}
        for key in ("bos_token", "eos_token"):
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            token_id = self._tokenizer.token_to_id(token) if isinstance(token, str) else None
            if token_id is not None:
                ids[key] = token_id
        return ids

    def is_control(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _control_name(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id) or ""

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([self._checked(token_id) for token_id in ids],
                                      skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (b"" for special tokens): read from its vocabulary piece where the decoder
        says how (byte-level BPE, byte fallback), so that a piece of a multi-byte character gives its own bytes, as
        logprobs' `bytes` promise (decoded alone it is U+FFFD); else the token decoded on its own."""
        token_id = self._checked(token_id)
        if token_id in self._special_ids:
            return b""
        data = self._piece_bytes(self._tokenizer.id_to_token(token_id) or "")
        return data if data is not None else self._tokenizer.decode([token_id]).encode("utf-8")

    def stream_decoder(self) -> "HFStreamDecoder":
        return HFStreamDecoder(self._tokenizer, self._checked)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel, Llama 3, Qwen): each byte is a printable character, itself
    for the printable Latin-1 bytes, else 256 + its rank among the others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_LEVEL_CHARS = _byte_level_chars()


def _piece_bytes_rule(decoder: dict | None):
    """piece -> its bytes, or None where the tokenizer.json's decoder does not say (the token is then decoded): a
    ByteLevel decoder maps each character to a byte; ByteFallback reads "<0xNN>" pieces as byte NN and others as
    text, with its Replace / Metaspace decoders' replacements (the _SPM_SPACE that stands for a space)."""
    members = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder or {}]
    types = {member.get("type") for member in members}
    if "ByteLevel" in types:
        return lambda piece: (bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
                              if piece and all(c in _BYTE_LEVEL_CHARS for c in piece) else None)
    if "ByteFallback" not in types:
        return lambda piece: None
    replacements = [(member["pattern"]["String"], member["content"]) for member in members
                    if member.get("type") == "Replace" and "String" in member.get("pattern", {})]
    replacements += [(member.get("replacement", _SPM_SPACE), " ") for member in members
                     if member.get("type") == "Metaspace"]

    def piece_bytes(piece: str) -> bytes:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        for pattern, content in replacements:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")

    return piece_bytes


_INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error (its message is its only type)


class HFStreamDecoder:
    """`StreamDecoder` for an `HFTokenizer`: the library's `DecodeStream`, which holds back a character
    whose bytes are incomplete; the deltas plus `flush()` concatenate to `HFTokenizer.decode(ids)`."""

    def __init__(self, tokenizer, checked):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._checked = checked
        self._stream = DecodeStream(skip_special_tokens=True)
        self._prompt: list[int] = []  # the prompt tail the stream was primed with
        self._prompt_text = ""
        self._ids: list[int] = []  # pushed since the stream started
        self._parts: list[str] = []
        self._text_before = 0  # characters of `text` from a stream that broke (`push`)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def prime(self, prompt_ids: Iterable[int]) -> None:
        """Steps the stream through the prompt's tail and drops its text, as vLLM's FastIncrementalDetokenizer
        does: decoders that depend on what precedes a token (Metaspace + Strip drops the space of a text's
        first word) then give the prompt's text + the deltas == `decode(prompt_ids + ids)`."""
        ids = [self._checked(token_id) for token_id in prompt_ids]
        tail = ids
        for count in range(_PRIME_MIN_IDS, min(len(ids), _PRIME_MAX_IDS) + 1):
            if "\ufffd" not in self._tokenizer.decode(ids[-count:], skip_special_tokens=True):
                tail = ids[-count:]
                break
        for token_id in tail:
            self._stream.step(self._tokenizer, token_id)
        self._prompt = tail
        self._prompt_text = self._tokenizer.decode(tail, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        token_id = self._checked(token_id)
        self._ids.append(token_id)
        try:
            delta = self._stream.step(self._tokenizer, token_id) or ""
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # DecodeStream breaks on byte-fallback bytes that do not form UTF-8 in order (a character's lead byte,
            # then text): its text stops being a prefix of the next. vLLM (FastIncrementalDetokenizer's
            # `_protected_step`) starts a fresh stream at that token rather than fail the request; so do we.
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
            # The fresh stream decodes from this token on, unprimed: `flush` compares it with that decode.
            self._prompt, self._prompt_text, self._ids, self._text_before = [], "", [token_id], len(self.text)
            delta = self._stream.step(self._tokenizer, token_id) or ""
        if delta:
            self._parts.append(delta)
        return delta

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(map(self.push, token_ids))

    def flush(self) -> str:
        """End of the token stream: what `decode` gives beyond the text so far (an incomplete character
        that DecodeStream held back, as U+FFFD)."""
        full = self._tokenizer.decode(self._prompt + self._ids, skip_special_tokens=True)
        delta = full[len(self._prompt_text) + len(self.text) - self._text_before:]
        if delta:
            self._parts.append(delta)
        return delta


# Preference order when a directory holds several: the Voxtral-layout tokenizers first.
TOKENIZER_FILES = {"tekken.json": TekkenTokenizer, "tokenizer.model": SentencePieceTokenizer,
                   "tokenizer.json": HFTokenizer}


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tekken.json` (or other `.json`: tekken), `tokenizer.json` (Hugging Face) or `.model`
    (sentencepiece) file, or a directory holding one of `TOKENIZER_FILES` (the first in their order wins)."""
    path = Path(path)
    if path.is_dir():
        for name, implementation in TOKENIZER_FILES.items():
            if (path / name).is_file():
                return implementation(path / name)
        raise FileNotFoundError(f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)}")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if path.name in TOKENIZER_FILES:
        return TOKENIZER_FILES[path.name](path)
    if path.suffix == ".json":
        return TekkenTokenizer(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise ValueError(f"unrecognised tokenizer file {path}: expected a tekken .json or a sentencepiece .model")
