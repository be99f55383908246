"""The gateway's malloc arenas (``gateway/memory.py``): bounded by ``--malloc-arenas`` before its servers start,
counted by glibc's own ``malloc_stats`` in a child process whose threads allocate at once (ctypes releases the GIL
around ``malloc``, so they truly contend, as gRPC's threads do)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from cosyvoice_triton.gateway.config import from_args
from cosyvoice_triton.gateway.memory import bound_malloc_arenas

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")

CHILD = """
import ctypes, ctypes.util, sys, threading
from cosyvoice_triton.gateway.memory import bound_malloc_arenas
if int(sys.argv[1]):
    assert bound_malloc_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def work():
    for _ in range(20000):
        libc.free(libc.malloc(4096))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
"""


def _arenas(bound: int) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(bound)], capture_output=True, text=True, timeout=300,
                         check=True, env={"PATH": "/usr/bin:/bin"})
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


@glibc
def test_threads_that_contend_get_no_more_arenas_than_the_bound():
    bounded = _arenas(2)
    assert 1 <= bounded <= 2
    free = _arenas(0)
    assert free >= bounded  # glibc's default: an arena per contending thread, up to 8 per core


def test_the_bound_is_a_flag_and_the_environment_wins(monkeypatch):
    assert from_args(["--triton-grpc", "x:1"]).malloc_arenas == 2
    assert from_args(["--triton-grpc", "x:1", "--malloc-arenas", "0"]).malloc_arenas == 0
    assert bound_malloc_arenas(0) is False  # glibc's default kept
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert bound_malloc_arenas(2) is False  # the operator's own setting stays
