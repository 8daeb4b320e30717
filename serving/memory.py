"""Handing the server's freed heap memory back to the system (glibc's `malloc_trim`), every 30 s.

A server allocates from several threads at once (the event loop decoding audio, the front-end worker
computing log-mel, the engine thread building batches, XLA's pool), each in its own glibc arena, and glibc
keeps the pages of memory freed inside an arena: the resident set crept up for as long as the server ran.
Measured with 64 real-time streams on a 2-core machine, RSS by minute after a warm-up (first delta p99):

    glibc's default                        894 897 920 921 922 930 932 937 941 942 MiB   (777 ms)
    malloc_trim(0) every 30 s (20-28 ms)   806 805 814 804 805 827 825 824 828 827 MiB   (759 ms)
    two arenas (mallopt M_ARENA_MAX)       779 778 780 783 780 792 785 782 782 779 MiB   (890 ms)
    fixed 128 KiB mmap threshold           787 787 785 785 773 778 MiB                   (977 ms)

The two flattest cost latency (threads wait on shared arenas; large temporaries are mmapped and faulted in
each time), so the server trims, on a worker thread so the event loop never waits for it.
"""
import ctypes
import ctypes.util
import sys

TRIM_PERIOD_S = 30.0


def malloc_trimmer():
    """A function that returns the free pages of every malloc arena to the system, or None where the C
    library has no `malloc_trim` (not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)
