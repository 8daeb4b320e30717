"""README.md says what users type: its Python examples run as written, and its command list shows every
option each command has."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile

from jaxstream import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    """The text of the README's `## title` section."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def _python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section("Python API"), flags=re.DOTALL)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(2))
def test_python_api_examples_run_as_written(index):
    """Each example is a complete script: run from the repository root, as a reader of a checkout would."""
    examples = _python_examples()
    assert len(examples) == 2
    source = examples[index]
    result = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if "start_transcription" in source:
        *deltas, done = result.stdout.strip().splitlines()
        assert done.startswith("TranscriptionDone(") and all(d.startswith("TranscriptionDelta(") for d in deltas)
        # Times are printed to the millisecond, not as 2.8000000000000003; the last delta ends at the audio's end,
        # in whole milliseconds within it.
        times = [float(t) for t in re.findall(r"audio_seconds=([\d.]+)\)$", "\n".join(deltas), flags=re.M)]
        samples = ROOT / "models" / "assets" / "samples"
        seconds = soundfile.info(samples / "sample.wav").duration
        assert len(times) == len(deltas) and times[-1] == math.floor(seconds * 1000) / 1000
        assert all(repr(round(t, 3)) == repr(t) for t in times)
        expected = (samples / "sample.txt").read_text().split()
        text = re.match(r"TranscriptionDone\(text='([^']*)'", done).group(1).split()
        # The embedded model gets the sample exactly (README, "Fresh machine"); one word of room.
        assert sum(word in text for word in expected) >= len(expected) - 1, done
    else:
        lines = result.stdout.strip().splitlines()
        assert lines and lines[-1].endswith("True")  # the last output finishes the session
        ids = [int(token) for line in lines for token in re.findall(r"\d+", line.split("]")[0])]
        assert len(ids) == 4 + 8 and all(0 <= token < 256 for token in ids)


def _command_lines() -> dict[str, str]:
    """Command name -> its usage in the README's command list (continuation lines included)."""
    block = re.search(r"```\n(.*?)```", _section("Command line"), flags=re.DOTALL).group(1)
    usages: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"jaxstream (\w+)", line)
        if match:
            current = match.group(1)
            usages[current] = usages.get(current, "") + line + "\n"
        elif line.startswith(" ") and current is not None:
            usages[current] += line + "\n"
    return usages


def _subparsers() -> dict:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]  # noqa: SLF001 - argparse has no public one
    return dict(action.choices)


def test_command_list_shows_every_option():
    usages = _command_lines()
    assert "jaxstream [--version] [-v" in _section("Command line")
    for name, parser in _subparsers().items():
        assert name in usages, f"README's command list has no `jaxstream {name}`"
        for action in parser._actions:  # noqa: SLF001
            long_options = [option for option in action.option_strings if option.startswith("--")]
            if not long_options or long_options[0] in ("--help", "--verbose"):
                continue  # -h, and -v, which the list shows once for every command
            assert long_options[0] in usages[name], f"README's `jaxstream {name}` lacks {long_options[0]}"


def test_the_fresh_machine_install_has_what_its_try_it_client_imports():
    """"Fresh machine" installs with `pip install -e .`, then runs examples/realtime_client.py: every module the
    client imports must come from the standard library or a distribution setup.cfg installs (websockets was only a
    test extra, and the README's first try ended in ModuleNotFoundError)."""
    import ast
    import configparser
    from importlib import metadata

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = {re.split(r"[<>=!\[ ]", line.strip())[0].lower().replace("_", "-")
                for line in config["options"]["install_requires"].splitlines() if line.strip()}
    client = ast.parse((ROOT / "examples" / "realtime_client.py").read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(client) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(client)
                if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    distributions = metadata.packages_distributions()
    missing = {module for module in modules - set(sys.stdlib_module_names)
               if not {d.lower().replace("_", "-") for d in distributions.get(module, [module])} & required}
    assert not missing, missing
