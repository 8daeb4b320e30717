"""The process's memory allocator: TCMalloc when the machine has it, loaded by re-executing the command.

XLA:CPU allocates a compiled program's temporaries at every call, and with glibc's malloc the large ones come
back from the kernel as fresh pages each time, a page fault per 4 KB (Linux, glibc 2.36, jaxlib 0.10). On the
2-core VM a realtime decode call of the mid-size random Voxtral at 24 rows faulted ~9,600 times, exactly its
gathered encoder window (37 MB), and spent 15-20 ms of its 74-77 in the kernel; the tiny-v2 trainer took
~220,000 faults a step, 0.4 of its 2.2 CPU-seconds. TCMalloc keeps freed memory mapped for reuse, side by side
(benchmarks/, JAXSTREAM_ALLOCATOR=system vs the default): that call 57-59 ms with under 800 faults, a tiny-v2
training step (16 x 128 slots) 1.01 s instead of 1.20, and `jaxstream bench` of 24 mid-size streams 80 ms steps
in 68-70 ms instead of 75-76. vLLM's CPU backend asks for TCMalloc too. jemalloc, and glibc's tunables
(MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX), did not remove the faults inside the engine.

A library cannot swap its process's allocator after start-up, so the commands that run programs re-execute
themselves once with TCMalloc in LD_PRELOAD, before anything heavy is imported. JAXSTREAM_ALLOCATOR=system
keeps glibc's malloc; without TCMalloc installed (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`) the
command runs on glibc's as before.
"""
import os
import sys
from pathlib import Path

CHOICE_VARIABLE = "JAXSTREAM_ALLOCATOR"  # "tcmalloc" (default) or "system"
# Set in the re-executed process: never re-execute twice, even if the loader ignored LD_PRELOAD.
REEXECUTED_VARIABLE = "JAXSTREAM_ALLOCATOR_REEXECUTED"
LIBRARY_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
# TCMalloc reports every allocation above 1 GB on stderr; the KV pools of a large engine are such allocations.
QUIET_LARGE_ALLOCATIONS = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 42)}


def find_tcmalloc(dirs=LIBRARY_DIRS) -> str | None:
    """Path of an installed TCMalloc shared library, or None."""
    for directory in dirs:
        for name in LIBRARY_NAMES:
            path = Path(directory, name)
            if path.is_file():
                return str(path)
    return None


def loaded_allocator(maps_path: str = "/proc/self/maps") -> str:
    """"tcmalloc" when TCMalloc is mapped into this process, else "system" (also where /proc is missing)."""
    try:
        maps = Path(maps_path).read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"


def preload_environment(environ, library: str | None, loaded: str) -> dict | None:
    """The environment to re-execute with so that TCMalloc is loaded, or None to go on as is: TCMalloc is
    already loaded, the user chose the system allocator, none is installed, or this process is already the
    re-executed one. Raises ValueError for an unknown choice."""
    choice = environ.get(CHOICE_VARIABLE, "tcmalloc").strip().lower() or "tcmalloc"
    if choice not in ("tcmalloc", "system"):
        raise ValueError(f"{CHOICE_VARIABLE} must be 'tcmalloc' or 'system', got {environ[CHOICE_VARIABLE]!r}")
    if choice == "system" or loaded == "tcmalloc" or library is None or environ.get(REEXECUTED_VARIABLE):
        return None
    preload = " ".join(part for part in (library, environ.get("LD_PRELOAD", "")) if part)
    return {**QUIET_LARGE_ALLOCATIONS, **environ, "LD_PRELOAD": preload, REEXECUTED_VARIABLE: "1"}


def reexecute_with_tcmalloc() -> None:
    """Replaces this process (same pid, file descriptors and arguments) by itself with TCMalloc preloaded,
    when `preload_environment` says so; returns otherwise. Call it before importing jax."""
    environ = preload_environment(os.environ, find_tcmalloc(), loaded_allocator())
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
