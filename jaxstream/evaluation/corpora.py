"""Evaluation corpora: readers for the common layouts, layout auto-detection, `--limit` and `--shard`.

Layouts (`read_corpus(path, layout=None)` picks one when `layout` is None):

- `librispeech`: `<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac` with one `<speaker>-<chapter>.trans.txt`
  per chapter, lines `ID TRANSCRIPT`; the audio sits next to its transcript file. Speaker = the first
  dash-separated field of the id.
- `manifest`: a JSONL, CSV or TSV file (or a directory holding exactly one `*.jsonl` or `*.csv` manifest),
  one utterance per row. Columns (first match wins): audio `audio_filepath | audio_path | audio | path |
  file | wav`; reference text `text | transcript | transcription | sentence | normalized_text`; optional
  `id | utterance_id`, `speaker | speaker_id | client_id | voice`, `duration`, and `words` (a list of `{"word",
  "start", "end"}` in seconds; a JSON string in CSV/TSV). Relative audio paths are relative to the
  manifest's folder. This is the format `jaxstream synth` writes (`manifest.jsonl`, with exact word
  timings). Rows with `token_ids` are `jaxstream transcribe --json` output, whose `text` is the model's
  hypothesis: such a file is never read as a manifest (it would score the model against itself).
- `commonvoice`: a Common Voice language folder (`clips/*.mp3` + `test.tsv`) or one of its TSV files
  (`dev.tsv`, ...), columns `client_id, path, sentence, ...`; speaker = `client_id`.
- `fleurs`: a FLEURS language folder (`test.tsv` + `audio/test/*.wav`) or one of its TSV files; rows
  without a header: `id, file name, raw transcription, normalized transcription, characters,
  num_samples, gender`. The raw transcription is the reference (the normalizer does the rest).
- `folder`: audio files (`.wav .flac .ogg .opus .mp3`) each with a same-name `.txt` transcript.

Auto-detection of a directory tries, in order: a root `*.jsonl` / `*.csv` manifest (a file whose first row
has an audio and a reference text column; several such files are an error), LibriSpeech transcripts,
Common Voice, FLEURS, then a folder of audio + `.txt`. `Corpus.source` names the file (or folder) the
utterances were read from. Readers never open audio: a missing or unreadable file becomes an error entry
of the evaluation run instead of stopping it. Utterances come back sorted by id, which is what makes
`--shard` deterministic across processes and hosts.
"""
import csv
import dataclasses
import io
import json
from pathlib import Path

from jaxstream.engine.transcription_session import WordTiming
from jaxstream.errors import UserError
from jaxstream.models.audio import SAMPLING_RATE

LAYOUTS = ("librispeech", "manifest", "commonvoice", "fleurs", "folder")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3")
MANIFEST_SUFFIXES = (".jsonl", ".csv", ".tsv")

_AUDIO_KEYS = ("audio_filepath", "audio_path", "audio", "path", "file", "wav")
_TEXT_KEYS = ("text", "transcript", "transcription", "sentence", "normalized_text")
_ID_KEYS = ("id", "utterance_id")
# `voice` last: in a `jaxstream synth` corpus the voice is the speaker, so the per-speaker WER is per voice.
_SPEAKER_KEYS = ("speaker", "speaker_id", "client_id", "voice")
_HYPOTHESIS_KEYS = ("token_ids",)  # `jaxstream transcribe --json` rows: their `text` is the model's output
_ROOT_MANIFEST_PATTERNS = ("*.jsonl", "*.csv")
_FLEURS_COLUMNS = 7
_COMMONVOICE_COLUMNS = {"path", "sentence"}


