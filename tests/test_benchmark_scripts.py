"""Every script in benchmarks/ runs as documented far enough to print its --help: its imports resolve, those
of helpers shared between scripts included (train_step.py had imported a helper that ring_attention.py no
longer defined, and nothing ran it), with torch and transformers unimportable as on CI."""
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py"))

# Runs every script's `__main__` with --help in one interpreter (jax is imported once, not once per script).
_HELP_OF_EACH = """
import contextlib, io, runpy, sys
sys.modules['torch'] = sys.modules['transformers'] = None
sys.path.insert(0, sys.argv[1])
failed = []
for script in sys.argv[2:]:
    sys.argv[:] = [script, '--help']
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f'{sys.path[0]}/{script}', run_name='__main__')
    except SystemExit as exc:
        if exc.code not in (0, None) or 'usage:' not in out.getvalue():
            failed.append(f'{script}: exit {exc.code}')
    except BaseException as exc:
        failed.append(f'{script}: {type(exc).__name__}: {exc}')
    else:
        failed.append(f'{script}: ran without parsing --help')
print('\\n'.join(failed))
"""


def test_there_are_benchmark_scripts():
    assert {"realtime_step.py", "scheduler_tick.py", "train_step.py", "vs_transformers.py"} <= set(SCRIPTS)


def test_every_benchmark_script_prints_its_help():
    result = subprocess.run([sys.executable, "-c", _HELP_OF_EACH, str(BENCHMARKS), *SCRIPTS], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", result.stdout
