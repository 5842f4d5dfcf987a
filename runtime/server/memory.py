"""Keeping the server's resident memory bounded under sustained load (glibc only; elsewhere these do nothing).

Each thread that allocates gets its own glibc malloc arena (up to 8 per core), and memory freed in an
arena stays in the process: a server's RSS grew from 1.0 to 1.9 GB over 1,700 requests with no Python
object leaked. Two arenas (MALLOC_ARENA_MAX=2) level it off, and malloc_trim hands freed pages back.
"""

from __future__ import annotations

import logging
import os

from runtime.heap import glibc

logger = logging.getLogger("tandem")

M_ARENA_MAX = -8  # glibc's mallopt parameter number
DEFAULT_ARENA_MAX = 2


LIBC = glibc()


def limit_arenas() -> None:
    """As MALLOC_ARENA_MAX=2 unless the environment sets it; call before the server starts its threads.

    glibc reads MALLOC_ARENA_MAX when the process starts, so setting the variable now would be too late;
    mallopt applies the same limit to arenas created from now on.
    """
    if LIBC is None or "MALLOC_ARENA_MAX" in os.environ:
        return
    if LIBC.mallopt(M_ARENA_MAX, DEFAULT_ARENA_MAX) != 1:
        logger.warning("could not limit malloc arenas to %d", DEFAULT_ARENA_MAX)


def trim() -> None:
    """Give the memory malloc holds free back to the system (called when the engine goes idle)."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
