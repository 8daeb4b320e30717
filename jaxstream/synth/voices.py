"""Procedural voice variants: a training variant's espeak-ng voice file with randomly edited settings.

espeak-ng's ~50 normal-voice variants span a narrow range of consonant strength, breathiness and pitch,
and the tiny model's worst held-out voice sits outside it (weak consonants + breath + high pitch: see
MODEL_CARD.md). Each edited utterance appends settings to a copy of its base variant's file (later lines
override earlier ones); each copy lives, for one espeak-ng call, in a private espeak-ng data directory made
of links to the system's, passed to espeak-ng with `--path`. Held-out variants are never a base, so held-out
voices stay unseen.
"""
import atexit
import contextlib
import functools
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import numpy as np

_VARIANT_DIR = os.path.join("espeak-ng-data", "voices", "!v")
NOT_INSTALLED = "espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)"
_serial = itertools.count()


def random_voice_edits(rng: np.random.Generator) -> tuple[str, ...]:
    """espeak-ng voice-file lines that override a variant's pitch range, consonants, voicing and formants,
    and sometimes add breath, roughness, flutter or echo."""
    low = int(rng.integers(70, 220))
    edits = [
        f"pitch {low} {low + int(rng.integers(30, 110))}",
        f"consonants {int(rng.integers(60, 140))} {int(rng.integers(10, 130))}",
        f"voicing {int(rng.integers(30, 150))}",
    ]
    for formant in range(1, 9):
        if rng.random() < 0.5:
            edits.append(f"formant {formant} {int(rng.integers(85, 125))} {int(rng.integers(60, 160))} "
                         f"{int(rng.integers(60, 160))}")
    if rng.random() < 0.5:
        edits.append("breath " + " ".join(str(int(v)) for v in rng.integers(0, 15, size=8)))
        edits.append("breathw " + " ".join(str(int(v)) for v in rng.integers(100, 400, size=6)))
    if rng.random() < 0.3:
        edits.append(f"roughness {int(rng.integers(0, 5))}")
    if rng.random() < 0.3:
        edits.append(f"flutter {int(rng.integers(0, 25))}")
    if rng.random() < 0.3:
        edits.append(f"echo {int(rng.integers(20, 150))} {int(rng.integers(5, 40))}")
    return tuple(edits)


@functools.cache
def system_data_dir() -> str:
    """espeak-ng's own data directory, from the "Data at: DIR" line of `espeak-ng --version`."""
    try:
        version = subprocess.run(["espeak-ng", "--version"], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError as error:
        raise RuntimeError(NOT_INSTALLED) from error
    directory = version.partition("Data at:")[2].strip()
    if not directory or not os.path.isdir(os.path.join(directory, "voices", "!v")):
        raise RuntimeError(f"cannot find espeak-ng's voice variants (voices/!v) in the data directory that "
                           f"`espeak-ng --version` names: it printed {version.strip()!r}")
    return directory


@functools.cache
def private_data_path() -> str:
    """A process-wide espeak-ng `--path` whose data directory links to the system's, except for its own
    variant folder (links to the system's variants, plus the edited ones while they are in use). Made once;
    workers forked after the first call share it."""
    system = system_data_dir()
    root = tempfile.mkdtemp(prefix="jaxstream-espeak-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    data = os.path.join(root, "espeak-ng-data")
    os.makedirs(os.path.join(root, _VARIANT_DIR))
    for entry in os.listdir(system):
        if entry != "voices":
            os.symlink(os.path.join(system, entry), os.path.join(data, entry))
    for entry in os.listdir(os.path.join(system, "voices")):
        if entry != "!v":
            os.symlink(os.path.join(system, "voices", entry), os.path.join(data, "voices", entry))
    # The system's variants too: libespeak-ng (engines.py) reads every voice from this one data path.
    for entry in os.listdir(os.path.join(system, "voices", "!v")):
        os.symlink(os.path.join(system, "voices", "!v", entry), os.path.join(root, _VARIANT_DIR, entry))
    return root


@contextlib.contextmanager
def edited_variant(base: str, edits: tuple[str, ...]) -> Iterator[str]:
    """The name of a variant file = `base`'s file + `edits`, present in the private data directory while the
    context lasts: espeak-ng lists every voice file at start-up and stops at 350."""
    with open(os.path.join(system_data_dir(), "voices", "!v", base)) as f:
        text = f.read().rstrip("\n") + "\n" + "\n".join(edits) + "\n"
    name = f"jx{os.getpid()}-{next(_serial)}"  # short: espeak-ng overflows a buffer on long voice names
    path = os.path.join(private_data_path(), _VARIANT_DIR, name)
    with open(path, "w") as f:
        f.write(text)
    try:
        yield name
    finally:
        os.remove(path)
