"""Pieces shared by the Triton kernels: interpreter detection, the tl.dot input type, the Mamba time step.

Kernels load every tensor and convert it to float32 at once: the interpreter's bfloat16
arithmetic is wrong, and float32 math is what the references do. Only tl.dot inputs keep a
narrower type on a GPU (tensor cores); `dot_dtype` picks it per launch.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def triton_runs_here() -> bool:
    """Triton kernels can run in this process: under its interpreter (TRITON_INTERPRET, read as Triton reads it),
    with a GPU that torch sees, or the process imported triton itself (bench/kernels.py compiles for a GPU it does
    not have). Elsewhere, a CPU-only machine, triton is not imported even where it is installed: it costs 71 MiB
    resident (an eighth of a 1B model's int4 weights) for kernels that never launch."""
    if sys.modules.get("triton") is not None:
        return True
    interpret = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")
    xpu = getattr(torch, "xpu", None)
    return interpret or torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
try:
    if not triton_runs_here():
        raise ImportError("no device here runs Triton's kernels")
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install or machine: the kernels below are defined but never launched
    from runtime.kernels import _triton_absent as triton

    tl = triton.language

_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True when kernels run under TRITON_INTERPRET=1 (numpy on the CPU)."""
    return bool(triton.knobs.runtime.interpret)


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The input type of tl.dot for tensors of `dtype`: their own half type on a GPU, float32 under the
    interpreter (whose bfloat16 dot is garbage) and for float32 tensors (with input_precision="ieee",
    never TF32, so float32 models keep float32 accuracy)."""
    return tl.float32 if interpreting() else _DOT_DTYPES[dtype]


def per_channel(D: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Mamba-2's D, (H,) or (H, P), as an (H, P) view; a per-head D gets a zero stride along P."""
    assert D.numel() in (num_heads, num_heads * head_dim)
    return D.reshape(num_heads, -1).expand(num_heads, head_dim)


@triton.jit
def softplus(x):
    # torch's threshold: above 20, softplus(x) == x in float32; far below 0, log(1 + e^x) rounds to 0 but e^x does not.
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def time_step(dt, dt_bias, dt_min, dt_max):
    """dt' = softplus(dt + dt_bias) clamped to [dt_min, dt_max] (a no-op for (0, inf): softplus >= 0)."""
    return tl.minimum(tl.maximum(softplus(dt + dt_bias), dt_min), dt_max)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest, ties to even) and back to float32.

    For bfloat16 the rounding is done on the bits: the interpreter's float32 -> bfloat16 cast
    truncates, and an intermediate rounding that differs from torch's would add a second ulp
    of error after the final store. On a GPU this is what the cast does anyway.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


def kernels_are_interpreted() -> bool:
    """Whether the kernels were decorated under the interpreter. TRITON_INTERPRET takes effect at
    @triton.jit time, so setting it after runtime.kernels was imported is too late."""
    from runtime.kernels.kv_cache import _store_kv_kernel

    return type(_store_kv_kernel).__name__ == "InterpretedFunction"
