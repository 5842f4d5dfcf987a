"""One C file of the native kernels built alone with given -march flags and loaded with ctypes, so that a test can
check a vector path other than the one -march=native picks (each where this CPU has what it needs)."""

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.kernels import native_build


def build_with_flags(source: Path, flags: list[str], needs: set[str], target: Path) -> ctypes.CDLL:
    """`source` compiled with `flags` into `target`; skips the test where the CPU lacks `needs` or has no C
    compiler, and off x86-64 (where the baseline build may vectorise)."""
    if platform.machine() != "x86_64":
        pytest.skip("elsewhere the baseline build may vectorise")
    if not needs <= native_build.cpu_features():
        pytest.skip(f"this CPU lacks {sorted(needs - native_build.cpu_features())}")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    subprocess.run([compiler, "-O2", *flags, "-std=c11", "-fPIC", "-shared", "-fopenmp", str(source), "-o",
                    str(target), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(target))


def pointer(tensor) -> ctypes.c_void_p:
    """A tensor's data for ctypes (None: NULL)."""
    return ctypes.c_void_p(None if tensor is None else tensor.data_ptr())
