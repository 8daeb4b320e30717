"""Corpus readers: every layout parses into the utterances written, detection, --limit/--shard selection."""
import csv
import json

import numpy as np
import pytest
import soundfile

from jaxstream.errors import UserError
from jaxstream.evaluation import WordTiming, detect_layout, parse_shard, read_corpus, select_utterances

RATE = 16000


def _write_audio(path, seconds=0.2):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(str(path)))
    soundfile.write(path, 0.1 * rng.standard_normal(int(seconds * RATE)).astype(np.float32), RATE)


def _expected(utterances):
    """(id, audio, text, speaker) of parsed utterances, sorted as the readers sort them."""
    return sorted((u.id, u.audio, u.text, u.speaker) for u in utterances)


def test_librispeech_layout(tmp_path):
    written = []
    for speaker, chapter, texts in [("84", "121123", ["GO DO YOU HEAR", "BUT IN LESS THAN FIVE MINUTES"]),
                                    ("1272", "128104", ["MISTER QUILTER IS THE APOSTLE"])]:
        folder = tmp_path / "test-clean" / speaker / chapter
        lines = []
        for index, text in enumerate(texts):
            utterance_id = f"{speaker}-{chapter}-{index:04d}"
            _write_audio(folder / f"{utterance_id}.flac")
            lines.append(f"{utterance_id} {text}\n")
            written.append((utterance_id, str(folder / f"{utterance_id}.flac"), text, speaker))
        (folder / f"{speaker}-{chapter}.trans.txt").write_text("".join(lines))
    corpus = read_corpus(tmp_path)
    assert corpus.layout == "librispeech"
    assert _expected(corpus.utterances) == sorted(written)
    assert [u.id for u in corpus.utterances] == sorted(u.id for u in corpus.utterances)


def test_jsonl_manifest_with_word_times(tmp_path):
    records = [
        {"id": "b", "audio": "audio/b.wav", "text": "hello there", "speaker": "s1", "duration": 0.2,
         "words": [{"word": "hello", "start": 0.01, "end": 0.08}, {"word": "there", "start": 0.1, "end": 0.19}]},
        {"audio_filepath": str(tmp_path / "audio" / "a.wav"), "text": "", "speaker_id": 7},  # NeMo-style keys
    ]
    for name in ("a", "b"):
        _write_audio(tmp_path / "audio" / f"{name}.wav")
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    for source in (manifest, tmp_path):  # the file, or a folder holding exactly one *.jsonl
        corpus = read_corpus(source)
        assert corpus.layout == "manifest"
        first, second = corpus.utterances
        assert (first.id, first.audio, first.text, first.speaker) == (
            str(tmp_path / "audio" / "a.wav"), str(tmp_path / "audio" / "a.wav"), "", "7")
        assert (second.id, second.audio, second.speaker, second.duration) == (
            "b", str(tmp_path / "audio" / "b.wav"), "s1", 0.2)
        assert second.words == tuple(WordTiming(w["word"], w["start"], w["end"]) for w in records[0]["words"])


def test_a_synthetic_corpus_voice_is_its_speaker_unless_a_speaker_is_given(tmp_path):
    _write_audio(tmp_path / "a.wav")
    rows = [{"path": "a.wav", "id": "x", "text": "hi", "engine": "flite", "voice": "slt"},
            {"path": "a.wav", "id": "y", "text": "hi", "voice": "slt", "speaker": "p225"}]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [(u.id, u.speaker) for u in read_corpus(tmp_path).utterances] == [("x", "slt"), ("y", "p225")]


