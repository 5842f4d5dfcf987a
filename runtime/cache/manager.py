"""Who owns which page. Pure Python: the pool tensor lives in the model runner.

Attention blocks and Mamba states take page ids from one free list, so pages move
between the two uses as the mix of requests changes. A sequence holds, in each
attention group, one page per `block_size` tokens, and in each state group one page
for its Mamba state.
"""

from __future__ import annotations

from collections import deque

from runtime.cache.layout import CacheLayout, cdiv
from runtime.sequence import Sequence


class CacheManager:
    def __init__(self, layout: CacheLayout, num_pages: int):
        self.layout = layout
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = 0 if seq.state_pages else self.layout.num_state_groups
        if self.layout.block_size:
            blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.layout.block_size)
            held = len(seq.block_tables[0]) if seq.block_tables else 0
            needed += self.layout.num_attention_groups * max(0, blocks - held)
        return needed

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the pages its next `num_new_tokens` tokens need."""
        assert self.can_allocate(seq, num_new_tokens), "allocate() without can_allocate()"
        if not seq.state_pages:
            seq.state_pages = self._take(self.layout.num_state_groups)
        if not self.layout.block_size:
            return
        if not seq.block_tables:
            seq.block_tables = [[] for _ in range(self.layout.num_attention_groups)]
        blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.layout.block_size)
        for table in seq.block_tables:
            table.extend(self._take(blocks - len(table)))

    def free(self, seq: Sequence) -> None:
        for table in seq.block_tables:
            self._free.extend(table)
        self._free.extend(seq.state_pages)
        seq.block_tables, seq.state_pages = [], []
        assert len(self._free) <= self.num_pages, "a page was freed twice"

    def _take(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(max(0, n))]
