"""`jaxstream synth OUT`: a synthetic speech corpus (espeak-ng) in LibriSpeech layout with word timings."""
import argparse
import os
import shutil

from jaxstream.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "synth", help="generate a synthetic speech corpus with espeak-ng",
        description="Writes OUT/<speaker>/<chapter>/*.flac + *.trans.txt (LibriSpeech layout) and "
                    "OUT/manifest.jsonl with exact word start/end times. Deterministic in (--seed, index).")
    parser.add_argument("out", metavar="OUT", help="output directory (created; must be empty or absent)")
    parser.add_argument("--num", type=int, default=100, help="number of utterances (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--held-out", action="store_true",
                        help="draw from the held-out pools: sentences and voice variants training never uses")
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--max-words", type=int, default=7)
    parser.add_argument("--augment", type=float, default=1.0, metavar="STRENGTH",
                        help="augmentation strength: 0 = clean, 1 = default (speed, reverb, noise, gain)")
    parser.add_argument("--voice-edits", type=float, default=0.5, metavar="FRACTION",
                        help="share of utterances whose voice variant gets random pitch, consonant, breath and "
                             "formant edits (default 0.5; never in --held-out corpora)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxstream.synth import CorpusSpec, generate_corpus
    from jaxstream.synth.voices import NOT_INSTALLED, system_data_dir

    if args.num < 1:
        raise UserError(f"--num must be at least 1, got {args.num}")
    if not 1 <= args.min_words <= args.max_words:
        raise UserError(f"need 1 <= --min-words <= --max-words, got {args.min_words} and {args.max_words}")
    if not 0 <= args.voice_edits <= 1:
        raise UserError(f"--voice-edits must be between 0 and 1, got {args.voice_edits}")
    if shutil.which("espeak-ng") is None:
        raise UserError(NOT_INSTALLED)
    if args.voice_edits and not args.held_out:
        try:
            system_data_dir()  # edited voices are written beside a copy of it
        except RuntimeError as error:
            raise UserError(str(error)) from error
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UserError(f"output {args.out} exists and is not an empty directory")
    spec = CorpusSpec(num_utterances=args.num, seed=args.seed, held_out=args.held_out, min_words=args.min_words,
                      max_words=args.max_words, augment_strength=args.augment,
                      voice_edit_fraction=args.voice_edits)
    records = generate_corpus(args.out, spec, workers=max(args.workers, 1), progress=True)
    hours = sum(record["duration"] for record in records) / 3600
    print(f"wrote {len(records)} utterances ({hours:.2f} h) to {args.out}")
    return 0
