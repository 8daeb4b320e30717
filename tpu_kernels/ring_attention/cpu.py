"""C++ kernel of `ring_attention` for XLA:CPU (cpu_kernel.cc), called through XLA's FFI.

Why a kernel of its own on CPU: the XLA path gathers a batch's reachable keys, writes a [rows, keys] score
matrix, masks it and runs the softmax's passes over it, and XLA:CPU runs most of those passes on one
thread. The kernel reads each visible key once, straight from its page, keeps the scores of one 64-key block
in cache under an online softmax, and splits the batch's (session, KV head) tasks over XLA's thread pool.
Side by side on the 2-core CPU, the random mid-size Voxtral's shapes (`benchmarks/ring_attention.py --shapes
decoder-mid encoder-mid --sessions 8 32`), at 125 positions / half / a full window: a decoder step of 32
sessions 0.36 / 9.4 / 18.8 ms against the XLA path's 0.79 / 23.8 / 48.0; an encoder chunk of 64 frames for 8
sessions 1.6 / 3.5 / 6.2 against 2.1 / 5.4 / 7.3. That model's whole engine runs 19-21 % faster with it
(`benchmarks/vs_transformers.py`'s engine side, 8 and 32 streams).

The kernel is built on first use with the system C++ compiler (`$CXX`, a command that may carry arguments
such as "ccache g++", else c++ or g++) against jaxlib's FFI headers, for this CPU (`-march=native`), into a
cache directory (`$JAXSTREAM_CACHE_DIR`, else ~/.cache/jaxstream) keyed by the source, the flags, the
compiler command and the first line of its `--version`, jaxlib's version and the CPU; a second process finds
it there. A library there that does not load (truncated, built against another C++ runtime) is built again
once, over it. Where there is no compiler or the build fails (or outlasts COMPILE_TIMEOUT) or does not load,
`check_supported` gives the reason and the dispatcher falls back to the XLA path. float32 only (the CPU
engine's dtype); other dtypes take the XLA path.

Before a library is loaded (in this process, with ctypes), its ELF program headers are read (`_check_segments`):
every PT_LOAD segment must lie within the file. A truncated library's last segments reach past its end; the
loader maps them anyway and the first touch of a page with no file behind it kills the process with SIGBUS,
before dlopen can report anything. Everything else dlopen reports itself, as an OSError: not a library, an
empty file, another C++ runtime, a missing symbol. No child process does the check: `sys.executable` is not
always an interpreter (a frozen app, uWSGI, an embedding host), and one that fails or hangs would have made
every good library look broken.

Forward only in C++: gradients come from the XLA path (its backward, after recomputing its forward), so the
op stays differentiable; training itself takes the XLA path (`jaxstream/training/step.py`).
"""
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxstream.tpu_kernels.ring_attention import xla

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "jaxstream_ring_attention_cpu"
SYMBOL = "JaxstreamRingAttention"
# Reassociation lets the compiler vectorise the softmax's max and sum; infinities stay honoured (the running
# maximum starts at -inf). Not -ffast-math itself: GCC 12 then links in code that sets flush-to-zero for the
# whole process when the library loads, and numpy's float32 subnormals read as zero everywhere. GCC keeps to
# 256-bit vectors on AVX-512 machines unless told: 512 made an encoder call 8.1-8.7 ms instead of 9.3.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math", "-freciprocal-math", "-std=c++17", "-shared", "-fPIC")
# A build takes 10-20 s on a loaded 2-core machine; a compiler that hangs (a stuck ccache, a license server)
# must not hold the first ring_attention call (an engine's start) forever: the XLA path runs instead.
COMPILE_TIMEOUT = 300
VERSION_TIMEOUT = 30
# What `_check_segments` reads, per ELF class (e_ident[4]: 1 ELF32, 2 ELF64): the header after e_ident (its
# 5th field e_phoff, its 9th and 10th e_phentsize and e_phnum), one program header, and the fields of
# p_offset and p_filesz in it.
_ELF_LAYOUTS = {1: ("HHIIIIIHHHHHH", "IIIIIIII", 1, 4), 2: ("HHIQQQIHHHHHH", "IIQQQQQQ", 2, 5)}
_PT_LOAD = 1
_PN_XNUM = 0xFFFF  # e_phnum's escape to a count in the first section header; no shared library needs it
_logger = logging.getLogger(__name__)
_lock = threading.Lock()
_registration = {}  # "reason": None once registered, else why the kernel cannot run here