@dataclasses.dataclass(frozen=True)
class Utterance:
    id: str
    audio: str  # path to the audio file
    text: str  # the reference transcript, as the corpus gives it
    speaker: str | None = None
    duration: float | None = None
    words: tuple[WordTiming, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Corpus:
    path: str
    layout: str
    utterances: tuple[Utterance, ...]
    warnings: tuple[str, ...] = ()  # things skipped while reading (audio without a transcript, ...)
    source: str = ""  # the manifest / TSV file the utterances came from, or the tree's folder
    detected: bool = False  # the layout was detected, not given


def read_corpus(path: str | Path, layout: str | None = None) -> Corpus:
    """Reads the corpus at `path` (directory or manifest/TSV file) in `layout`, or the detected one."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"corpus not found: {root}")
    detected = layout is None
    if detected:
        layout = detect_layout(root)
    elif layout not in LAYOUTS:
        raise UserError(f"unknown corpus layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    reader = {"librispeech": _read_librispeech, "manifest": _read_manifest, "commonvoice": _read_commonvoice,
              "fleurs": _read_fleurs, "folder": _read_folder}[layout]
    utterances, warnings, source = reader(root)
    if not utterances:
        raise UserError(f"no utterances found in {root} (read as the {layout} layout)")
    utterances = sorted(utterances, key=lambda u: u.id)
    for previous, current in zip(utterances, utterances[1:]):
        if previous.id == current.id:
            raise UserError(f"duplicate utterance id {current.id!r} in {root}")
    return Corpus(str(root), layout, tuple(utterances), tuple(warnings), str(source), detected)


def detect_layout(root: Path) -> str:
    """The layout of a corpus directory or file; a UserError naming the accepted layouts otherwise."""
    not_taken = ""  # why files that look like manifests were not taken as one
    if root.is_file():
        if root.suffix in (".jsonl", ".json", ".csv"):
            return "manifest"
        if root.suffix == ".tsv":
            return _tsv_layout(root)
    elif root.is_dir():
        manifests, rejected = _root_manifests(root)
        if len(manifests) > 1:
            raise UserError(f"{root} holds several manifests ({', '.join(p.name for p in manifests)}): pass the "
                            "one to evaluate as CORPUS, or --layout to read another layout")
        if manifests:
            return "manifest"
        if next(root.rglob("*.trans.txt"), None) is not None:
            return "librispeech"
        for tsv in sorted(root.glob("*.tsv")):
            tsv_layout = _tsv_layout(tsv)
            if tsv_layout == "commonvoice" and (root / "clips").is_dir():
                return "commonvoice"
            if tsv_layout == "fleurs" and (root / "audio").is_dir():
                return "fleurs"
        if any(_transcript_of(audio).is_file() for audio in _audio_files(root)):
            return "folder"
        not_taken = "".join(f"; not a manifest: {problem}" for problem in rejected)
    raise UserError(
        f"cannot tell the layout of corpus {root}: expected a LibriSpeech tree (*.trans.txt), a JSONL/CSV/TSV "
        "manifest, a Common Voice folder (clips/ + test.tsv), a FLEURS folder (test.tsv + audio/test/) or "
        f"audio files with same-name .txt transcripts (or pass --layout){not_taken}"
    )


def parse_shard(spec: str) -> tuple[int, int]:
    """`"i/N"` -> (i, N) with 0 <= i < N."""
    index, slash, count = spec.partition("/")
    try:
        index_value, count_value = int(index), int(count)
    except ValueError:
        index_value = count_value = -1
    if not slash or count_value < 1 or not 0 <= index_value < count_value:
        raise UserError(f"--shard must be i/N with 0 <= i < N (e.g. 0/4), got {spec!r}")
    return index_value, count_value


def select_utterances(utterances, limit: int | None = None, shard: tuple[int, int] | None = None) -> list:
    """The first `limit` utterances, then every N-th of them starting at i for shard (i, N).

    Limiting first means the N shards of `--limit L` together are exactly the `--limit L` run.
    """
    selected = list(utterances)[:limit] if limit is not None else list(utterances)
    if shard is not None:
        index, count = shard
        selected = selected[index::count]
    return selected


# ---------------------------------------------------------------------------------------------- layouts


def _read_librispeech(root: Path):
    if root.is_file():
        raise UserError(f"the librispeech layout needs a directory, got the file {root}")
    utterances = []
    for transcript in sorted(root.rglob("*.trans.txt")):
        audio_by_id = {audio.stem: audio for audio in _audio_files(transcript.parent, recursive=False)}
        for line_number, line in enumerate(_lines(_read_text(transcript)), 1):
            if not line.strip():
                continue
            utterance_id, _, text = line.strip().partition(" ")
            if not text:
                raise UserError(f"{transcript}:{line_number}: expected 'ID TRANSCRIPT', got {line.strip()!r}")
            audio = audio_by_id.get(utterance_id, transcript.parent / f"{utterance_id}.flac")
            utterances.append(Utterance(utterance_id, str(audio), text.strip(), speaker=utterance_id.split("-")[0]))
    return utterances, [], root


def _read_manifest(root: Path):
    if root.is_dir():
        manifests, rejected = _root_manifests(root)
        if len(manifests) != 1:
            found = ", ".join(p.name for p in manifests) or "none"
            not_taken = "".join(f"; not a manifest: {problem}" for problem in rejected)
            raise UserError(f"expected exactly one JSONL or CSV manifest (rows with an audio and a text column) in "
                            f"{root}, found {found}{not_taken}")
        root = manifests[0]
    if root.suffix in (".jsonl", ".json"):
        rows = []
        for line_number, line in enumerate(_lines(_read_text(root)), 1):
            if line.strip():
                try:
                    rows.append((line_number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{root}:{line_number}: not a JSON object ({exc.msg})") from None
    else:
        delimiter = "\t" if root.suffix == ".tsv" else ","
        reader = csv.DictReader(_csv_source(_read_text(root)), delimiter=delimiter)
        rows = _csv_rows(root, reader)
    utterances = [_manifest_utterance(root, line_number, row) for line_number, row in rows]
    return utterances, [], root


def _manifest_utterance(manifest: Path, line_number: int, row) -> Utterance:
    where = f"{manifest}:{line_number}"
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object per line")
    if any(key in row for key in _HYPOTHESIS_KEYS):
        raise UserError(f"{where}: this is `jaxstream transcribe --json` output; its text is a model's hypothesis, "
                        "not a reference transcript")
    audio = _first_value(row, _AUDIO_KEYS)
    if isinstance(audio, dict):  # Hugging Face datasets style {"path": ..., "sampling_rate": ...}
        audio = audio.get("path")
    # An empty transcript is a valid row (scored as the leaderboard does), so only a missing column fails.
    text = next((row[key] for key in _TEXT_KEYS if row.get(key) is not None), None)
    if audio is None or text is None:
        raise UserError(f"{where}: needs an audio column ({', '.join(_AUDIO_KEYS)}) and a text column "
                        f"({', '.join(_TEXT_KEYS)})")
    audio_path = Path(str(audio))
    if not audio_path.is_absolute():
        audio_path = manifest.parent / audio_path
    utterance_id = _first_value(row, _ID_KEYS)
    if utterance_id is None:
        utterance_id = str(audio)
    speaker = _first_value(row, _SPEAKER_KEYS)
    duration = row.get("duration")
    try:
        duration = float(duration) if duration not in (None, "") else None
        words = _parse_words(row.get("words"))
    except (TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{where}: bad duration or words field ({exc})") from None
    return Utterance(str(utterance_id), str(audio_path), str(text), None if speaker in (None, "") else str(speaker),
                     duration, words)


def _parse_words(value) -> tuple[WordTiming, ...] | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):
        value = json.loads(value)
    return tuple(WordTiming(str(w["word"]), float(w["start"]), float(w["end"])) for w in value)


def _read_commonvoice(root: Path):
    tsv = root / "test.tsv" if root.is_dir() else root
    if not tsv.is_file():
        raise UserError(f"Common Voice folder {root} has no test.tsv (pass the TSV file of another split)")
    clips = tsv.parent / "clips"
    reader = csv.DictReader(_csv_source(_read_text(tsv)), delimiter="\t", quoting=csv.QUOTE_NONE)
    rows = _csv_rows(tsv, reader)
    missing = _COMMONVOICE_COLUMNS - set(reader.fieldnames or ())
    if missing:
        raise UserError(f"{tsv} is not a Common Voice TSV: no {', '.join(sorted(missing))} column")
    utterances = [
        Utterance(row["path"], str(clips / row["path"]), row["sentence"] or "", speaker=row.get("client_id") or None)
        for _, row in rows
    ]
    return utterances, [], tsv


def _read_fleurs(root: Path):
    tsv = root / "test.tsv" if root.is_dir() else root
    if not tsv.is_file():
        raise UserError(f"FLEURS folder {root} has no test.tsv (pass the TSV file of another split)")
    audio_dir = tsv.parent / "audio" / tsv.stem
    utterances = []
    for line_number, line in enumerate(_lines(_read_text(tsv)), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != _FLEURS_COLUMNS:
            raise UserError(f"{tsv}:{line_number}: expected {_FLEURS_COLUMNS} tab-separated FLEURS fields, "
                            f"got {len(fields)}")
        _, file_name, raw_transcription, _, _, num_samples, _ = fields
        duration = int(num_samples) / SAMPLING_RATE if num_samples.isdigit() else None
        utterances.append(Utterance(Path(file_name).stem, str(audio_dir / file_name), raw_transcription,
                                    duration=duration))
    return utterances, [], tsv


def _read_folder(root: Path):
    if root.is_file():
        raise UserError(f"the folder layout needs a directory, got the file {root}")
    utterances, warnings = [], []
    for audio in _audio_files(root):
        transcript = _transcript_of(audio)
        relative = audio.relative_to(root).with_suffix("").as_posix()
        if transcript.is_file():
            utterances.append(Utterance(relative, str(audio), " ".join(_read_text(transcript).split())))
        else:
            warnings.append(f"skipped {audio}: no transcript {transcript.name}")
    return utterances, warnings, root


# ---------------------------------------------------------------------------------------------- helpers


def _tsv_layout(tsv: Path) -> str:
    with open(tsv, encoding="utf-8", errors="replace") as handle:
        first_line = handle.readline().rstrip("\r\n")
    fields = first_line.split("\t")
    if _COMMONVOICE_COLUMNS <= set(fields):
        return "commonvoice"
    if len(fields) == _FLEURS_COLUMNS and fields[5].isdigit():
        return "fleurs"
    return "manifest"


def _root_manifests(root: Path) -> tuple[list[Path], list[str]]:
    """The manifests at the top of a corpus folder, and why the other `*.jsonl` / `*.csv` files there are not.

    A JSON-lines or CSV file lying beside the audio is often something else: `jaxstream transcribe --json`
    output (its `text` is the model's hypothesis), an eval report's CSV, a log. Taking one of those as the
    manifest would score the model against itself, so a file counts only when its first row names an audio
    column and a reference text column."""
    manifests, rejected = [], []
    for path in sorted(p for pattern in _ROOT_MANIFEST_PATTERNS for p in root.glob(pattern)):
        problem = _manifest_problem(path)
        if problem is None:
            manifests.append(path)
        else:
            rejected.append(f"{path.name} ({problem})")
    return manifests, rejected


def _manifest_problem(path: Path) -> str | None:
    """Why the first row of a JSONL / CSV file does not make it a manifest; None when it does."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            if path.suffix == ".csv":
                columns = set(next(csv.reader(handle), []))
            else:
                first = next((line for line in handle if line.strip()), "")
                row = json.loads(first) if first else {}
                columns = {key for key, value in row.items() if value is not None} if isinstance(row, dict) else set()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        return f"unreadable: {exc}"
    if columns & set(_HYPOTHESIS_KEYS):
        return "`jaxstream transcribe --json` output: model hypotheses, no reference text"
    if not columns & set(_AUDIO_KEYS):
        return "no audio column"
    if not columns & set(_TEXT_KEYS):
        return "no reference text column"
    return None


def _audio_files(root: Path, recursive: bool = True) -> list[Path]:
    candidates = root.rglob("*") if recursive else root.iterdir()
    return sorted(p for p in candidates if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())


def _transcript_of(audio: Path) -> Path:
    return audio.with_suffix(".txt")


def _first_value(row: dict, keys: tuple[str, ...]):
    for key in keys:
        value = row.get(key)
        if value not in (None, ""):
            return value
    return None


def _lines(text: str) -> list[str]:
    """The lines of a line-based file. Not `str.splitlines()`: that also breaks at U+2028, U+0085, form feeds
    and \\x1c-\\x1e, which a transcript may hold (`json.dumps(ensure_ascii=False)` writes U+2028 raw)."""
    return [line.rstrip("\r") for line in text.split("\n")]


def _csv_source(text: str) -> io.StringIO:
    """A CSV/TSV file's text for the csv module, which splits the records itself: only at line ends, and not
    inside a quoted field (RFC 4180)."""
    return io.StringIO(text, newline="")


def _csv_rows(path: Path, reader: csv.DictReader) -> list[tuple[int, dict]]:
    """(line number where the record ends, row) of every record of a CSV/TSV file."""
    try:
        return [(reader.line_num, row) for row in reader]
    except csv.Error as exc:  # raised before the line it is in is counted
        raise UserError(f"{path}:{reader.line_num + 1}: not a valid CSV/TSV record ({exc})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
