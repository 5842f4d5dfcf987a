"""Quantized linears under tensor parallelism: each rank holds exactly its rows or columns of the unsharded
layer's quantization, so TP=N computes with the same weights as TP=1.

A column-parallel layer splits its output rows: the weight's rows with their scales, zero-point offsets and
bias (the runtime's format keeps one scale per row and group, a block-wise FP8 scale repeated over its rows, so
any row split is exact). A row-parallel layer splits its inputs K: a rank's K / tp columns must be whole groups
of the layer's quantization (their scales split with them), or lie inside one group (int8's one scale per row,
a block wider than the share), whose scale every rank keeps; anything else is refused. Packed int4 columns are
unpacked, cut and packed again. Quantizing on loading (int8, int4), a rank holds only its shard of the float
weight: a group that spans ranks takes its scale from the maximum over the ranks (an all-reduce), which is the
unsharded weight's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from runtime.distributed import state
from runtime.kernels.quant_linear import LEVELS, SCHEMES, group_size_of, pack_int4, unpack_int4
from runtime.layers.parallel import Shard


def fits(k: int, group_size: int, tp: int) -> bool:
    """Each rank's K / tp inputs are whole groups, or lie inside one group."""
    share = k // tp
    return share % group_size == 0 or all(r * share // group_size == ((r + 1) * share - 1) // group_size
                                          for r in range(tp))


def local_group_size(where: str, k: int, group_size: int, tp: int) -> int:
    """The group size of a rank's share of a row-parallel layer's K inputs; a ValueError where it has none."""
    share = k // tp
    if share % group_size == 0:
        return group_size
    if fits(k, group_size, tp):
        return share
    sizes = ", ".join(str(size) for size in range(1, min(k, 16) + 1) if k % size == 0 and fits(k, group_size, size))
    raise ValueError(
        f"{where}: its {k} inputs split over tensor_parallel_size={tp} give {share} per rank, which is not a whole "
        f"number of its quantization groups of {group_size} inputs; a row-parallel quantized layer needs each "
        f"rank's share to be whole groups (tensor-parallel sizes up to 16 that work here: {sizes})")


def check_rows(where: str, shard: Shard, group_size: int, tp: int) -> None:
    """Refuse a row-parallel split (`shard` cuts K) that no rank can hold as whole groups."""
    if shard.dim == len(shard.full_shape) - 1 and not shard.rank0_only:
        local_group_size(where, shard.full_shape[-1], group_size, tp)


def cut(where: str, shard: Shard, rank: int, tp: int, qweight: Tensor, scales: Tensor, group_size: int,
        offsets: Tensor | None, in_features: int) -> tuple[Tensor, Tensor, int, Tensor | None, int]:
    """This rank's (qweight, scales, group_size, offsets, in_features) of a converted quantized linear."""
    if shard.dim == 0:
        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None else shard.take(t, rank, tp).contiguous()
        return rows(qweight), rows(scales), group_size, rows(offsets), in_features
    (part,) = shard.parts
    start, share = part.piece(rank, tp)
    local = local_group_size(where, in_features, group_size, tp)
    if qweight.dtype == torch.uint8:  # packed int4: cut the values, not the bytes
        qweight = pack_int4(unpack_int4(qweight, in_features)[:, start:start + share])
    else:
        qweight = qweight[:, start:start + share].contiguous()
    first, count = start // group_size, share // local if local == group_size else 1
    groups = slice(first, first + count)
    offsets = None if offsets is None else offsets[:, groups].contiguous()
    return qweight, scales[:, groups].contiguous(), local, offsets, share


def rank0_bias(bias: Tensor | None, rank: int) -> Tensor | None:
    """A bias added after the all-reduce of partial sums: rank 0 holds it, the others zeros."""
    return bias if bias is None or rank == 0 else torch.zeros_like(bias)


def row_scales(where: str, weight: Tensor, scheme: str, shard: Shard) -> tuple[Tensor, int]:
    """(scales, group_size) that quantize this rank's columns (`weight`, (..., N, K / tp)) of a row-parallel
    weight as the whole weight is quantized: each group's maximum over every rank holding part of it."""
    tp, rank, k = state.world_size(), state.rank(), shard.full_shape[-1]
    group_size = group_size_of(scheme, k)
    local = local_group_size(where, k, group_size, tp)
    (part,) = shard.parts
    start, share = part.piece(rank, tp)
    count = share // local
    first = start // group_size
    amax = torch.zeros(*weight.shape[:-1], -(-k // group_size), dtype=torch.float32, device=weight.device)
    amax[..., first:first + count] = weight.float().abs().reshape(*weight.shape[:-1], count, local).amax(-1)
    state.all_reduce_max(amax)
    return (amax[..., first:first + count] / LEVELS[scheme]).cpu(), local  # quantize() runs on the CPU


def check_sharding(config: Any, model: nn.Module) -> None:
    """runtime.distributed.sharding.check_sharding on the meta model, its quantized linears cut as they will be
    when loaded (a checkpoint's, planned from its tensor names) or quantized (on loading): the ValueError a
    rank would raise, before any process starts."""
    from runtime.distributed.sharding import check_sharding as check_float
    from runtime.layers.quantized import QUANTIZED, quantizes
    from runtime.loader import checkpoint_files
    from runtime.quant import loading

    tp, scheme = config.tensor_parallel_size, config.quantization
    if config.checkpoint_quantization is not None:
        chosen = loading.plan(model, config.checkpoint_quantization, checkpoint_files(config.model_dir))
        loading.install(model, chosen)
    shards = check_float(model, tp)
    if scheme not in SCHEMES:
        return
    for name, module in model.named_modules():
        shard = shards.get(f"{name}.weight")
        if shard is not None and type(module) in QUANTIZED and quantizes(name):
            check_rows(name, shard, group_size_of(scheme, shard.full_shape[-1]), tp)


def cut_loaded(linear: nn.Module, where: str, name: str, dim: int, parts: tuple[Any, ...], rank0_only: bool,
               rank: int, tp: int) -> None:
    """Narrow a QuantLinear loaded whole (a GGUF file's) to this rank's part, in place: runtime.distributed.sharding
    calls it for its weight, then for its bias (rows of a column-parallel layer; rank 0's after a partial sum)."""
    if name == "bias":
        bias = linear.bias
        linear.bias = rank0_bias(bias, rank) if rank0_only else Shard(tuple(bias.shape), 0, parts).take(bias, rank, tp)
        return
    assert name == "weight", (where, name)
    device = linear.qweight.device
    shard = Shard((linear.out_features, linear.in_features), dim, parts)
    offsets = None if linear.offsets is None else linear.offsets.cpu()
    qweight, scales, group_size, offsets, k = cut(where, shard, rank, tp, linear.qweight.cpu(), linear.scales.cpu(),
                                                  linear.group_size, offsets, linear.in_features)
    linear.qweight, linear.scales = qweight.to(device), scales.to(device)
    linear.offsets = None if offsets is None else offsets.to(device)
    linear.in_features, linear.out_features, linear.group_size = k, qweight.shape[0], group_size
