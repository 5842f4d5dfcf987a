"""Stands in for `triton` where it is not installed (a CPU-only install, without the `gpu` extra).

The kernel files define their Triton kernels when they are imported, so `import runtime` needs
`triton.jit` and `tl.*` to exist; nothing launches a kernel, because resolve_backend refuses the
triton backend when Triton is absent. A launch that gets through anyway fails with the fix.
"""

from __future__ import annotations

INSTALL_HINT = "Triton is not installed; the GPU kernels need it: pip install 'tandem[gpu]'"


class _Absent:
    """Any attribute (tl.float32, triton.knobs.runtime.interpret) and any call; false as a flag."""

    def __getattr__(self, name: str) -> _Absent:
        return self

    def __call__(self, *args, **kwargs) -> _Absent:
        return self

    def __bool__(self) -> bool:
        return False


class _Kernel:
    """A @triton.jit function that cannot be launched (`kernel[grid](...)`) or called from a kernel."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(INSTALL_HINT)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(INSTALL_HINT)


def jit(fn=None, **options):
    return _Kernel(fn) if fn is not None else _Kernel


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


language = _Absent()
knobs = _Absent()
