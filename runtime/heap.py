"""Keep a CPU step's freed activations in the heap, so the next step does not fault in fresh pages.

A prefill step allocates and frees tens of megabytes of activations per layer (a 2,048-token chunk's
gate and up projections are 8 MiB each in bfloat16). glibc serves every block above its mmap threshold
(128 KiB, raised only when such a block is freed) with a fresh mapping and unmaps it on free, and trims
the heap's free top above 128 KiB: so every step faults in and zeroes its activations' pages again. On
the AVX-512 machine that was almost half of a Llama bfloat16 prefill (858 -> 471 ms a 32 x 128 batch:
the GEMMs and silu_and_mul wrote into pages the kernel had to fault in first). vLLM's CPU docs preload
TCMalloc for the same reason; a Python process cannot swap its allocator, but it can tell glibc's to
keep blocks up to the largest threshold it accepts (32 MiB on 64-bit) in the heap, and freed memory up
to TRIM_THRESHOLD there. Peak memory is unchanged (the heap holds what the step used at its peak);
what changes is that an idle engine keeps it, as it keeps its page pool (the server hands it back when
it goes idle: runtime/server/memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger("tandem")

ENV_VAR = "TANDEM_MALLOC_TUNING"  # 0: leave the C allocator's settings as they are
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more than half its 64 MiB heap size
TRIM_THRESHOLD = 1 * 2**30


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: set glibc's thresholds (True), or leave them (False: not glibc, or ENV_VAR=0)."""
    libc = glibc()
    if os.environ.get(ENV_VAR, "").strip() == "0" or libc is None:
        return False
    # Both, or neither: setting either one alone turns glibc's own threshold raising off.
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False
    ok = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.debug("glibc malloc: blocks up to %d MiB from the heap, trimmed past %d MiB (%s)",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "set" if ok else "trim refused")
    return ok


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, whose mallopt parameters these are (None for musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "gnu_get_libc_version")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim), as after loading a model: the float
    weights a quantized model was made from were freed, but TRIM_THRESHOLD keeps up to 1 GiB of them resident."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
