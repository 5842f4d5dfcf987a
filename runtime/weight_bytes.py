"""The bytes a model's weights take in each format, from its config alone (for `tandem plan`, and the
benchmark's bandwidth floors): the decoder linears quantized as runtime.layers.quantized does (int8 or int4
codes, float32 scales, a float32 bias), everything else in the model dtype.

The model is built on torch's meta device (shapes, no memory, no weights read), so the figures are those of
the modules the engine runs, exactly what runtime.layers.quantized.weight_bytes counts once loaded.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from runtime.kernels.quant_linear import INT4_BLOCK, group_size_of
from runtime.layers.moe import StackedLinear
from runtime.layers.quantized import QUANTIZED, quantizes

FORMATS = (None, "int8", "int4")  # None: the model dtype
SCALE_BYTES = 4  # float32 scales and biases


def linear_bytes(out_features: int, in_features: int, scheme: str) -> int:
    """One quantized (out, in) weight: its codes (int8, or int4 packed in blocks of 16) and one float32 scale
    per output feature and group."""
    groups = -(-in_features // group_size_of(scheme, in_features))
    codes = in_features if scheme == "int8" else -(-in_features // INT4_BLOCK) * INT4_BLOCK // 2
    return out_features * (codes + groups * SCALE_BYTES)


def tensor_bytes(name: str, shape, dtype_bytes: int, scheme: str | None) -> int:
    """A checkpoint tensor's bytes in memory: a decoder linear's 2-D weight quantized with `scheme`, anything
    else (1-D norms and biases, 3-D conv weights, routers, embeddings) in the model dtype."""
    numel = 1
    for d in shape:
        numel *= d
    module = name.removesuffix(".weight")
    if scheme is not None and len(shape) == 2 and name.endswith(".weight") and quantizes(module):
        return linear_bytes(shape[0], shape[1], scheme)
    return numel * dtype_bytes


def model_weight_bytes(config, schemes=FORMATS) -> dict[str | None, int]:
    """Bytes of the engine's model for this EngineConfig with each of `schemes` (None, int8, int4), from one
    model built on the meta device; tied weights count once."""
    from runtime.dtypes import DTYPES
    from runtime.loader import default_dtype

    module_name, _, class_name = config.declaration.implementation.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    with default_dtype(DTYPES[config.model_dtype]), torch.device("meta"):
        model = cls(config.dims)
    model.tie_weights()
    return {scheme: _bytes(model, scheme) for scheme in schemes}


def _bytes(model: nn.Module, scheme: str | None) -> int:
    seen: set[int] = set()
    total = 0
    if scheme is not None:
        for name, module in model.named_modules():
            if type(module) in QUANTIZED and quantizes(name):
                total += _quantized_module_bytes(module, scheme)
                seen.update(id(t) for t in [*module.parameters(), *module.buffers()])
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _quantized_module_bytes(module: nn.Module, scheme: str) -> int:
    if isinstance(module, StackedLinear):
        experts, out_features, in_features = module.weight.shape
        return experts * linear_bytes(out_features, in_features, scheme)
    bias = module.bias.numel() * SCALE_BYTES if module.bias is not None else 0
    return linear_bytes(module.out_features, module.in_features, scheme) + bias
