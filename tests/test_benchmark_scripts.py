"""Every script in benchmarks/ runs as documented far enough to print its --help: its imports resolve, those
of helpers shared between scripts included (train_step.py had imported a helper that ring_attention.py no
longer defined, and nothing ran it), with torch and transformers unimportable as on CI, and the help carries
the docstring's first paragraph whole (two had cut it at its first line, mid-sentence)."""
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# Scripts have a __main__ block; the other files are modules of the scripts (the chaos soak's behaviours).
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())

# Runs every script's `__main__` with --help in one interpreter (jax is imported once, not once per script).
_HELP_OF_EACH = """
import ast, contextlib, io, runpy, sys
sys.modules['torch'] = sys.modules['transformers'] = None
delegates, folder, scripts = sys.argv[1].split(','), sys.argv[2], sys.argv[3:]
sys.path.insert(0, folder)
failed = []
for script in scripts:
    sys.argv[:] = [script, '--help']
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f'{folder}/{script}', run_name='__main__')
    except SystemExit as exc:
        if exc.code not in (0, None) or 'usage:' not in out.getvalue():
            failed.append(f'{script}: exit {exc.code}')
        # The description says what the script measures: at least its docstring's first paragraph, whole.
        with open(f'{folder}/{script}') as source:
            first = ' '.join(ast.get_docstring(ast.parse(source.read())).split('\\n\\n')[0].split())
        if script not in delegates and first not in ' '.join(out.getvalue().split()):
            failed.append(f'{script}: --help leaves out part of {first!r}')
    except BaseException as exc:
        failed.append(f'{script}: {type(exc).__name__}: {exc}')
    else:
        failed.append(f'{script}: ran without parsing --help')
print('\\n'.join(failed))
"""


# Scripts that run a jaxstream command: their --help is the command's.
_DELEGATES = ("engine.py",)


def test_there_are_benchmark_scripts():
    assert {"realtime_step.py", "scheduler_tick.py", "train_step.py", "vs_transformers.py"} <= set(SCRIPTS)
    modules = {path.stem for path in BENCHMARKS.glob("*.py")} - {name.removesuffix(".py") for name in SCRIPTS}
    imported = " ".join((BENCHMARKS / name).read_text() for name in SCRIPTS)
    assert modules and all(f"import {module}" in imported or f"from {module} import" in imported
                           for module in modules), modules  # a file that is neither would be dead code


def test_every_benchmark_script_prints_its_help():
    result = subprocess.run([sys.executable, "-c", _HELP_OF_EACH, ",".join(_DELEGATES), str(BENCHMARKS), *SCRIPTS],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", result.stdout


def test_scheduler_tick_measures_a_short_run():
    """The scheduler benchmark's own arithmetic runs end to end: it pairs its per-call timings with the
    scheduler's tick records, which are made when a tick is collected (one fewer than the calls); the pairing
    broke once on that and only a real run shows it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scheduler_tick", BENCHMARKS / "scheduler_tick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(streams=4, ticks=8)
    assert result["streams"] == 4 and result["rows_p50"] == 4
    assert result["ticks"] == 8 - 1 - 2  # the loop's first call only dispatches; two warm-up ticks are left out
    assert 0 < result["cpu_ms_p50"] <= result["with_commands_ms_p50"]
    assert 0 <= result["xla_calls_ms_p50"] < result["cpu_ms_p50"]


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), BENCHMARKS / name)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))  # as when run: the script's directory holds its helpers
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_train_step_defaults_to_the_shipped_tiny_recipe_from_any_directory(tmp_path, monkeypatch):
    """`--config` names the recipe as `jaxstream train --config` does (it was a path relative to the
    repository root), and the decoder is the recipe's own size (it was v1's 4387 rows): the shipped tiny
    checkpoint's, as its jaxstream.json records."""
    import json

    from jaxstream.models.loading import BUILTIN_MODELS

    shipped = json.loads((BUILTIN_MODELS["tiny"] / "jaxstream.json").read_text())["config"]
    monkeypatch.chdir(tmp_path)
    args, cfg = _script("train_step.py").parse([])
    assert args.config == "tiny" and cfg.model.text.vocab_size == shipped["text"]["vocab_size"]
    assert cfg.model.encoder.num_layers == shipped["encoder"]["num_layers"]


def test_train_step_too_few_slots_is_a_usage_error():
    """The slots after the 31 of the shared prefix hold the audio: 31 or fewer was a numpy traceback once the
    model had been built."""
    from jaxstream.training.data import SHARED_PREFIX_SLOTS

    result = subprocess.run([sys.executable, str(BENCHMARKS / "train_step.py"), "--slots", str(SHARED_PREFIX_SLOTS)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: --slots must be more than {SHARED_PREFIX_SLOTS}" in result.stderr
