"""Shared by the Triton-vs-reference tests: where kernels run, and how close they must come.

Under TRITON_INTERPRET=1 (set by tests/conftest.py unless the environment says otherwise) the
kernels run on CPU tensors through the interpreter; with TRITON_INTERPRET=0 on a CUDA machine
the same tests compile them for the GPU.
"""

from __future__ import annotations

import pytest
import torch

from runtime.kernels._triton_utils import interpreting

DEVICE = "cpu" if interpreting() else "cuda"
needs_device = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 needs a CUDA device"
)

# (atol, rtol) of a kernel against its reference, both computing in float32. Half types get one
# unit in the last place (rtol = 2^-mantissa bits): the interpreter truncates float32 -> bfloat16
# where torch rounds to nearest, and either side may round a float32 result that sits on a
# rounding boundary the other way.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 2.0**-10),
    torch.bfloat16: (1e-5, 2.0**-7),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=atol, rtol=rtol)


def on_device(pool):
    """Move a PagePool's bytes (and its write marks) to DEVICE before views are taken."""
    pool.data = pool.data.to(DEVICE)
    pool.allowed = pool.allowed.to(DEVICE)
    return pool

