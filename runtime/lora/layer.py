"""A linear with a pool of LoRA slots: the base output, plus each row's adapter through the batched kernels.

Every linear of the decoder (not the LM head, not MoE experts) is wrapped when the engine starts with
enable_lora, so an adapter loads into slots that already exist (the memory is fixed at start, as vLLM's).
Slots hold A (S + 1, R, in) and B (S + 1, R, out) in float32 (bfloat16 for a bfloat16 model, as PEFT loads an
adapter in the model's dtype: the pools are read every step, and that halves the bytes) and a float32 bias
(S + 1, out), zero-padded to
max_lora_rank; the last slot stays zero for the rows of the base model. Under tensor parallelism a slot
holds this rank's part, cut like the base layer's weight: a column-parallel linear's B rows and bias, a
row-parallel linear's A columns (its partial sums are added up by the all-reduce after it, as the base's).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.context import current_lora_indices
from runtime.distributed import state
from runtime.layers.parallel import Part, ReducingLinear, Shard
from runtime.lora.adapter import ModuleWeights

# Not Mamba-1's dt_proj (DtProjection): transformers' Mamba and Jamba read its weight directly, so an adapter
# on it changes nothing under PEFT; the engine refuses it rather than disagree (adapter.py).
LINEAR_TYPES = ("Linear", "PackedLinear", "QuantLinear", "ReducingLinear")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, shard: Shard | None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.full_out, self.full_in = shard.full_shape if shard is not None else (self.out_features, self.in_features)
        self.shard = shard  # how the base weight is cut from the checkpoint's (None: whole)
        self.reduces = isinstance(base, ReducingLinear)  # its all-reduce is inside: the shrink is summed here
        device = _device(base)
        f32, pool = dict(dtype=torch.float32, device=device), dict(dtype=dtype, device=device)
        self.register_buffer("lora_a", torch.zeros(num_slots + 1, max_rank, self.in_features, **pool),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots + 1, max_rank, self.out_features, **pool),
                             persistent=False)
        self.register_buffer("lora_bias", torch.zeros(num_slots + 1, self.out_features, **f32), persistent=False)
        base_bias = getattr(base, "bias", None)
        self.base_bias = None if base_bias is None else base_bias.detach().float().clone()

    @property
    def bias(self) -> torch.Tensor | None:  # read by layers that add a linear's bias themselves
        return self.base.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        indices = current_lora_indices()
        if indices is None:
            return y
        s = kernels.lora_shrink(x.reshape(-1, self.in_features), self.lora_a, indices)  # (T, R)
        if self.reduces:
            s = state.all_reduce(s)
        kernels.lora_expand(s, self.lora_b, self.lora_bias, indices, y.view(-1, self.out_features))
        return y

    @torch.no_grad()
    def load_slot(self, slot: int, weights: ModuleWeights | None) -> None:
        """Write this rank's part of `weights` into `slot` (zeros for an adapter that leaves this linear alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_bias[slot].zero_()
        if weights is None:
            return
        rank = weights.a.shape[0]
        a, b = weights.a, weights.b
        if self.shard is not None and self.shard.dim == 0:
            b = _cut(self.shard, b, 0)
        elif self.shard is not None:
            a = _cut(self.shard, a, 1)
        self.lora_a[slot, :rank].copy_(a)
        self.lora_b[slot, :rank].copy_(b.T)
        if weights.bias is not None:
            self.lora_bias[slot].copy_(self._cut_bias(weights.bias))
        if weights.replaced_bias is not None:
            base = self.base_bias if self.base_bias is not None else 0.0
            self.lora_bias[slot].add_(self._cut_bias(weights.replaced_bias) - base)

    def _cut_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """This rank's part of an output bias: cut like the output features of a column-parallel linear; whole
        on rank 0 alone after a row-parallel one (the all-reduce adds it once); whole on every rank after one
        that reduces inside (Mamba-1's x_proj: the expand adds to the summed output)."""
        if self.shard is None or self.reduces:
            return bias
        if self.shard.dim == 1:
            return bias if state.rank() == 0 else torch.zeros_like(bias)
        return _cut(self.shard, bias, 0)

    def slot_bytes(self) -> int:
        return (self.lora_a[0].nbytes + self.lora_b[0].nbytes + self.lora_bias[0].nbytes)


def _cut(shard: Shard, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's part of an adapter matrix, cut along `dim` as the base weight is along the same features."""
    full = tuple(tensor.shape)
    cut = Shard(full, dim, tuple(Part(p.size, p.pieces) for p in shard.parts))
    return cut.take(tensor, state.rank(), state.world_size())


def _device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def pool_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The slots' A and B: bfloat16 for a bfloat16 model, float32 otherwise (the kernels read those two)."""
    return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32


def wrap_linears(model: nn.Module, num_slots: int, max_rank: int, model_dtype: torch.dtype = torch.float32
                 ) -> dict[str, LoRALinear]:
    """Replace each adaptable linear of `model` by a LoRALinear around it; returns them by module name."""
    shards = getattr(model, "weight_shards", {})
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in LINEAR_TYPES or not _adaptable(name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoRALinear(module, num_slots, max_rank, shards.get(name + ".weight"), pool_dtype(model_dtype))
        setattr(parent, child, layer)
        wrapped[name] = layer
    return wrapped


def _adaptable(name: str) -> bool:
    """Decoder linears: not the LM head, and not one expert's projections (PEFT cannot target them by name
    in transformers' fused experts, and a slot pool per expert would multiply the memory by the experts)."""
    return name != "lm_head" and ".experts." not in name and not name.endswith(".experts")
