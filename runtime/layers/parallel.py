"""Megatron-style tensor-parallel pieces, composed with the ordinary layers rather than replacing them.

A sharded layer keeps its modules, names and (packed) nn.Linear children; only its parameters are
narrowed to this rank's rows or columns (`Shard` says which part of the checkpoint's full tensor
that is), and a module whose output is a partial sum over the ranks (a row-parallel projection at
its end) gets `reduce_output` as a forward hook. Biases added after a partial sum live on rank 0
alone, so the all-reduce adds them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import state


@dataclass(frozen=True)
class Part:
    """`size` channels of the full tensor, cut into `pieces` (1: every rank keeps them all; tp: one piece
    per rank; fewer than tp: a piece shared by tp / pieces consecutive ranks, as replicated KV heads)."""

    size: int
    pieces: int

    def piece(self, rank: int, tp: int) -> tuple[int, int]:
        """(start, length) of this rank's piece within the part."""
        length = self.size // self.pieces
        return rank * self.pieces // tp * length, length


@dataclass(frozen=True)
class Shard:
    """How one rank's parameter is cut from the checkpoint's full tensor: parts laid end to end along `dim`."""

    full_shape: tuple[int, ...]
    dim: int
    parts: tuple[Part, ...]
    rank0_only: bool = False  # a bias after a partial sum: the other ranks hold zeros

    def local_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(part.size // part.pieces for part in self.parts)
        return tuple(shape)

    def take(self, full: Any, rank: int, tp: int) -> torch.Tensor:
        """This rank's part of `full` (a tensor, or a safetensors slice that reads only what is indexed)."""
        pieces, offset = [], 0
        for part in self.parts:
            start, length = part.piece(rank, tp)
            index = (slice(None),) * self.dim + (slice(offset + start, offset + start + length),)
            pieces.append(full[index])
            offset += part.size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


def reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the module's output is a partial sum over the ranks."""
    return state.all_reduce(output)


class ReducingLinear(nn.Linear):
    """A row-parallel nn.Linear whose own output is summed over the ranks (Mamba-1's x_proj, mid-mixer).

    A subclass, so that the CPU's linear packing (which replaces plain nn.Linear) leaves it, and its
    all-reduce, in place.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return state.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; other ids give zeros, and the all-reduce fills them in."""

    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return state.all_reduce(hidden.masked_fill(outside[:, None], 0))


def _rms_over_ranks(h: torch.Tensor, full_size: int, eps: float) -> torch.Tensor:
    """h (float32, this rank's channels) normalised by the RMS over every rank's channels."""
    square_sum = state.all_reduce(h.pow(2).sum(-1, keepdim=True))
    return h * torch.rsqrt(square_sum / full_size + eps)


class ParallelGatedRMSNorm(nn.Module):
    """runtime.layers.norm.GatedRMSNorm over one group that spans the ranks (a single Mamba-2 group,
    replicated): the sum of squares is all-reduced. Same order of operations as the reference."""

    weight: nn.Parameter
    eps: float
    full_size: int

    def forward(self, x: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        h = x.float()
        if z is not None:
            h = h * F.silu(z.float())
        return self.weight * _rms_over_ranks(h, self.full_size, self.eps).to(x.dtype)


class ParallelFalconGatedRMSNorm(nn.Module):
    """Falcon-H1's gated norm (runtime.models.falcon_h1.model.FalconGatedRMSNorm) over one group spanning the ranks."""

    weight: nn.Parameter
    eps: float
    full_size: int
    norm_before_gate: bool

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y if self.norm_before_gate else y * F.silu(z.float())
        h = self.weight * _rms_over_ranks(h.float(), self.full_size, self.eps)
        if self.norm_before_gate:
            h = h * F.silu(z.float())
        return h.to(dtype)


class ParallelRMSNorm(nn.Module):
    """An RMS norm over a whole projection whose channels are spread over the ranks (OLMo-Hybrid's q and k
    norms, runtime.models.olmo_hybrid.model.OlmoRMSNorm). `full_size` is this rank's width times the ranks:
    a projection copied on r ranks (replicated KV heads) adds its squares r times, and so does the divisor."""

    weight: nn.Parameter
    eps: float
    full_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * _rms_over_ranks(x.float(), self.full_size, self.eps)).to(x.dtype)
