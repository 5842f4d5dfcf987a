"""Prefix caching: full blocks of tokens found again by a chained hash. Pure Python: no torch.

A block of `block_size` tokens is named by the hash of its tokens and of the name of the
block before it, so a name stands for the whole prefix up to the block's end. What is kept
under a name:

- attention models: the block's KV pages (one per attention group). They are the very
  pages the sequence that computed them wrote, shared by reference count.
- models with Mamba (or other recurrent) layers: a snapshot of every state group at the
  block's end boundary, copied into pages of the same pool. A state cannot be rebuilt from a
  shorter one, so a prompt can resume at a boundary only where a snapshot exists.

Snapshots are taken where a step of a sequence ends on a block boundary, so the scheduler
ends prompt chunks at the boundaries worth keeping (see `PrefixCache.chunk_end`): the last
block boundary of the prompt, and the boundary where the prompt leaves the longest prefix
already seen (the end of a shared system prompt, the second time it is seen). Every cached
page is unreferenced and free in the manager's free queue, evicted least recently used.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from runtime.cache.layout import CacheLayout
from runtime.sequence import Sequence

# The parent of a sequence's first block. Nothing but token ids changes a block's content in
# this engine (no LoRA adapters, no multimodal inputs, one model and dtype per engine).
ROOT_HASH = hashlib.sha256(b"tandem prefix cache v1").digest()
# Block names remembered (with no pages) to find where prompts diverge from earlier ones.
MAX_SEEN_BLOCKS = 1 << 16


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_hash(seq: Sequence) -> bytes:
    """The chain's start: the base model's, or one per LoRA adapter id, so that two adapters (or an adapter
    and the base model) never share a cached block or state snapshot."""
    lora = seq.lora_request
    if lora is None:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + repr((lora.lora_int_id, lora.lora_path)).encode()).digest()


def prefix_block_size(layout: CacheLayout, chunk_size: int | None, alignment: int) -> int:
    """Tokens per cached block: the attention block, or for a model without attention the
    Mamba chunk size rounded to the alignment (Mamba-1 has no chunk: a state exists after any token)."""
    if layout.block_size:
        return layout.block_size
    return math.lcm(chunk_size or 1, alignment)


@dataclass(frozen=True)
class Hit:
    """What a new sequence finds in the cache: its first `num_tokens` tokens need no computing."""

    num_tokens: int = 0
    blocks: tuple[tuple[int, ...], ...] = ()  # per cached block: its page in each attention group
    snapshot: tuple[int, ...] = ()  # per state group: the state snapshot page at `num_tokens`


class PrefixCache:
    """The names of cached blocks and the pages that hold them; the CacheManager owns the pages."""

    def __init__(self, layout: CacheLayout, block_size: int, every_block: bool = False):
        self.block_size = block_size
        self.has_attention = layout.num_attention_groups > 0
        self.has_state = layout.num_state_groups > 0
        # Snapshot at every block boundary (prompt chunks of one block each) instead of at the
        # boundaries chunk_end picks; measured by bench/prefix.py, off by default.
        self.every_block = every_block
        self.blocks: dict[bytes, tuple[int, ...]] = {}
        self.snapshots: dict[bytes, tuple[int, ...]] = {}
        self.owner: dict[int, tuple[dict[bytes, tuple[int, ...]], bytes]] = {}
        self.seen: OrderedDict[bytes, None] = OrderedDict()

    # Names ------------------------------------------------------------------------------------

    def hashes(self, seq: Sequence) -> list[bytes]:
        """The names of every full block of `seq`'s tokens, computed once per block."""
        size, names = self.block_size, seq.block_hashes
        if len(names) == seq.num_tokens // size:
            return names  # the usual case in a decode step; token_ids would copy the whole sequence
        tokens = seq.token_ids
        for j in range(len(names), len(tokens) // size):
            names.append(hash_block(names[-1] if names else root_hash(seq), tokens[j * size : (j + 1) * size]))
        return names

    def is_cached(self, page: int) -> bool:
        return page in self.owner

    @property
    def num_cached_pages(self) -> int:
        return len(self.owner)

    # Lookup -----------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> Hit:
        """The longest cached prefix of `seq`, leaving at least its last token to compute."""
        names = self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]
        k = len(names)
        if self.has_attention:
            k = next((j for j, name in enumerate(names) if name not in self.blocks), k)
        if self.has_state:
            while k and names[k - 1] not in self.snapshots:
                k -= 1
        if k == 0:
            return Hit()
        blocks = tuple(self.blocks[name] for name in names[:k]) if self.has_attention else ()
        snapshot = self.snapshots[names[k - 1]] if self.has_state else ()
        return Hit(k * self.block_size, blocks, snapshot)

    def chunk_end(self, seq: Sequence, start: int, end: int) -> int:
        """Where a chunk of `seq` from `start` (planned to `end`) stops, so that a snapshot is taken
        at the boundaries worth keeping. Models without state have every full block cached anyway."""
        if not self.has_state:
            return end
        size = self.block_size
        if self.every_block:
            return min(end, (start // size + 1) * size)
        last = (seq.num_tokens - 1) // size * size
        for cut in sorted({self._divergence(seq), last}):
            if start < cut < end:
                return cut
        if end < seq.num_tokens and end // size * size > start:
            return end // size * size  # the budget cut the chunk: end it on a boundary
        return end

    def _divergence(self, seq: Sequence) -> int:
        """The end of the longest prefix of `seq` that an earlier sequence computed, if it has no snapshot."""
        names = self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]
        k = next((j for j, name in enumerate(names) if name not in self.seen), len(names))
        return 0 if k == 0 or names[k - 1] in self.snapshots else k * self.block_size

    # Registration (the manager hands over pages it has just filled) ---------------------------

    def add_block(self, name: bytes, pages: tuple[int, ...]) -> bool:
        """Register a computed block's KV pages under its name; False if the name is taken."""
        return self._add(self.blocks, name, pages)

    def add_snapshot(self, name: bytes, pages: tuple[int, ...]) -> bool:
        return self._add(self.snapshots, name, pages)

    def has_snapshot(self, name: bytes) -> bool:
        return name in self.snapshots

    def mark_seen(self, name: bytes) -> None:
        self.seen[name] = None
        self.seen.move_to_end(name)
        if len(self.seen) > MAX_SEEN_BLOCKS:
            self.seen.popitem(last=False)

    def _add(self, table: dict[bytes, tuple[int, ...]], name: bytes, pages: tuple[int, ...]) -> bool:
        if name in table:
            return False
        table[name] = pages
        for page in pages:
            self.owner[page] = (table, name)
        return True

    # Eviction ---------------------------------------------------------------------------------

    def evict(self, page: int) -> None:
        """`page` is about to hold something else: forget the entry it belongs to (all its pages)."""
        entry = self.owner.pop(page, None)
        if entry is None:
            return
        table, name = entry
        for other in table.pop(name):
            self.owner.pop(other, None)

    def reset(self) -> None:
        """Forget every cached block and snapshot; pages in use stay with their sequences."""
        self.blocks.clear()
        self.snapshots.clear()
        self.owner.clear()
        self.seen.clear()
