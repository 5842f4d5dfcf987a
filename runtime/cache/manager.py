"""Who owns which page. Pure Python: the pool tensor lives in the model runner.

Attention blocks and Mamba states take page ids from one free queue, so pages move
between the two uses as the mix of requests changes. A sequence holds, in each
attention group, one page per `block_size` tokens, and in each state group one page
for its Mamba state.

With prefix caching (`runtime/cache/prefix.py`) a page may also hold a cached block or a
state snapshot. Such a page is shared by reference count; with no reference it is free but
still cached, at the tail of the free queue (least recently used first out), and it is
evicted from the cache only when the queue hands it out again. Free pages that hold nothing
cached go to the head, so they are used first.
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.cache.layout import CacheLayout, cdiv
from runtime.cache.prefix import Hit, PrefixCache
from runtime.sequence import Sequence


class CacheManager:
    def __init__(self, layout: CacheLayout, num_pages: int, prefix: PrefixCache | None = None):
        self.layout = layout
        self.num_pages = num_pages
        self.prefix = prefix
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._refs = [0] * num_pages
        # (source, destination) page copies, in order, that must happen before the next forward pass:
        # snapshots of states into cache pages, and cached snapshots into a resuming sequence's state.
        self.copies: list[tuple[int, int]] = []
        # Prompt tokens looked up in the cache, and found there (vLLM's prefix_cache_queries / _hits).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds, cached ones included (they are evicted on demand)."""
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

    # Admission: a sequence with no pages, which may start from a cached prefix ----------------

    def lookup(self, seq: Sequence) -> Hit:
        # Prompt logprobs need the logits of every prompt position, so such a prompt is computed whole (as vLLM).
        if self.prefix is None or seq.params.prompt_logprobs is not None:
            return Hit()
        return self.prefix.lookup(seq)

    def can_admit(self, seq: Sequence, hit: Hit, num_new_tokens: int) -> bool:
        assert not seq.has_pages and seq.num_computed_tokens == 0
        # Cached blocks nobody holds leave the free queue; the snapshot pages stay in it but must not
        # be handed out before their copy has been made.
        shared = sum(self._refs[page] == 0 for pages in hit.blocks for page in pages)
        new = self.layout.num_state_groups
        if self.layout.block_size:
            blocks = cdiv(hit.num_tokens + num_new_tokens, self.layout.block_size) - len(hit.blocks)
            new += self.layout.num_attention_groups * blocks
        return new + shared <= len(self._free) - len(hit.snapshot)

    def admit(self, seq: Sequence, hit: Hit, num_new_tokens: int) -> None:
        """Start `seq` from `hit`: share its blocks, copy its snapshot, allocate the rest."""
        assert self.can_admit(seq, hit, num_new_tokens), "admit() without can_admit()"
        if self.prefix is not None:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += hit.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit.num_tokens
        for page in hit.snapshot:
            self._free.move_to_end(page)  # most recently used, and out of reach of the _take below
        if hit.blocks:
            seq.block_tables = [[self._hold(pages[g]) for pages in hit.blocks]
                                for g in range(self.layout.num_attention_groups)]
        seq.num_computed_tokens = hit.num_tokens
        # The hit's blocks are in the cache already.
        seq.num_registered_blocks = hit.num_tokens // self._block_size if hit.num_tokens else 0
        self.allocate(seq, num_new_tokens)
        self.copies.extend(zip(hit.snapshot, seq.state_pages))

    # After a step: register what the sequence has now computed --------------------------------

    def commit(self, seq: Sequence) -> None:
        """Cache the blocks `seq` has filled, and snapshot its state if it stands on a block boundary."""
        if self.prefix is None:
            return
        names = self.prefix.hashes(seq)
        full = seq.num_computed_tokens // self._block_size
        for j in range(seq.num_registered_blocks, full):
            if self.prefix.has_attention:
                self.prefix.add_block(names[j], tuple(table[j] for table in seq.block_tables))
            if self.prefix.has_state:
                self.prefix.mark_seen(names[j])
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        # Snapshots only where the scheduler cut a prompt chunk (PrefixCache.chunk_end): a state after
        # a decode step would only push the cut-point snapshots out of the cache.
        cut = 0 < seq.num_computed_tokens < seq.num_tokens and seq.num_computed_tokens == full * self._block_size
        if self.prefix.has_state and cut and not self.prefix.has_snapshot(names[full - 1]):
            self._snapshot(seq, names[full - 1])

    def _snapshot(self, seq: Sequence, name: bytes) -> None:
        if len(self._free) < self.layout.num_state_groups:
            return  # no room: a snapshot never takes a page a sequence could use
        pages = tuple(self._take(self.layout.num_state_groups))
        self.copies.extend(zip(seq.state_pages, pages))
        self.prefix.add_snapshot(name, pages)
        for page in pages:
            self._release(page)

    def borrow(self, n: int) -> list[int] | None:
        """`n` free pages for the length of one step (the states a speculative verify keeps), or None."""
        return self._take(n) if n <= len(self._free) else None

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            self._release(page)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    # Freeing ----------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        # Last blocks first, so that a prompt's first blocks (the most widely shared) are evicted last.
        for table in seq.block_tables:
            for page in reversed(table):
                self._release(page)
        for page in seq.state_pages:
            self._release(page)
        seq.block_tables, seq.state_pages = [], []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and snapshot; their free pages become plain free pages."""
        if self.prefix is not None:
            self.prefix.reset()

    @property
    def num_cached_pages(self) -> int:
        return self.prefix.num_cached_pages if self.prefix is not None else 0

    # Pages ------------------------------------------------------------------------------------

    @property
    def _block_size(self) -> int:
        return self.prefix.block_size

    def _take(self, n: int) -> list[int]:
        pages = []
        for _ in range(max(0, n)):
            page, _ = self._free.popitem(last=False)
            if self.prefix is not None:
                self.prefix.evict(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def _hold(self, page: int) -> int:
        if self._refs[page] == 0:
            del self._free[page]
        self._refs[page] += 1
        return page

    def _release(self, page: int) -> None:
        assert self._refs[page] > 0, "a page was freed twice"
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free[page] = None
            if self.prefix is None or not self.prefix.is_cached(page):
                self._free.move_to_end(page, last=False)
