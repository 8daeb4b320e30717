"""The C++ kernel's compile cache (tpu_kernels/ring_attention/cpu.py) when the library it finds does not load.

A library in the cache can be broken for a process that finds it: truncated (a full disk, a copied home), not
a shared object at all, or built against another C++ runtime on a home shared by hosts. Such a library used
to be taken as built: it failed to load and every process on that cache fell back to the XLA path for good,
or (truncated) it killed every process that loaded it with SIGBUS. These tests plant one where the cache
looks and check that it is rebuilt once, into a fresh file renamed over it, and used. The "compiler" here is
a script that copies a library the real compiler built (or writes garbage), so that no test compiles more
than the session's one kernel.

A truncated library is refused from its ELF program headers before anything maps it, so those tests run in
this process: where each segment lies comes from binutils' readelf (the oracle), for the real kernel, a
32-bit library and both in the other byte order. One test still runs the truncated case in child processes,
where a SIGBUS would fail the test instead of killing the test run.
"""
import ctypes
import shutil
import struct
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


# dlopen reports the first two itself; the truncated ones are refused from their program headers (loaded, they
# killed the process with SIGBUS).
PLANTED = {
    "not_a_library": lambda good: b"\x7fELF but not really" * 64,
    "empty": lambda good: b"",
    "truncated_in_its_program_headers": lambda good: good[:100],
    "truncated_in_a_segment": lambda good: good[: len(good) // 3],
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


def test_a_good_library_loads_where_sys_executable_is_not_an_interpreter(good_library, monkeypatch, tmp_path,
                                                                         caplog):
    """A frozen app, uWSGI or an embedding host sets `sys.executable` to its own binary. The load check used to
    start it as an interpreter: a binary that exits 2 made a good library look broken, rebuilt it, failed the
    rebuild the same way and sent every start to the XLA path. The library is loaded as it is, no rebuild, and
    nothing is started."""
    host = tmp_path / "host-binary"
    host.write_text(f"#!/bin/sh\necho \"$@\" >> \"{tmp_path / 'host-calls'}\"\nexit 2\n")
    host.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(host))
    library = plant(monkeypatch, tmp_path, fake_compiler(tmp_path, b"garbage a rebuild would write"),
                    good_library)
    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, *args, **kwargs: registered.append(name))
    assert cpu._load_and_register() is None
    assert registered == [cpu.TARGET]
    assert builds(tmp_path) == []
    assert not (tmp_path / "host-calls").exists()
    assert library.read_bytes() == good_library
    assert not [record for record in caplog.records if record.levelname == "WARNING"]


def readelf(path, *options):
    return subprocess.run(["readelf", "-W", *options, str(path)], capture_output=True, text=True,
                          check=True).stdout


def loaded_segments(path):
    """(p_offset, p_filesz) of each PT_LOAD segment, as binutils' readelf reads them."""
    return [(int(fields[1], 16), int(fields[4], 16)) for fields in map(str.split, readelf(path, "-l").splitlines())
            if fields[:1] == ["LOAD"]]


def program_header_table(path):
    """(start, end) in the file of the program header table, as readelf reads the ELF header."""
    numbers = {}
    for line in readelf(path, "-h").splitlines():
        name, _, value = line.partition(":")
        numbers[name.strip()] = value.split()[0] if value.split() else ""
    start = int(numbers["Start of program headers"])
    return start, start + int(numbers["Size of program headers"]) * int(numbers["Number of program headers"])


def other_byte_order(data):
    """A little-endian ELF file's bytes in big-endian order: the ELF header and program headers swapped (the
    section headers dropped, which no loader reads). The tests check readelf reads the same segments in it."""
    wide = data[4] == 2
    header, entry = ("HHIQQQIHHHHHH", "IIQQQQQQ") if wide else ("HHIIIIIHHHHHH", "IIIIIIII")
    fields = list(struct.unpack_from("<" + header, data, 16))
    fields[5], fields[11], fields[12] = 0, 0, 0  # e_shoff, e_shnum, e_shstrndx: no section headers
    out = bytearray(data)
    out[5] = 2  # EI_DATA: big-endian
    struct.pack_into(">" + header, out, 16, *fields)
    table, size, count = fields[4], fields[8], fields[9]
    for index in range(count):
        struct.pack_into(">" + entry, out, table + index * size,
                         *struct.unpack_from("<" + entry, data, table + index * size))
    return bytes(out)


