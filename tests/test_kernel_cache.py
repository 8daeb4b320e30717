"""The C++ kernel's compile cache (tpu_kernels/ring_attention/cpu.py) when the library it finds does not load.

A library in the cache can be broken for a process that finds it: truncated (a full disk, a copied home), not
a shared object at all, or built against another C++ runtime on a home shared by hosts. Such a library used
to be taken as built: it failed to load and every process on that cache fell back to the XLA path for good,
or (truncated) it killed every process that loaded it with SIGBUS. These tests plant one where the cache
looks and check that it is rebuilt once, into a fresh file renamed over it, and used. The "compiler" here is a script that copies a library the real compiler built (or writes
garbage), so that no test compiles more than the session's one kernel.
"""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxstream.tpu_kernels.ring_attention import api, cpu

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def good_library():
    """Bytes of a kernel library the real compiler built (in the default cache, as every CPU test run has)."""
    try:
        api.choose_implementation(jnp.zeros((2, 1, 16, 64), jnp.float32), implementation="cpu")
    except ValueError as reason:
        pytest.skip(str(reason))
    return cpu._library_path(cpu._compiler_command(), jax.ffi.include_dir()).read_bytes()


def fake_compiler(tmp_path, output, *, sleep=0):
    """$CXX for the tests: logs its arguments, answers --version, and writes `output` (bytes) where -o points."""
    (tmp_path / "output").write_bytes(output)
    script = tmp_path / "fake-cxx"
    script.write_text(f"""#!/bin/sh
echo "$@" >> "{tmp_path / 'calls'}"
if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi
while [ "$#" -gt 1 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
sleep {sleep}
cp "{tmp_path / 'output'}" "$out"
""")
    script.chmod(0o755)
    return str(script)


def builds(tmp_path):
    """Compiler calls that built a library (not the --version question)."""
    calls = tmp_path / "calls"
    return [line for line in calls.read_text().splitlines() if " -o " in line] if calls.exists() else []


def plant(monkeypatch, tmp_path, compiler, content):
    """Point the cache and $CXX at the test's, and put `content` where the cache will look for the library."""
    monkeypatch.setenv("JAXSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", compiler)
    library = cpu._library_path(cpu._compiler_command(), jax.ffi.include_dir())
    library.parent.mkdir(parents=True)
    library.write_bytes(content)
    return library


# Loaded in this process by the old code, these failed; a truncated library could kill it (SIGBUS), so that
# one is planted for the child processes of the last test instead.
PLANTED = {
    "not_a_library": lambda good: b"\x7fELF but not really" * 64,
    "empty": lambda good: b"",
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_cached_library_that_does_not_load_is_rebuilt_once_and_used(planted, good_library, monkeypatch,
                                                                       tmp_path, caplog):
    library = plant(monkeypatch, tmp_path, fake_compiler(tmp_path, good_library), PLANTED[planted](good_library))
    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, *args, **kwargs: registered.append(name))
    assert cpu._load_and_register() is None
    assert registered == [cpu.TARGET]
    assert len(builds(tmp_path)) == 1
    # The rebuilt library replaced the broken one, whole, for the next process; nothing else is left behind.
    assert library.read_bytes() == good_library
    assert sorted(path.name for path in library.parent.iterdir()) == [library.name]
    assert any(library.name in record.getMessage() for record in caplog.records if record.levelname == "WARNING")


def test_a_rebuild_that_does_not_load_either_is_one_reason(monkeypatch, tmp_path):
    """A compiler whose output does not load either: one rebuild, then the reason the dispatcher falls back on
    (no loop), and the broken rebuild is not published over the cache."""
    planted = b"garbage planted in the cache"
    library = plant(monkeypatch, tmp_path, fake_compiler(tmp_path, b"garbage the compiler wrote"), planted)
    reason = cpu._load_and_register()
    assert reason is not None and reason.startswith("the C++ kernel is unavailable ("), reason
    assert len(builds(tmp_path)) == 1
    assert library.read_bytes() == planted
    assert sorted(path.name for path in library.parent.iterdir()) == [library.name]


_RUN_THE_KERNEL = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from ring_attention_base import CASES, build
from jaxstream.tpu_kernels.ring_attention import api, reference

case = CASES["paged_chunk_gqa4"]
args, history = build(case, "float32", seed=3)
assert api.choose_implementation(args["k_pages"]) == "cpu", "the XLA path runs instead of the C++ kernel"
out, _, _ = api.ring_attention(**args, window=case.window, scale=case.scale, implementation="cpu")
expected = reference.dense_attention(history["q"], history["k_history"], history["v_history"], history["lengths"],
                                     history["num_new"], window=case.window, scale=case.scale)
valid = np.arange(case.chunk)[None, :] < history["num_new"][:, None]
np.testing.assert_allclose(np.asarray(out)[valid], expected[valid], atol=2e-5, rtol=2e-5)
"""


def test_processes_that_find_a_broken_library_rebuild_it_and_run_the_kernel(good_library, monkeypatch, tmp_path):
    """Two processes start together on a cache holding a truncated library (which killed them with SIGBUS when
    they loaded it): each rebuilds it (the compiler takes a second, so their builds overlap), renames its own
    whole build over it, and runs the C++ kernel, whose output matches the float64 oracle."""
    library = plant(monkeypatch, tmp_path, fake_compiler(tmp_path, good_library, sleep=1),
                    good_library[: len(good_library) // 3])
    processes = [subprocess.Popen([sys.executable, "-c", _RUN_THE_KERNEL, str(TESTS)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    assert 1 <= len(builds(tmp_path)) <= 2
    assert library.read_bytes() == good_library
    assert sorted(path.name for path in library.parent.iterdir()) == [library.name]
