"""Block-size resolution and the page layout of the shared pool.

An attention page (K and V for `block_size` tokens of one layer) must be at least as
large as a Mamba state page (one sequence's conv and SSM state in one layer), and the
Mamba page is then padded to equal it, so both come from one pool of equal pages.
Layers are grouped as in vLLM: a page id holds `group_size` layer pages, one per layer
of a group, and every layer of a group uses the same page ids.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property

from runtime.cache.spec import AttentionSpec, MambaSpec
from runtime.hf_config import ConfigError
from runtime.models.interface import LayerKind
from runtime.options import spell

logger = logging.getLogger("tandem")

DEFAULT_BLOCK_SIZE = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def min_hybrid_block_size(mamba_page: int, attn_bytes_per_token: int, unit: int) -> int:
    """The smallest multiple of `unit` tokens whose attention page holds a Mamba page."""
    return unit * cdiv(cdiv(mamba_page, attn_bytes_per_token), unit)


def resolve_block_size(
    *,
    attn_bytes_per_token: int | None,
    mamba_page: int | None,
    user_block_size: int | None,
    alignment: int,
    chunk_size: int | None,
    prefix_caching: bool,
) -> int | None:
    """The attention block size in tokens, or None for a model without attention."""
    if attn_bytes_per_token is None:
        if user_block_size is not None:
            logger.warning("%s ignored: the model has no attention layers", spell("block_size", user_block_size))
        return None
    unit = alignment
    if mamba_page is not None and prefix_caching and chunk_size:
        # A Mamba state is kept per block boundary, and states exist only at chunk ends
        # (Mamba-1 has no chunk size: its state exists after every token).
        unit = math.lcm(chunk_size, alignment)
    smallest = unit if mamba_page is None else min_hybrid_block_size(mamba_page, attn_bytes_per_token, unit)
    if user_block_size is None:
        return max(smallest, DEFAULT_BLOCK_SIZE) if mamba_page is None else smallest
    if user_block_size < smallest or user_block_size % unit:
        why = f"a multiple of {unit}"
        if unit != alignment:
            why += " (lcm of the Mamba chunk size and the attention alignment)"
        what = f"at least {smallest} tokens and {why}" if mamba_page is not None else why
        raise ConfigError(
            f"{spell('block_size', user_block_size)} is invalid: it must be {what}; "
            f"the smallest valid value is {smallest} (or leave it unset to choose automatically)"
        )
    return user_block_size


def group_size_for(counts: list[int]) -> int:
    """Layers per group: the smallest layer count, or the largest when they are close (vLLM's rule)."""
    counts = [c for c in counts if c]
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * 1.25 else smallest


@dataclass(frozen=True)
class CacheLayout:
    """The resolved cache layout of one model, decided once when the config is built."""

    layers: tuple[LayerKind, ...]
    block_size: int | None
    attention: AttentionSpec | None
    mamba: MambaSpec | None
    group_size: int

    @property
    def page_size_bytes(self) -> int:
        spec = self.attention or self.mamba
        return spec.page_size_bytes

    @cached_property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layers) if kind.has_attention)

    @cached_property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layers) if kind.has_state)

    @cached_property
    def num_attention_groups(self) -> int:
        return cdiv(len(self.attention_layers), self.group_size)

    @cached_property
    def num_state_groups(self) -> int:
        return cdiv(len(self.state_layers), self.group_size)

    @property
    def bytes_per_page_id(self) -> int:
        """One page id spans one layer page in each of `group_size` slabs."""
        return self.group_size * self.page_size_bytes

    def pages_per_sequence(self, num_tokens: int) -> int:
        """Page ids one sequence of `num_tokens` tokens holds: its KV blocks and its states."""
        blocks = cdiv(num_tokens, self.block_size) if self.block_size else 0
        return self.num_attention_groups * blocks + self.num_state_groups

    def max_num_sequences(self, memory_bytes: int, num_tokens: int) -> int:
        return (memory_bytes // self.bytes_per_page_id) // self.pages_per_sequence(num_tokens)


def build_layout(
    layers: tuple[LayerKind, ...],
    attention: AttentionSpec | None,
    mamba: MambaSpec | None,
) -> CacheLayout:
    """Pad the Mamba page to the attention page and group the layers."""
    if attention is not None and mamba is not None:
        assert attention.page_size_bytes >= mamba.unpadded_page_size_bytes
        mamba = MambaSpec(mamba.shapes, mamba.dtypes, page_size_padded=attention.page_size_bytes)
    counts = [sum(kind.has_attention for kind in layers), sum(kind.has_state for kind in layers)]
    if not any(counts):
        raise ConfigError("the model has no attention or state layers, so there is nothing to cache")
    return CacheLayout(layers, attention.block_size if attention else None, attention, mamba, group_size_for(counts))
