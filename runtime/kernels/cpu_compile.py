"""torch.compile for the hot loops of the CPU references, switched on once when the kernels are bound.

A reference op keeps its eager body for the tests and the oracle; a function decorated with
`@fused` (its inner, mask-free core) runs through torch.compile's C++ backend on CPU engines,
which fuses the gather, the update and the scatter of a state into one pass over memory.
TANDEM_CPU_COMPILE=0 turns it off; a machine where compiling fails falls back to eager, with
a warning. Whether it compiles is probed when the kernels are bound to the references, and where the native
kernels are bound instead (cpu_native.py), which take every call they can, only if a fused core runs: torch.compile
imports torch._dynamo (145 MiB resident, a sixth of a 1B model's int4 weights).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, TypeVar

import torch

logger = logging.getLogger("tandem")
ENV_VAR = "TANDEM_CPU_COMPILE"

F = TypeVar("F", bound=Callable)
_enabled = False
_works: bool | None = None  # whether torch.compile works here, probed once (works())


def fused(fn: F) -> F:
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not (_enabled and works()):
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args, **kwargs)

    return run  # type: ignore[return-value]


def works() -> bool:
    """Whether torch.compile compiles and runs a probe here (once per process; a failure is warned of)."""
    global _works
    if _works is None:
        try:
            probe = torch.compile(lambda x: (x * 2).sum(-1), dynamic=True)
            _works = bool(probe(torch.ones(3, 4)).eq(8).all())
        except Exception as err:  # noqa: BLE001 - any failure means: stay eager
            logger.warning("torch.compile does not work here (%s); CPU kernels run eagerly", err)
            _works = False
    return _works


def enable(requested: bool) -> bool:
    """Compile the fused cores from now on, if requested and allowed by the environment (and, when one first
    runs, if compiling works: works())."""
    global _enabled
    allowed = os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no")
    _enabled = requested and allowed
    return _enabled
