"""A quantized checkpoint's tensors for one linear -> the runtime's formats (runtime/kernels/quant_linear.py),
converted once at load: FP8 weights stay float8_e4m3fn (N, K) with float32 scales per row and group (a block
scale repeats over its block's rows); packed int4 weights are unpacked by compressed-tensors' own helper and
repacked as pack_int4 lays them out, a zero point z becoming the offset -z * scale (compressed-tensors stores
q and z signed, w = (q - z) * scale); packed int8 weights become int8 (N, K)."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels.quant_linear import INT4_BLOCK, pack_int4
from runtime.quant.config import SUPPORTED, WeightFormat

# Tensors a quantized linear's checkpoint entry may hold beside the weight; input_scale (static FP8 activation
# scales) and the GPTQ g_idx of an unordered export are not needed on the CPU.
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_packed", "weight_zero_point", "weight_shape",
                  "weight_g_idx", "input_scale")
SKIPPED = ("input_scale", "weight_g_idx")


class QuantTensorError(ValueError):
    """A quantized tensor that does not fit its format or its layer; the message names it."""


def split_name(name: str) -> tuple[str, str]:
    """'a.b.weight_scale' -> ('a.b', 'weight_scale')."""
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def convert(name: str, fmt: WeightFormat, tensors: dict[str, Tensor], out_features: int, in_features: int
            ) -> tuple[Tensor, Tensor, int, Tensor | None]:
    """(qweight, scales, group_size, offsets) for the linear `name` (checkpoint spelling) of shape
    (out_features, in_features) from its checkpoint tensors (suffix -> tensor)."""
    if fmt.kind == "fp8":
        return _fp8(name, fmt, tensors, out_features, in_features)
    return _packed(name, fmt, tensors, out_features, in_features)


def _need(name: str, tensors: dict[str, Tensor], suffix: str) -> Tensor:
    if suffix not in tensors:
        raise QuantTensorError(f"{name}.{suffix} is missing from the checkpoint; its quantization_config "
                               f"({SUPPORTED}) needs it")
    return tensors[suffix]


def _check_shape(tensor_name: str, got: tuple[int, ...], expected: tuple[int, ...], why: str) -> None:
    if tuple(got) != tuple(expected):
        raise QuantTensorError(f"{tensor_name}: the checkpoint has shape {tuple(got)} but {why} needs "
                               f"{tuple(expected)}; does config.json (and its quantization_config) match the weights?")


def _group_size(name: str, fmt: WeightFormat, k: int, packed: bool) -> int:
    if fmt.strategy in ("tensor", "channel"):
        return k
    size = fmt.block[1] if fmt.strategy == "block" else fmt.group_size
    # A block's last column block may be partial (DeepSeek's format allows it); groups must divide K.
    if fmt.strategy == "group" and k % size:
        raise QuantTensorError(f"{name}: group_size {size} does not divide its {k} inputs; supported: group sizes "
                               f"that divide the layer's input size")
    if packed and size % INT4_BLOCK:
        raise QuantTensorError(f"{name}: group_size {size} is not a multiple of {INT4_BLOCK}; supported: int4 groups "
                               f"of a multiple of {INT4_BLOCK} inputs")
    return size


def _fp8(name: str, fmt: WeightFormat, tensors: dict[str, Tensor], n: int, k: int):
    weight = _need(name, tensors, "weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantTensorError(f"{name}.weight is {weight.dtype}, not float8_e4m3fn as its quantization_config says; "
                               f"supported: {SUPPORTED}")
    _check_shape(f"{name}.weight", weight.shape, (n, k), "the model's layer")
    scale = _need(name, tensors, fmt.scale_name).float()
    scale_name = f"{name}.{fmt.scale_name}"
    group_size = _group_size(name, fmt, k, packed=False)
    groups = -(-k // group_size)
    if fmt.strategy == "tensor":
        _check_shape(scale_name, (scale.numel(),), (1,), "one scale per tensor")
        scales = scale.reshape(1, 1).expand(n, 1)
    elif fmt.strategy == "block":
        rows = -(-n // fmt.block[0])
        _check_shape(scale_name, scale.shape, (rows, groups), f"{fmt.block[0]}x{fmt.block[1]} blocks")
        scales = scale.repeat_interleave(fmt.block[0], dim=0)[:n]
    else:
        _check_shape(scale_name, scale.shape, (n, groups), f"one scale per output and {group_size} inputs")
        scales = scale
    return weight.contiguous(), scales.contiguous(), group_size, None


def _packed(name: str, fmt: WeightFormat, tensors: dict[str, Tensor], n: int, k: int):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    packed = _need(name, tensors, "weight_packed")
    shape = tuple(int(v) for v in _need(name, tensors, "weight_shape").flatten().tolist())
    _check_shape(f"{name}.weight_shape", shape, (n, k), "the model's layer")
    per_word = 32 // fmt.num_bits
    if packed.dtype != torch.int32:
        raise QuantTensorError(f"{name}.weight_packed is {packed.dtype}, not int32; supported: {SUPPORTED}")
    _check_shape(f"{name}.weight_packed", packed.shape, (n, -(-k // per_word)), f"int{fmt.num_bits} values of "
                 f"weight_shape {shape} packed {per_word} to an int32")
    group_size = _group_size(name, fmt, k, packed=fmt.num_bits == 4)
    groups = k // group_size
    scales = _need(name, tensors, "weight_scale").float()
    _check_shape(f"{name}.weight_scale", scales.shape, (n, groups), f"one scale per output and {group_size} inputs")
    q = unpack_from_int32(packed, fmt.num_bits, torch.Size((n, k)))
    offsets = None
    if not fmt.symmetric:
        zp_packed = _need(name, tensors, "weight_zero_point")
        _check_shape(f"{name}.weight_zero_point", zp_packed.shape, (-(-n // per_word), groups),
                     f"int{fmt.num_bits} zero points of ({n}, {groups}) packed {per_word} to an int32 along outputs")
        # Unpacked along K on a fresh (groups, words) copy: compressed-tensors' packed_dim=0 path fails on one
        # row of words (a (1, G) tensor's transpose keeps a stride it cannot view as bytes).
        along_k = torch.empty(groups, zp_packed.shape[0], dtype=torch.int32)
        along_k.copy_(zp_packed.t())
        zero = unpack_from_int32(along_k, fmt.num_bits, torch.Size((groups, n))).t()
        offsets = -zero.float() * scales
    qweight = pack_int4(q) if fmt.num_bits == 4 else q.contiguous()
    return qweight, scales.contiguous(), group_size, offsets
