"""The per-step metadata every cache-bearing layer reads, built once per step by the runner.

Set with `with forward_context(ctx):` so that model `forward(input_ids, positions)`
signatures stay clean and the context cannot outlive its step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

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
    # With waves, per state group: (waves + 1, decode sequences) int64, the page each sequence's state is read
    # from in wave 0 and written to by each wave (speculative decoding resumes from the last accepted draft's).
    wave_state_pages: tuple[torch.Tensor, ...] = ()

    def decode_pages(self, group: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """A state group's pages for its layers' decode kernels, and the waves: each decode sequence's page and
        None, or in a verify step the page chains of runtime.kernels.common.in_waves and the waves."""
        if self.decode_waves:
            return self.wave_state_pages[group], self.decode_waves
        return self.decode_state_indices[group], None


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


def get_forward_context() -> ForwardContext:
    assert _current is not None, "a cache-bearing layer ran outside forward_context()"
    return _current