def check_supported(k_pages, *, interpret=False, platform=None):
    """Raise NotImplementedError (with the reason) when the kernel cannot run these pages here."""
    del interpret  # A compiled kernel: there is nothing to interpret.
    target = platform or jax.default_backend()
    if target != "cpu":
        raise NotImplementedError(f"the C++ kernel runs on CPU, not {target}")
    if k_pages.dtype != jnp.float32:
        raise NotImplementedError(f"the C++ kernel takes float32 pages, not {k_pages.dtype}")
    error = _register()
    if error:
        raise NotImplementedError(error)


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def ring_attention_cpu(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, *, window, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _attend(q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32), k_pages, v_pages,
                  page_table, lengths, num_new, window, scale).astype(q.dtype)
    k_pages, v_pages = xla.write_new_entries(k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, after=out)
    return out, k_pages, v_pages


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attend(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window, scale):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window=np.int64(window),
                scale=np.float32(scale))


def _attend_forward(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window, scale):
    out = _attend(q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new, window, scale)
    return out, (q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new)


def _attend_backward(window, scale, residuals, d_out):
    q, k_new, v_new, k_pages, v_pages, page_table, lengths, num_new = residuals
    _, pullback = jax.vjp(
        lambda *floats: xla.attention_output(*floats, page_table, lengths, num_new, window=window, scale=scale),
        q, k_new, v_new, k_pages, v_pages)
    return (*pullback(d_out), None, None, None)


_attend.defvjp(_attend_forward, _attend_backward)


def _register():
    """Build (or find) the kernel and register it with XLA, once per process; None, or why it cannot run."""
    with _lock:
        if "reason" not in _registration:
            _registration["reason"] = _load_and_register()
        return _registration["reason"]


def _load_and_register():
    try:
        kernel = _kernel()
    except (OSError, RuntimeError) as error:
        reason = f"the C++ kernel is unavailable ({error})"
        # Once per process: CPU serving then runs the XLA path, correct but slower.
        _logger.warning("ring_attention: %s; the XLA path runs instead", reason)
        return reason
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(kernel), platform="cpu")
    return None


def _kernel():
    """The kernel's entry point, from the library in the cache or from one built now.

    A cached library that does not load (truncated by a full disk or a copied home, not a library at all,
    built against another C++ runtime on a home that hosts share) is built again, once, over it: it used to
    be taken as built, so every process on that cache ran the XLA path for good."""
    compiler = _compiler_command()
    include = jax.ffi.include_dir()
    library = _library_path(compiler, include)
    if library.exists():
        try:
            return _open(library)
        except OSError as error:
            _logger.warning("ring_attention: the cached C++ kernel %s does not load (%s); building it again",
                            library, error)
    return _build(compiler, include, library)


