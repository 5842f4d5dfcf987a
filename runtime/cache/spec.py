"""What one layer caches, in bytes: the allocator and the planner read only these.

Dtypes are strings so that planning needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.hf_config import DTYPE_SIZES


@dataclass(frozen=True)
class AttentionSpec:
    """K and V for `block_size` tokens of one layer: one attention page."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class MambaSpec:
    """One sequence's recurrent state in one layer (conv, then SSM): one state page.

    `page_size_padded` makes the page as large as an attention page, so that both
    kinds of page come from one pool.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None

    @property
    def state_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) * DTYPE_SIZES[dtype] for shape, dtype in zip(self.shapes, self.dtypes))

    @property
    def unpadded_page_size_bytes(self) -> int:
        """The sum of the state tensors' bytes (plus alignment, never needed by real models)."""
        end = self._layout()[-1]
        align = max(DTYPE_SIZES[dtype] for dtype in self.dtypes)
        return -(-end // align) * align

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.unpadded_page_size_bytes
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    @property
    def padding_pct(self) -> float:
        unpadded = self.unpadded_page_size_bytes
        return 100.0 * (self.page_size_bytes - unpadded) / unpadded

    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state tensor inside a page (conv first, as in vLLM)."""
        return self._layout()[:-1]

    def _layout(self) -> tuple[int, ...]:
        # Each tensor starts at a multiple of its element size; the last entry is the end.
        offsets, offset = [], 0
        for nbytes, dtype in zip(self.state_bytes, self.dtypes):
            align = DTYPE_SIZES[dtype]
            offset = -(-offset // align) * align
            offsets.append(offset)
            offset += nbytes
        return (*offsets, offset)
