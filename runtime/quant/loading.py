"""The loader's hook for quantized checkpoints: which linears the file quantizes (plan), placeholders that hold
no float weight while the files are read (PendingQuant: the model never holds a float copy of a quantized
weight), and their replacement by QuantLinear once every tensor is in (finish)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.layers.parallel import Part, Shard
from runtime.layers.quantized import QuantLinear
from runtime.quant.config import CheckpointQuant, WeightFormat
from runtime.quant.convert import QUANT_SUFFIXES, SKIPPED, QuantTensorError, convert, split_name
from runtime.quant.parallel import check_rows, cut, rank0_bias

# The tensors whose presence marks a linear as quantized in the file.
MARKERS = ("weight_scale_inv", "weight_scale", "weight_packed")


class PendingQuant(nn.Module):
    """A quantized linear while the checkpoint is read: its shape, its format and the tensors read so far."""

    def __init__(self, linear: nn.Linear, fmt: WeightFormat):
        super().__init__()
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.has_bias, self.dtype = linear.bias is not None, linear.weight.dtype
        self.checkpoint_prefix: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        # Under tensor parallelism: how this rank's part is cut from the converted layer (runtime/quant/parallel.py).
        self.shard: Shard | None = None
        self.bias_on_rank0 = False  # a whole layer after a partial sum (Nemotron-H's fc2_latent_proj)
        self.rank, self.tp = 0, 1

    def cut(self, where: str, name: str, dim: int, parts: tuple[Part, ...], rank0_only: bool, rank: int,
            tp: int) -> None:
        """runtime.distributed.sharding's hook: record how the weight is cut (refusing a split of the inputs that
        is not whole quantization groups) or that the bias lives on rank 0; the tensors are cut once converted."""
        self.rank, self.tp = rank, tp
        if name == "bias":
            self.bias_on_rank0 = rank0_only
            return
        full = (self.out_features, self.in_features)
        assert name == "weight" and sum(p.size for p in parts) == full[dim], (where, name, dim, parts)
        self.shard = Shard(full, dim, parts)
        check_rows(where, self.shard, k_group(self.fmt, self.in_features), tp)


def k_group(fmt: WeightFormat, in_features: int) -> int:
    """The inputs one scale covers along K."""
    if fmt.strategy in ("tensor", "channel"):
        return in_features
    return fmt.block[1] if fmt.strategy == "block" else fmt.group_size


def tensor_names(path: Path) -> list[str]:
    """The tensor names of one weight file, without reading their data."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="meta", weights_only=True, mmap=True))


def quantized_in_files(model: nn.Module, files: list[Path]) -> dict[str, str]:
    """Our module path -> the checkpoint's prefix, for every linear the files hold quantized."""
    found = {}
    for path in files:
        for name in tensor_names(path):
            prefix, suffix = split_name(name)
            target = model.checkpoint_name(prefix + ".weight") if suffix in MARKERS else None
            if target is not None:
                found[target.rpartition(".")[0]] = prefix
    return found


def plan(model: nn.Module, quant: CheckpointQuant, files: list[Path]) -> dict[str, WeightFormat]:
    """Module path -> weight format of every linear to load quantized. The file and config.json must agree:
    a linear config.json quantizes must hold quantized tensors, and a quantized tensor must have a linear."""
    in_files = quantized_in_files(model, files)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if quant.fp8 is not None:
        chosen = {name: quant.fp8 for name in in_files if name in linears}
    else:
        chosen = {name: fmt for name, m in linears.items() if (fmt := quant.format_for(name, m)) is not None}
    stray = sorted(set(in_files) - set(chosen))
    if stray:
        why = ("the model has no linear there" if stray[0] not in linears
               else "quantization_config leaves it unquantized (its ignore list)")
        raise QuantTensorError(f"{in_files[stray[0]]}: the checkpoint holds it quantized, but {why}; "
                               f"does config.json match the weights?")
    unquantized = sorted(set(chosen) - set(in_files))
    if unquantized:
        raise QuantTensorError(f"{unquantized[0]}: quantization_config quantizes this linear but the checkpoint holds "
                               f"no {'/'.join(MARKERS)} for it; does config.json match the weights?")
    return chosen


def install(model: nn.Module, chosen: dict[str, WeightFormat]) -> dict[str, PendingQuant]:
    """Swap each chosen linear (its parameters still on the meta device) for a PendingQuant."""
    pending = {}
    for name, fmt in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        pending[name] = PendingQuant(getattr(parent, child), fmt)
        setattr(parent, child, pending[name])
    return pending


def keep_stage(model: nn.Module, pending: dict[str, PendingQuant]) -> tuple[dict[str, PendingQuant], set[str]]:
    """The pending linears a pipeline stage kept, and the tensor names (ours) of those it dropped."""
    present = {id(module) for module in model.modules()}
    kept = {name: slot for name, slot in pending.items() if id(slot) in present}
    suffixes = ("weight", "bias", *QUANT_SUFFIXES)
    dropped = {f"{name}.{suffix}" for name in set(pending) - set(kept) for suffix in suffixes}
    return kept, dropped


def route(pending: dict[str, PendingQuant], target: str, name: str, load: Any) -> bool:
    """Keep a checkpoint tensor that belongs to a pending quantized linear (True), else let the loader load it."""
    module, _, suffix = target.rpartition(".")
    if module not in pending:
        return False
    slot = pending[module]
    if suffix not in ("weight", "bias", *QUANT_SUFFIXES):
        return False
    slot.checkpoint_prefix = split_name(name)[0]
    if suffix not in SKIPPED:
        slot.tensors[suffix] = load()
    return True


def _rank_bias(slot: PendingQuant, bias: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's bias: a column-parallel layer's rows; a layer whose output is a partial sum (row-parallel, or
    Nemotron-H's fc2_latent_proj) adds it once, on rank 0."""
    if bias is None or slot.tp == 1:
        return bias
    if slot.bias_on_rank0 or (slot.shard is not None and slot.shard.dim):
        return rank0_bias(bias, slot.rank)
    return bias if slot.shard is None else slot.shard.take(bias, slot.rank, slot.tp).contiguous()


def finish(model: nn.Module, pending: dict[str, PendingQuant], device: torch.device) -> None:
    """Convert every pending linear; only when all converted are they swapped in (nothing half-loaded)."""
    built = {}
    for name, slot in pending.items():
        label = slot.checkpoint_prefix or name
        qweight, scales, group_size, offsets = convert(label, slot.fmt, slot.tensors, slot.out_features,
                                                       slot.in_features)
        bias = slot.tensors.get("bias")
        if slot.has_bias != (bias is not None):
            raise QuantTensorError(f"{label}.bias: the model's layer {'has' if slot.has_bias else 'has no'} bias "
                                   f"but the checkpoint {'lacks it' if slot.has_bias else 'holds one'}")
        in_features = slot.in_features
        if slot.shard is not None:
            qweight, scales, group_size, offsets, in_features = cut(label, slot.shard, slot.rank, slot.tp, qweight,
                                                                    scales, group_size, offsets, in_features)
        bias = _rank_bias(slot, bias)
        built[name] = QuantLinear.loaded(in_features, slot.fmt.describe(), slot.dtype, qweight.to(device),
                                         scales.to(device), group_size,
                                         None if offsets is None else offsets.to(device),
                                         None if bias is None else bias.to(device))
        slot.tensors.clear()
    for name, module in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