def _build(compiler, include, library):
    """Compile the kernel into a fresh file beside `library`, open it, and only then rename it over `library`:
    a concurrent process (pytest's workers, another engine rebuilding the same broken library) sees a whole
    library that loads, its own or this one, and a build that does not load is never published."""
    cache = library.parent
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        partial = Path(tmp) / library.name
        name = Path(compiler[0]).name
        returncode, _, stderr = _run([*compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(partial)],
                                     COMPILE_TIMEOUT, name)
        if returncode:
            last = (stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{name} failed: {last}")
        kernel = _open(partial)  # Mapped now: renaming the file keeps it loaded.
        os.replace(partial, library)
    return kernel


def _open(library):
    """The kernel's entry point in `library`, or OSError saying why it does not load.

    Loaded in this process, once its segments are known to lie within the file: dlopen reports every other
    way a library can be broken as an OSError, but not a truncated one (SIGBUS)."""
    import ctypes  # Only where the kernel is asked for.

    _check_segments(library)
    try:
        return getattr(ctypes.CDLL(str(library)), SYMBOL)
    except AttributeError:  # It loads but lacks the kernel: as unusable, and worth the same rebuild.
        raise OSError(f"{library.name} has no {SYMBOL}") from None


def _check_segments(library):
    """OSError unless `library` is an ELF file (either class and byte order) whose program headers and
    PT_LOAD segments all lie within it: the loader maps those segments from the file, and a page of one past
    its end has nothing behind it (SIGBUS at the first touch). A file whose headers cannot be read is broken
    too; whether it is a library for this machine is left to dlopen."""
    with open(library, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        ident = file.read(16)
        if ident[:4] != b"\x7fELF" or len(ident) < 6 or ident[4] not in _ELF_LAYOUTS or ident[5] not in (1, 2):
            raise OSError(f"{library.name} is not an ELF file")
        file.seek(16)  # Past e_ident: where the header's fields start (a short file reads nothing there).
        order = "<" if ident[5] == 1 else ">"
        header, entry, offset_field, size_field = _ELF_LAYOUTS[ident[4]]
        fields = file.read(struct.calcsize(order + header))
        if len(fields) < struct.calcsize(order + header):
            raise OSError(f"{library.name} is truncated: its ELF header is incomplete ({size} bytes)")
        fields = struct.unpack(order + header, fields)
        table, entry_size, count = fields[4], fields[8], fields[9]
        if count == _PN_XNUM or (count and entry_size < struct.calcsize(order + entry)):
            raise OSError(f"{library.name}: unreadable program headers ({count} of {entry_size} bytes)")
        if table + count * entry_size > size:
            raise OSError(f"{library.name} is truncated: its program headers end at byte "
                          f"{table + count * entry_size}, the file at {size}")
        file.seek(table)
        headers = file.read(count * entry_size)
    for index in range(count):
        segment = struct.unpack_from(order + entry, headers, index * entry_size)
        end = segment[offset_field] + segment[size_field]
        if segment[0] == _PT_LOAD and end > size:
            raise OSError(f"{library.name} is truncated: a segment it loads ends at byte {end}, the file at {size}")


def _library_path(compiler, include):
    """Where the library built by `compiler` (a command line) lives in the cache, under a key of everything
    that shapes it. The whole command and the version it reports: CXX="g++ -O0" or an upgraded g++ must not
    find a library another compiler built."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), shlex.join(compiler).encode(),
                 _compiler_version(tuple(compiler)).encode(), jaxlib.__version__.encode(), include.encode(),
                 _cpu_signature().encode()):
        key.update(part)
    cache = Path(os.environ.get("JAXSTREAM_CACHE_DIR") or Path.home() / ".cache" / "jaxstream") / "kernels"
    return cache / f"ring_attention_cpu-{key.hexdigest()[:16]}.so"


def _compiler_command():
    """The compiler as a command line: $CXX split as a shell would ("ccache g++", "g++ -w"), else c++ or g++."""
    command = shlex.split(os.environ.get("CXX") or "")
    if not command:
        found = shutil.which("c++") or shutil.which("g++")
        if not found:
            raise RuntimeError("no C++ compiler: set CXX or install g++")
        command = [found]
    return command


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler):
    """First line of `compiler --version` ("" when it gives none); asked once per process and command."""
    try:
        returncode, stdout, _ = _run([*compiler, "--version"], VERSION_TIMEOUT, Path(compiler[0]).name)
    except (OSError, RuntimeError):
        return ""  # The build itself then reports why the compiler cannot run.
    return next(iter(stdout.strip().splitlines()), "") if returncode == 0 else ""


def _run(command, timeout, name):
    """(returncode, stdout, stderr) of `command`; RuntimeError once it runs past `timeout` seconds, after
    killing its whole process group (a wrapper's compiler too, not only the wrapper)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group ended meanwhile
            process.communicate()
            raise RuntimeError(f"{name} did not finish within {timeout} s") from None
    return process.returncode, stdout, stderr


def _cpu_signature():
    """What -march=native compiles for: the model and feature flags of this CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return "\n".join(next((line for line in lines if line.startswith(field)), "") for field in ("model name", "flags"))
