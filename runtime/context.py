"""The per-step metadata every cache-bearing layer reads, built once per step by the runner.

Set with `with forward_context(ctx):` so that model `forward(input_ids, positions)`
signatures stay clean and the context cannot outlive its step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from runtime.kernels.metadata import AttentionMetadata, MambaPrefillMetadata


@dataclass(frozen=True)
class ForwardContext:
    # Decode rows come first in the packed batch, one token each (a verify's positions are decode rows too, in
    # waves: runtime/waves.py); prefill chunks follow.
    num_decodes: int
    num_prefill_tokens: int
    attention: AttentionMetadata | None
    block_tables: tuple[torch.Tensor, ...]  # per attention group: (S, max_blocks) int32 page ids
    slot_mappings: tuple[torch.Tensor, ...]  # per attention group: (T,) int64
    mamba_prefill: MambaPrefillMetadata | None
    decode_state_indices: tuple[torch.Tensor, ...]  # per state group: (decode sequences,) int64 page ids
    prefill_state_indices: tuple[torch.Tensor, ...]  # per state group: (num_prefills,) int64 page ids
    generated_split: GeneratedSplit | None = None
    # With LoRA: (T,) int64, each token row's adapter slot (the pool's zero slot for the base model);
    # None when no row of the step has an adapter.
    lora_indices: torch.Tensor | None = None
    # Sequences in each wave of the decode rows (runtime/waves.py); empty: one wave, a row per sequence.
    decode_waves: tuple[int, ...] = ()
    # Per state group: (sequences of wave 1, waves - 1) int64, where each sequence that goes on past wave i
    # keeps its state after wave i (speculative decoding resumes from the last accepted draft's).
    wave_snapshot_pages: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class GeneratedSplit:
    """The prefill sequences whose chunk holds generated tokens only (a verify step's drafts, or their replay)
    come last; a Mamba-2 mixer whose scan and decode step treat dt differently (Nemotron-H, Zamba2: the scan
    clamps it, decode does not) scans them apart, as decode, so that they compute what decoding would."""

    num_prompt_seqs: int
    num_prompt_tokens: int
    prompt: MambaPrefillMetadata | None  # None when every prefill sequence is a generated one
    generated: MambaPrefillMetadata


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def current_lora_indices() -> torch.Tensor | None:
    """The step's LoRA slot per token row, or None (no adapter in the step, or outside a step)."""
    return None if _current is None else _current.lora_indices


def update_in_waves(ctx: ForwardContext, group: int, states: tuple[torch.Tensor, ...],
                    update: Callable[[slice, torch.Tensor], Any]) -> list[Any]:
    """Run a state layer's decode `update(rows, state_page_ids)` over the step's decode rows, one wave after
    another (runtime/waves.py), keeping each continuing sequence's `states` (the layer's views of the pool,
    indexed by page id) after every wave but the last. Returns each wave's result, in order."""
    pages = ctx.decode_state_indices[group]
    waves = ctx.decode_waves or (ctx.num_decodes,)
    results, row = [], 0
    for i, n in enumerate(waves):
        results.append(update(slice(row, row + n), pages[:n]))
        row += n
        if i + 1 < len(waves):
            going_on = waves[i + 1]
            kept = ctx.wave_snapshot_pages[group][:going_on, i]
            for state in states:
                state.index_copy_(0, kept, state.index_select(0, pages[:going_on]))
    return results


def get_forward_context() -> ForwardContext:
    assert _current is not None, "a cache-bearing layer ran outside forward_context()"
    return _current
