"""This process's place in the tensor-parallel group, and the collectives the sharded layers call.

One group per process (torch.distributed's default group): gloo on the CPU, NCCL on CUDA. With no
group (one device) every collective is the identity, so a model built without sharding runs unchanged.
`CommStats` counts what the collectives move when `record()` is on (bench/allreduce.py reads it).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Collectives of the model's forward passes: count, bytes per rank, seconds spent in them."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + nbytes
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds


_stats: CommStats | None = None
# With pipeline parallelism, the ranks of this process's stage: the layers' collectives stay inside it.
# None: every rank of the group (tensor parallelism alone).
_tensor_group: Any = None


def set_tensor_group(group: Any) -> None:
    global _tensor_group
    _tensor_group = group


def rank() -> int:
    """This process's rank among the ranks that split its layers (its stage's, under pipeline parallelism)."""
    return dist.get_rank(_tensor_group) if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """How many ranks split this process's layers."""
    return dist.get_world_size(_tensor_group) if dist.is_available() and dist.is_initialized() else 1


@contextmanager
def record() -> Iterator[CommStats]:
    """Count the collectives run inside the block (on this rank)."""
    global _stats
    previous, _stats = _stats, CommStats()
    try:
        yield _stats
    finally:
        _stats = previous


@contextmanager
def _timed(op: str, tensor: torch.Tensor) -> Iterator[None]:
    if _stats is None:
        yield
        return
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    yield
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    _stats.add(op, tensor.numel() * tensor.element_size(), time.perf_counter() - start)


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place; returns it."""
    if world_size() == 1:
        return tensor
    with _timed("all_reduce", tensor):
        dist.all_reduce(tensor, group=_tensor_group)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of `tensor` over the ranks, in place (a row-parallel weight's group scales when it
    is quantized on loading, runtime/quant/parallel.py); returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_tensor_group)
    return tensor


def all_gather_last(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` side by side along the last dimension, in rank order."""
    size = world_size()
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    with _timed("all_gather", tensor):
        dist.all_gather(parts, tensor, group=_tensor_group)
    return torch.cat(parts, dim=-1)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Point to point, to global rank `dst` (a pipeline stage's hidden states, or the logits for rank 0)."""
    with _timed("send", tensor):
        dist.send(tensor, dst=dst)


def isend(tensor: torch.Tensor, dst: int) -> Any:
    """`send` without waiting for `dst` to take it (gloo's send waits for the matching receive): the work, which
    the caller keeps, with `tensor`, until it completes. The time recorded is the posting's."""
    with _timed("send", tensor):
        return dist.isend(tensor, dst=dst)


def recv(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `tensor` from global rank `src`; the time includes waiting for the sender to get there."""
    with _timed("recv", tensor):
        dist.recv(tensor, src=src)
    return tensor
