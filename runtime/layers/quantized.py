"""On-the-fly weight-only quantization of a model's decoder linears (`quantization="int8" | "int4"`).

Which linears: the projections inside the decoder layers (attention q/k/v/o, the MLPs, the Mamba, GDN and
short-conv input and output projections). The embeddings, the LM head, norms, conv weights, routers and the
SSM parameters stay in the model dtype: the LM head and embeddings are outside `layers`, the others are not
nn.Linear, and routers are skipped by name. MoE experts are quantized too: as nn.Linear modules per expert,
or held as stacked (experts, out, in) tensors (StackedLinear), one expert at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.heap import release_freed_memory
from runtime.kernels.quant_linear import SCHEMES, quant_linear, quantize
from runtime.layers.moe import StackedLinear

# Linears that pick experts: their logits decide routing, so they keep the model's precision.
ROUTER_NAMES = ("router", "gate", "shared_expert_gate")


class QuantLinear(nn.Module):
    """A linear whose weight is stored quantized (int8, packed int4 or FP8) with float32 scales and optional
    offsets per group (runtime.kernels.quant_linear), quantized here from an nn.Linear or loaded (`loaded`)."""

    def __init__(self, linear: nn.Linear, scheme: str, given: tuple[torch.Tensor, int] | None = None):
        super().__init__()
        weight = linear.weight.detach()
        scales, group_size = given if given is not None else (None, None)
        qweight, scales, group_size = quantize(weight.cpu(), scheme, scales, group_size)
        bias = linear.bias.detach() if linear.bias is not None else None
        self._hold(linear.in_features, scheme, weight.dtype, qweight.to(weight.device), scales.to(weight.device),
                   group_size, None, bias)

    @classmethod
    def loaded(cls, in_features: int, scheme: str, dtype: torch.dtype, qweight: torch.Tensor, scales: torch.Tensor,
               group_size: int, offsets: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> QuantLinear:
        """A QuantLinear holding a checkpoint's quantized weight as quant_linear's formats state it; `dtype` is
        the model's (what forward returns), `scheme` names the format for printing."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._hold(in_features, scheme, dtype, qweight, scales, group_size, offsets, bias)
        return module

    def _hold(self, in_features, scheme, dtype, qweight, scales, group_size, offsets, bias):
        self.in_features, self.out_features, self.scheme = in_features, qweight.shape[0], scheme
        self.dtype, self.group_size = dtype, group_size
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        self.register_buffer("offsets", None if offsets is None else offsets.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)

    def cut(self, where: str, name: str, dim: int, parts: tuple, rank0_only: bool, rank: int, tp: int) -> None:
        """runtime.distributed.sharding's hook: keep this rank's part of the weight or bias (runtime/quant/parallel.py)."""
        from runtime.quant.parallel import cut_loaded
        cut_loaded(self, where, name, dim, parts, rank0_only, rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.qweight, self.scales, self.group_size, self.bias, self.offsets, self.dtype)
        return y.to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class QuantStackedLinear(nn.Module):
    """StackedLinear's experts, each quantized as a QuantLinear's weight: qweight (E, N, ...), scales (E, N, G)."""

    def __init__(self, stacked: StackedLinear, scheme: str, given: tuple[torch.Tensor, int] | None = None):
        super().__init__()
        weight = stacked.weight.detach()
        self.dtype, self.scheme = weight.dtype, scheme
        scales, group_size = given if given is not None else ([None] * len(weight), None)
        parts = [quantize(expert.cpu(), scheme, s, group_size) for expert, s in zip(weight, scales)]
        self.group_size = parts[0][2]
        self.register_buffer("qweight", torch.stack([q for q, _, _ in parts]).to(weight.device), persistent=False)
        self.register_buffer("scales", torch.stack([s for _, s, _ in parts]).to(weight.device), persistent=False)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.qweight[expert], self.scales[expert], self.group_size, None, None, self.dtype)
        return y.to(self.dtype)


QUANTIZED = {nn.Linear: QuantLinear, StackedLinear: QuantStackedLinear}


def quantizes(name: str) -> bool:
    """The linear at this module path is one of the decoder's projections that get quantized."""
    parts = name.split(".")
    return "layers" in parts[:-1] and not any(part in ROUTER_NAMES for part in parts)


def quantize_linears(model: nn.Module, scheme: str) -> int:
    """Replace the decoder layers' nn.Linear and StackedLinear modules of `model` by their quantized
    counterparts (those not quantized yet, as the loader's streaming does: QuantizingLoad); returns how many
    the model holds. A tensor-parallel rank's row-parallel shard (`model.weight_shards` cuts its inputs) is
    quantized with the scales of the whole weight (runtime/quant/parallel.py)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; use one of {', '.join(SCHEMES)}")
    for name in quantization_targets(model):
        quantize_module(model, name, scheme)
    return sum(type(module) in QUANTIZED.values() for module in model.modules())


def quantization_targets(model: nn.Module) -> list[str]:
    """The module paths of the linears `quantize_linears` replaces."""
    return [name for name, module in model.named_modules() if type(module) in QUANTIZED and quantizes(name)]


def quantize_module(model: nn.Module, name: str, scheme: str) -> None:
    """Replace the linear at `name` by its quantized counterpart (its float weight is freed with it)."""
    from runtime.quant.parallel import row_scales
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = getattr(parent, child)
    shard = getattr(model, "weight_shards", {}).get(f"{name}.weight")
    rows = shard is not None and shard.dim == module.weight.dim() - 1
    given = row_scales(name, module.weight.detach(), scheme, shard) if rows else None
    setattr(parent, child, QUANTIZED[type(module)](module, scheme, given))


class QuantizingLoad:
    """The loader's hook for on-the-fly quantization: each target linear is quantized as soon as the checkpoint
    has filled its parameters, so that a model never holds more than one linear's float weights beside the
    quantized ones (a quantized run's peak memory is then the quantized model's, not the float one's as well:
    5.2 GB -> see docs/features/quantization.md)."""

    def __init__(self, model: nn.Module, scheme: str):
        self.model, self.scheme = model, scheme
        self.params: dict[str, list[str]] = {}  # target module -> its parameters
        self.waiting: dict[str, set[str]] = {}  # target module -> its parameters not loaded yet
        self.owner: dict[str, str] = {}  # parameter -> its target module
        for name in quantization_targets(model):
            module = model.get_submodule(name)
            self.params[name] = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
            self.waiting[name] = set(self.params[name])
            self.owner.update(dict.fromkeys(self.params[name], name))

    def loaded(self, param: str) -> list[str]:
        """`param` holds its checkpoint values: quantize its linear if it was the last one; returns the
        parameters released (the loader drops its references to them, so that their memory is freed)."""
        name = self.owner.get(param)
        if name is None or name not in self.waiting:
            return []
        waiting = self.waiting[name]
        waiting.discard(param)
        if waiting:
            return []
        del self.waiting[name]
        released = self.params[name]
        # The float weights of the linear quantized before this one are free by now: hand them back before
        # the next allocations, or the heap keeps them (runtime/heap.py) and the peak grows with each linear.
        release_freed_memory()
        quantize_module(self.model, name, self.scheme)
        return released


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (packed and quantized weights included), each storage once;
    oneDNN's packed weights (opaque tensors, no storage to share) by their size."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:
            total += tensor.numel() * tensor.element_size()
            continue
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