@pytest.mark.parametrize("suffix,delimiter", [(".csv", ","), (".tsv", "\t")])
def test_csv_and_tsv_manifests(tmp_path, suffix, delimiter):
    rows = [{"path": "x1.flac", "transcript": 'say "yes", then no', "speaker": "a",
             "words": json.dumps([{"word": "say", "start": 0.0, "end": 0.1}])},
            {"path": "x2.flac", "transcript": "second one", "speaker": "", "words": ""}]
    manifest = tmp_path / f"list{suffix}"
    with open(manifest, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    corpus = read_corpus(manifest)
    assert corpus.layout == "manifest"
    assert _expected(corpus.utterances) == [("x1.flac", str(tmp_path / "x1.flac"), 'say "yes", then no', "a"),
                                            ("x2.flac", str(tmp_path / "x2.flac"), "second one", None)]
    assert corpus.utterances[0].words == (WordTiming("say", 0.0, 0.1),)
    assert corpus.utterances[1].words is None


def test_common_voice_layout(tmp_path):
    header = ["client_id", "path", "sentence", "up_votes", "down_votes", "age", "gender", "accents", "locale",
              "segment"]
    rows = [["c1", "common_voice_en_1.mp3", 'He said "hi".', "2", "0", "", "", "", "en", ""],
            ["c2", "common_voice_en_2.mp3", "Another sentence", "3", "1", "twenties", "male", "us", "en", ""]]
    (tmp_path / "clips").mkdir()
    (tmp_path / "test.tsv").write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n")
    (tmp_path / "dev.tsv").write_text("\t".join(header) + "\n" + "\t".join(rows[1]) + "\n")
    corpus = read_corpus(tmp_path)
    assert corpus.layout == "commonvoice"
    assert _expected(corpus.utterances) == sorted((r[1], str(tmp_path / "clips" / r[1]), r[2], r[0]) for r in rows)
    dev = read_corpus(tmp_path / "dev.tsv")  # another split, given as its TSV file
    assert dev.layout == "commonvoice" and [u.id for u in dev.utterances] == [rows[1][1]]


def test_fleurs_layout(tmp_path):
    rows = [["1001", "7019.wav", "The raw, Cased text.", "the raw cased text", "t|h|e", "32000", "FEMALE"],
            ["1002", "7020.wav", "Second (raw) one", "second raw one", "s|e", "16000", "MALE"]]
    (tmp_path / "audio" / "test").mkdir(parents=True)
    (tmp_path / "test.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    corpus = read_corpus(tmp_path)
    assert corpus.layout == "fleurs"
    assert _expected(corpus.utterances) == sorted(
        (r[1].removesuffix(".wav"), str(tmp_path / "audio" / "test" / r[1]), r[2], None) for r in rows)
    assert [u.duration for u in corpus.utterances] == [int(r[5]) / RATE for r in rows]
    assert read_corpus(tmp_path / "test.tsv").layout == "fleurs"


def test_folder_of_audio_with_transcripts(tmp_path):
    for name, text in [("one", "first text\n"), ("sub/two", "  second\ntext ")]:
        _write_audio(tmp_path / f"{name}.wav")
        (tmp_path / f"{name}.txt").write_text(text)
    _write_audio(tmp_path / "orphan.flac")
    corpus = read_corpus(tmp_path)
    assert corpus.layout == "folder"
    assert _expected(corpus.utterances) == [("one", str(tmp_path / "one.wav"), "first text", None),
                                            ("sub/two", str(tmp_path / "sub" / "two.wav"), "second text", None)]
    assert len(corpus.warnings) == 1 and "orphan.flac" in corpus.warnings[0]


def test_forcing_a_layout(tmp_path):
    folder = tmp_path / "chapter"
    _write_audio(folder / "9-9-0001.flac")
    (folder / "9-9.trans.txt").write_text("9-9-0001 SOME WORDS\n")
    (folder / "9-9-0001.txt").write_text("some words")
    assert detect_layout(folder) == "librispeech"
    forced = read_corpus(folder, layout="folder")
    assert [(u.id, u.text) for u in forced.utterances] == [("9-9-0001", "some words")]
    with pytest.raises(UserError, match="unknown corpus layout"):
        read_corpus(folder, layout="kaldi")


def test_unknown_layout_missing_corpus_and_duplicates(tmp_path):
    (tmp_path / "notes.md").write_text("nothing here")
    with pytest.raises(UserError, match="cannot tell the layout"):
        read_corpus(tmp_path)
    with pytest.raises(UserError, match="corpus not found"):
        read_corpus(tmp_path / "missing")
    manifest = tmp_path / "dup.jsonl"
    manifest.write_text('{"id": "x", "audio": "a.wav", "text": "a"}\n{"id": "x", "audio": "b.wav", "text": "b"}\n')
    with pytest.raises(UserError, match="duplicate utterance id"):
        read_corpus(manifest)
    manifest.write_text('{"audio": "a.wav"}\n')
    with pytest.raises(UserError, match=r"dup.jsonl:1: needs an audio column"):
        read_corpus(manifest)


def _transcribe_json_lines(path, audio_names):
    """What `jaxstream transcribe --json a.wav ... > path` writes: the model's hypotheses, no references."""
    path.write_text("".join(json.dumps({"file": name, "text": "what the model heard", "token_ids": [33, 1980],
                                        "words": [], "audio_seconds": 0.2, "delay_ms": 480}) + "\n"
                            for name in audio_names))


def test_transcribe_output_is_never_taken_as_a_manifest(tmp_path):
    """A `transcribe --json` file beside the audio once became the manifest: the model's hypotheses were the
    references and WER was 0.00 %. Detection skips files without a reference text column and says why."""
    for name in ("a", "b"):
        _write_audio(tmp_path / f"{name}.wav")
    hypotheses = tmp_path / "hypotheses.jsonl"
    _transcribe_json_lines(hypotheses, ["a.wav", "b.wav"])
    with pytest.raises(UserError, match=r"cannot tell the layout.*hypotheses.jsonl \(`jaxstream transcribe --json` "
                                        r"output"):
        read_corpus(tmp_path)
    with pytest.raises(UserError, match=r"hypotheses.jsonl:1: this is `jaxstream transcribe --json` output"):
        read_corpus(hypotheses)
    with pytest.raises(UserError, match=r"expected exactly one JSONL or CSV manifest .* found none"):
        read_corpus(tmp_path, layout="manifest")

    for name, text in (("a", "first words"), ("b", "second words")):  # now a folder corpus: .txt references
        (tmp_path / f"{name}.txt").write_text(text)
    corpus = read_corpus(tmp_path)
    assert (corpus.layout, corpus.source, corpus.detected) == ("folder", str(tmp_path), True)
    assert [u.text for u in corpus.utterances] == ["first words", "second words"]

    manifest = tmp_path / "manifest.jsonl"  # the real manifest wins over the hypotheses beside it
    manifest.write_text("".join(json.dumps({"audio": f"{n}.wav", "text": f"{n} reference"}) + "\n" for n in "ab"))
    corpus = read_corpus(tmp_path)
    assert (corpus.layout, corpus.source) == ("manifest", str(manifest))
    assert [u.text for u in corpus.utterances] == ["a reference", "b reference"]
    (tmp_path / "other.csv").write_text("path,sentence\na.wav,again\n")
    with pytest.raises(UserError, match="several manifests .*manifest.jsonl, other.csv"):
        read_corpus(tmp_path)


def test_folder_with_a_csv_manifest(tmp_path):
    """README: CSV manifests work like JSONL ones, given as the file or as the folder holding it."""
    for name in ("x1", "x2"):
        _write_audio(tmp_path / "audio" / f"{name}.flac")
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("audio_filepath,transcript,speaker\naudio/x1.flac,one two,s1\naudio/x2.flac,three,s2\n")
    expected = [(f"audio/{n}.flac", str(tmp_path / "audio" / f"{n}.flac"), text, speaker)
                for n, text, speaker in (("x1", "one two", "s1"), ("x2", "three", "s2"))]
    for source, layout in ((tmp_path, None), (tmp_path, "manifest"), (manifest, None)):
        corpus = read_corpus(source, layout)
        assert (corpus.layout, corpus.source, corpus.detected) == ("manifest", str(manifest), layout is None)
        assert _expected(corpus.utterances) == expected


def test_shards_partition_the_limited_selection():
    items = [f"utt{i:03d}" for i in range(23)]
    full = select_utterances(items, limit=17)
    assert full == items[:17]
    shards = [select_utterances(items, limit=17, shard=(i, 4)) for i in range(4)]
    assert sorted(sum(shards, [])) == full
    assert sum(len(s) for s in shards) == len(full)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    assert parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(UserError, match="--shard"):
            parse_shard(bad)


ODD_TEXTS = ["line\u2028separator", "next\u0085line", "form\x0cfeed", "group\x1dseparator"]  # str.splitlines breaks all


def test_readers_split_lines_only_at_line_ends(tmp_path):
    """Transcripts holding characters that `str.splitlines()` takes as line breaks stay whole in every
    line-based layout; a JSONL row with U+2028 (`json.dumps(ensure_ascii=False)` writes it raw) once failed."""
    records = [{"id": f"j{i}", "audio": f"j{i}.wav", "text": text} for i, text in enumerate(ODD_TEXTS)]
    manifest = tmp_path / "raw.jsonl"
    manifest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in records), encoding="utf-8")
    assert [(u.id, u.text) for u in read_corpus(manifest).utterances] == [(r["id"], r["text"]) for r in records]

    folder = tmp_path / "ls" / "1" / "2"
    folder.mkdir(parents=True)
    (folder / "1-2.trans.txt").write_bytes("".join(f"1-2-{i} {t}\n" for i, t in enumerate(ODD_TEXTS)).encode())
    assert [u.text for u in read_corpus(tmp_path / "ls").utterances] == ODD_TEXTS

    fleurs = tmp_path / "fleurs"
    (fleurs / "audio" / "test").mkdir(parents=True)
    rows = [[str(i), f"{i}.wav", t, t.lower(), "x", "16000", "MALE"] for i, t in enumerate(ODD_TEXTS)]
    (fleurs / "test.tsv").write_bytes("".join("\t".join(r) + "\n" for r in rows).encode())
    assert [u.text for u in read_corpus(fleurs).utterances] == ODD_TEXTS