@pytest.fixture(scope="module")
def elf_files(good_library, tmp_path_factory):
    """Real ELF libraries of both classes, in both byte orders, as files: the kernel, a 32-bit library the system
    C compiler builds (x86's -m32), and both swapped to big-endian."""
    if not shutil.which("readelf"):
        pytest.skip("no readelf (binutils) to read the segments with")
    folder = tmp_path_factory.mktemp("elf")
    files = {"elf64-lsb": folder / "elf64-lsb.so"}
    files["elf64-lsb"].write_bytes(good_library)
    (folder / "tiny.c").write_text("int jaxstream_tiny(int x) { return x + 1; }\n")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler and subprocess.run([compiler, "-m32", "-shared", "-nostdlib", "-fPIC", str(folder / "tiny.c"), "-o",
                                    str(folder / "elf32-lsb.so")], capture_output=True).returncode == 0:
        files["elf32-lsb"] = folder / "elf32-lsb.so"
    for kind in list(files):
        swapped = files[kind].with_name(kind.replace("lsb", "msb") + ".so")
        swapped.write_bytes(other_byte_order(files[kind].read_bytes()))
        assert loaded_segments(swapped) == loaded_segments(files[kind]) != []
        assert "big endian" in readelf(swapped, "-h")
        files[swapped.stem] = swapped
    return files


ELF_KINDS = ["elf64-lsb", "elf64-msb", "elf32-lsb", "elf32-msb"]


def elf_file(elf_files, kind):
    if kind not in elf_files:
        pytest.skip(f"no {kind} library: the C compiler cannot build for -m32 here")
    return elf_files[kind]


@pytest.mark.parametrize("kind", ELF_KINDS)
def test_a_truncated_library_is_refused_before_it_is_loaded(kind, elf_files, monkeypatch, tmp_path):
    """Cut inside e_ident, the ELF header, the program header table, and at the start, middle and last byte of
    every segment the loader maps (readelf's offsets): OSError, and dlopen is never called on it."""
    path = elf_file(elf_files, kind)
    whole = path.read_bytes()
    table_start, table_end = program_header_table(path)
    cuts = {0, 3, 10, 30, table_start + 1, table_end - 1}
    for offset, size in loaded_segments(path):
        if size:
            cuts |= {offset + 1, offset + size // 2, offset + size - 1}
    loaded = []

    def dlopen(name, *args, **kwargs):
        loaded.append(name)
        pytest.fail(f"{name} was loaded")

    monkeypatch.setattr(ctypes, "CDLL", dlopen)
    for cut in sorted(cuts):
        library = tmp_path / f"cut-{cut}.so"
        library.write_bytes(whole[:cut])
        with pytest.raises(OSError, match="truncated|not an ELF file"):
            cpu._open(library)
    assert loaded == []


@pytest.mark.parametrize("kind", ELF_KINDS)
def test_a_library_whose_segments_lie_within_it_passes_the_check(kind, elf_files, tmp_path):
    """The check is no stricter than the loader: the whole file, and the file cut right after the end of its
    last segment (nothing the loader maps is missing), pass; the cut kernel still loads and has its symbol."""
    path = elf_file(elf_files, kind)
    whole = path.read_bytes()
    end = max(offset + size for offset, size in loaded_segments(path))
    assert end < len(whole)  # the section headers and their tables come after the segments
    library = tmp_path / f"{kind}.so"
    for content in (whole, whole[:end]):
        library.write_bytes(content)
        cpu._check_segments(library)
    if kind == "elf64-lsb":
        assert cpu._open(library) is not None
