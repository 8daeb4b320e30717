"""`jaxstream synth OUT`: a synthetic speech corpus (espeak-ng, Festival, SVOX Pico, flite) in LibriSpeech layout
with word timings."""
import argparse
import importlib.util
import math
import os
import shutil
import tempfile

from jaxstream.errors import UserError

_WORDS_RANGE = (3, 7)  # --text words: the default --min-words and --max-words


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "synth", help="generate a synthetic speech corpus with espeak-ng, Festival, SVOX Pico or flite",
        description="Speaks text with espeak-ng, Festival, SVOX Pico or flite (--engines) and writes "
                    "OUT/<speaker>/<chapter>/*.flac + *.trans.txt (LibriSpeech layout) and OUT/manifest.jsonl with "
                    "exact word start/end times. Each utterance's text, voice and augmentation are deterministic in "
                    "(--seed, index); espeak-ng's samples also depend on --workers.")
    parser.add_argument("out", metavar="OUT", help="output directory (created; must be empty or absent)")
    parser.add_argument("--num", type=int, default=100, help="number of utterances (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--held-out", action="store_true",
                        help="draw from the held-out pools: sentences and voice variants training never uses")
    # Sentences by default: the shipped model trained on them, and `synth` then `eval` should measure it on its kind
    # of speech (30 held-out utterances at seed 1: 32.9 % WER on sentences, 50.3 % on word sequences).
    parser.add_argument("--text", choices=("sentences", "words"), default="sentences",
                        help="sentences (the default): natural sentences from WordNet and fortune files, spoken "
                             "whole, held out by source with --held-out: the shipped tiny model's corpus (apt-get "
                             "install wordnet-base fortunes fortunes-min). words: random sequences from the packaged "
                             "word list, each word spoken alone, as the first tiny model was trained on (no package "
                             "but espeak-ng)")
    parser.add_argument("--engines", default="espeak", metavar="NAME[:SHARE],...",
                        help="--text sentences: synthesizers and their shares, e.g. espeak:0.75,festival:0.25 "
                             "(default espeak). espeak = espeak-ng's English accents and voice variants; "
                             "festival = Festival's ked_diphone (apt-get install festival festvox-kdlpc16k); "
                             "pico = SVOX Pico's en-US and en-GB (pip install ttspico), word times from alignment; "
                             "flite = flite's kal16/slt/rms/awb, held-out sets only (apt-get install flite)")
    parser.add_argument("--telephone", type=float, default=0.0, metavar="FRACTION",
                        help="--text sentences: share of utterances sent over a simulated phone line (300-3400 "
                             "Hz, 8 kHz, mu-law); a --held-out corpus writes them as 8 kHz files (default 0)")
    parser.add_argument("--min-words", type=int, default=None,
                        help=f"--text words: shortest sentence (default {_WORDS_RANGE[0]})")
    parser.add_argument("--max-words", type=int, default=None,
                        help=f"--text words: longest sentence (default {_WORDS_RANGE[1]})")
    parser.add_argument("--augment", type=float, default=1.0, metavar="STRENGTH",
                        help="augmentation strength: 0 = clean, 1 = default (speed, reverb, noise, gain), at most 5")
    parser.add_argument("--voice-edits", type=float, default=0.5, metavar="FRACTION",
                        help="share of utterances whose voice variant gets random pitch, consonant, breath and "
                             "formant edits (default 0.5; never in --held-out corpora)")
    parser.add_argument("--join-seconds", type=float, default=None, metavar="S",
                        help="--held-out: write the utterances joined back to back into streams of at most S "
                             "seconds (consecutive utterances, so mostly one voice after another), a long-stream "
                             "test set: OUT/streams/*.flac and OUT/manifest.jsonl with every word's time")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxstream.synth import CorpusSpec, generate_corpus
    from jaxstream.synth.augment import MAX_STRENGTH
    from jaxstream.synth.voices import system_data_dir

    if args.num < 1:
        raise UserError(f"--num must be at least 1, got {args.num}")
    if args.text != "words" and (args.min_words, args.max_words) != (None, None):
        given = [flag for flag, value in (("--min-words", args.min_words), ("--max-words", args.max_words))
                 if value is not None]
        raise UserError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --text words only: "
                        f"--text {args.text} (the default) speaks whole sentences from its sources")
    min_words = _WORDS_RANGE[0] if args.min_words is None else args.min_words
    max_words = _WORDS_RANGE[1] if args.max_words is None else args.max_words
    if not 1 <= min_words <= max_words:
        raise UserError(f"need 1 <= --min-words <= --max-words, got {min_words} and {max_words}")
    if args.seed < 0:
        raise UserError(f"--seed must be at least 0, got {args.seed}")
    if not 0 <= args.augment <= MAX_STRENGTH:  # also refuses nan
        raise UserError(f"--augment must be between 0 and {MAX_STRENGTH:g}, got {args.augment}")
    if not 0 <= args.voice_edits <= 1:
        raise UserError(f"--voice-edits must be between 0 and 1, got {args.voice_edits}")
    if args.join_seconds is not None:
        if not args.held_out:
            raise UserError("--join-seconds writes a long-stream test set: use it with --held-out (training joins "
                            "utterances itself: [train] long_stream_fraction)")
        if not 0 < args.join_seconds < math.inf:  # also refuses nan
            raise UserError(f"--join-seconds must be a positive number of seconds, got {args.join_seconds}")
        if 0 < args.telephone < 1:
            raise UserError("--join-seconds needs --telephone 0 or 1: a stream is written at one sampling rate")
    engines = _parse_engines(args.engines)
    if args.text == "words" and engines != (("espeak", 1.0),):
        raise UserError("--engines needs --text sentences (word-list corpora are espeak-ng only)")
    if "flite" in dict(engines) and not args.held_out:
        raise UserError("flite is the held-out engine: use it with --held-out only")
    if not 0 <= args.telephone <= 1:
        raise UserError(f"--telephone must be between 0 and 1, got {args.telephone}")
    if args.telephone and args.text == "words":
        raise UserError("--telephone needs --text sentences")
    # espeak-ng also speaks the rare sentence that Festival splits into other words than the transcript's, or
    # whose Pico words do not align.
    needed = {name for name, _ in engines} | ({"espeak"} if {"festival", "pico"} & set(dict(engines)) else set())
    for name in sorted(needed - {"pico"}):
        if shutil.which(_BINARIES[name]) is None:
            raise UserError(_MISSING[name])
    if "pico" in needed and importlib.util.find_spec("ttspico") is None:
        from jaxstream.synth.pico import PICO_NOT_INSTALLED

        raise UserError(PICO_NOT_INSTALLED)
    if "festival" in needed:
        from jaxstream.synth.engines import check_festival_voices

        check_festival_voices()
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UserError(f"output {args.out} exists and is not an empty directory")
    if args.text == "sentences":
        from jaxstream.synth.sentences import sentence_pools

        try:
            sentence_pools()
        except RuntimeError as error:
            raise UserError(f"{error}; or --text words, which needs none") from error
    if args.voice_edits and not args.held_out and "espeak" in needed:
        try:
            system_data_dir()  # edited voices are written beside a copy of it
        except RuntimeError as error:
            raise UserError(str(error)) from error
    spec = CorpusSpec(num_utterances=args.num, seed=args.seed, held_out=args.held_out, min_words=min_words,
                      max_words=max_words, augment_strength=args.augment,
                      voice_edit_fraction=args.voice_edits, text=args.text, engines=engines,
                      telephone=args.telephone)
    try:
        os.makedirs(args.out, exist_ok=True)  # now: a folder that cannot be made failed only in the workers
    except OSError as exc:
        raise UserError(f"cannot create the output folder {args.out}: {exc.strerror or exc}") from None
    if args.join_seconds is None:
        records = generate_corpus(args.out, spec, workers=max(args.workers, 1), progress=True)
        kind = "utterances"
    else:
        from jaxstream.synth.long_streams import join_corpus

        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.out))) as utterances:
            records = generate_corpus(utterances, spec, workers=max(args.workers, 1), progress=True)
            records = join_corpus(utterances, records, args.out, args.join_seconds)
        kind = f"streams of {args.num} utterances"
    hours = sum(record["duration"] for record in records) / 3600
    print(f"wrote {len(records)} {kind} ({hours:.2f} h) to {args.out}")
    return 0


_BINARIES = {"espeak": "espeak-ng", "festival": "festival", "pico": None, "flite": "flite"}  # Pico: a Python package
_MISSING = {"espeak": "espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)",
            "festival": "festival is not installed (Debian/Ubuntu: apt-get install festival festvox-kdlpc16k)",
            "flite": "flite is not installed (Debian/Ubuntu: apt-get install flite)"}


def _parse_engines(text: str) -> tuple[tuple[str, float], ...]:
    """"espeak:0.75,festival:0.25" -> (("espeak", 0.75), ("festival", 0.25)); a missing share is 1."""
    engines = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, share = item.partition(":")
        if name not in _BINARIES:
            raise UserError(f"--engines: unknown engine {name!r} (choose from {', '.join(_BINARIES)})")
        try:
            value = float(share) if share else 1.0
        except ValueError:
            raise UserError(f"--engines: {item!r}: the share must be a number") from None
        if not 0 < value < math.inf:  # also refuses nan
            raise UserError(f"--engines: {item!r}: the share must be positive and finite")
        engines.append((name, value))
    if not engines or len({name for name, _ in engines}) != len(engines):
        raise UserError(f"--engines: need each engine at most once, got {text!r}")
    return tuple(engines)
