"""Shared by the kernel tests: a page pool like the engine's, with strided per-layer views into it.

The engine keeps every layer's caches in one uint8 pool of (num_pages, group_size, page_bytes):
a layer's view takes one slab and a byte range of every page, so its leading stride is the
whole page id (all slabs plus padding), never the product of its other dims. Tests fill the
pool with random bytes, run an op through such views, and check that every byte outside the
slots the op may write is unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PagePool:
    def __init__(self, num_pages: int, group_size: int, page_bytes: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (num_pages, group_size, page_bytes), dtype=torch.uint8, generator=generator)
        self.allowed = torch.zeros_like(self.data, dtype=torch.bool)

    def view(self, slab: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        """(num_pages, *shape) of dtype at byte `offset` of slab `slab` in every page."""
        nbytes = math.prod(shape) * dtype.itemsize
        assert offset % dtype.itemsize == 0 and offset + nbytes <= self.data.shape[2]
        v = self.data[:, slab, offset : offset + nbytes].view(dtype).view(self.data.shape[0], *shape)
        assert v.stride(0) != math.prod(shape), "the view must not look contiguous"
        return v

    def allow_writes(self, view: Tensor, index) -> None:
        """Mark view[index] as bytes the op under test may change."""
        marks = torch.zeros_like(self.data)
        typed = marks.view(-1).view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())
        typed.view(_SAME_SIZE_INT[view.dtype.itemsize])[index] = -1  # every byte of those elements becomes 0xff
        self.allowed |= marks != 0

    def snapshot(self) -> Tensor:
        return self.data.clone()

    def assert_untouched_outside_allowed(self, before: Tensor) -> None:
        changed = self.data != before
        outside = changed & ~self.allowed
        assert not outside.any(), f"{int(outside.sum())} bytes changed outside the slots the op may write"


@pytest.fixture
def page_pool() -> type[PagePool]:
    """A factory: page_pool(num_pages, group_size, page_bytes, seed=0)."""
    return PagePool
