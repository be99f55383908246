"""The gateway process's native memory: glibc's malloc arenas bounded.

The gateway runs its checks in worker threads (``asyncio.to_thread``) beside gRPC's own threads, and glibc gives
each contending thread an arena of its own, up to 8 per core, whose freed pages fragment rather than go back to
the system. Under a long stream of hostile clients (the load tests' stress mode: ~600 acts a second, most refused
at once) the gateway's resident set rose at a steady ~0.04 MB/s while its Python heap stayed flat (tracemalloc);
with two arenas the same traffic on a stand-in Triton held it flat. :func:`bound_malloc_arenas` sets that bound
with ``mallopt(M_ARENA_MAX)`` before the servers start their threads (the same as ``MALLOC_ARENA_MAX``, which
glibc reads only when a process starts)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h


def bound_malloc_arenas(arenas: int) -> bool:
    """At most ``arenas`` malloc arenas from now on (0: glibc's default; ``MALLOC_ARENA_MAX`` in the environment
    wins); whether the bound is in force. Elsewhere than glibc (musl, macOS) nothing changes."""
    if arenas <= 0 or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it: musl's mallopt ignores M_ARENA_MAX)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_ARENA_MAX, int(arenas)) == 1
    if not ok:
        log.warning("mallopt(M_ARENA_MAX, %d) failed: glibc's default arenas stay", arenas)
    return ok