def test_common_voice_tsv_reads_as_the_csv_module_does(tmp_path):
    """A U+0085 in a sentence once cut it there and made its tail a fake utterance."""
    header = ["client_id", "path", "sentence", "up_votes", "down_votes"]
    rows = [["c1", "a.mp3", "first sentence\u0085with NEL", "2", "0"], ["c2", "b.mp3", "second\u2028one", "2", "0"]]
    (tmp_path / "clips").mkdir()
    tsv = tmp_path / "test.tsv"
    tsv.write_bytes("".join("\t".join(r) + "\n" for r in [header, *rows]).encode())
    with open(tsv, encoding="utf-8", newline="") as handle:
        oracle = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    corpus = read_corpus(tmp_path)
    assert corpus.layout == "commonvoice"
    assert [(u.id, u.text, u.speaker) for u in corpus.utterances] == [
        (row["path"], row["sentence"], row["client_id"]) for row in oracle]
    assert [u.text for u in corpus.utterances] == [rows[0][2], rows[1][2]]


def test_csv_manifest_quoted_fields_follow_rfc_4180(tmp_path):
    """A quoted field may hold line breaks (RFC 4180); it once read as 'line oneline two'."""
    manifest = tmp_path / "m.csv"
    manifest.write_bytes('audio,text\na.wav,"line one\nline two"\r\nb.wav,"he said ""hi"""\nc.wav,odd\u2028text\n'
                         .encode())
    with open(manifest, encoding="utf-8", newline="") as handle:
        oracle = list(csv.DictReader(handle))
    corpus = read_corpus(manifest)
    assert [u.text for u in corpus.utterances] == [row["text"] for row in oracle]
    assert [u.text for u in corpus.utterances] == ["line one\nline two", 'he said "hi"', "odd\u2028text"]
    manifest.write_text("audio,text\na.wav,ok\nb.wav," + "y" * (csv.field_size_limit() + 1) + "\n")
    with pytest.raises(UserError, match=r"m.csv:3: not a valid CSV/TSV record \(field larger"):
        read_corpus(manifest)
