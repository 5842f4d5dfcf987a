"""GGUF tensor blocks -> the quantized formats the runtime runs (runtime/kernels/quant_linear.py's docstring).

GGUFReader hands a quantized tensor over as its raw blocks (uint8 (rows, bytes)); each block type's layout is
the one gguf.quants decodes, and the mapping keeps the values quantized:
- Q8_0 (32 values: f16 d, 32 x int8): int8, groups of 32, scale = d;
- Q4_0 (32 values: f16 d, 16 bytes of nibbles, value j low, j + 16 high): int4 q = nibble - 8, scale = d;
- Q4_K (256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles): int4 groups of
  32, q = nibble - 8, scale = d * sc, offset = 8 * scale - dmin * m (w = d * sc * nibble - dmin * m);
- Q6_K (256 values: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d): int8 values in
  [-32, 31], groups of 16, scale = d * scale_j.
The float types (F32, F16, BF16) load as floats; tests/engine/test_gguf.py checks every mapping against
gguf.quants.dequantize on random blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import Q4_K

from runtime.kernels.quant_linear import pack_int4

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
QUANT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
SUPPORTED = FLOAT_TYPES + QUANT_TYPES


@dataclass
class Quantized:
    """A (rows, in_features) weight in quant_linear's format; `kind` is the GGUF type's name."""
    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int
    in_features: int
    offsets: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.qweight.shape[0]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _blocks(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, int]:
    """(blocks (rows * blocks_per_row, bytes), rows) of a (rows, bytes) raw tensor."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(-1, type_size), rows


def _q8_0(raw):
    blocks, rows = _blocks(raw, T.Q8_0)
    q = blocks[:, 2:].view(np.int8)
    return q.reshape(rows, -1), _f16(blocks, 0).reshape(rows, -1), None, 32


def _q4_0(raw):
    blocks, rows = _blocks(raw, T.Q4_0)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8
    return q.reshape(rows, -1), _f16(blocks, 0).reshape(rows, -1), None, 32


def _q4_k(raw):
    blocks, rows = _blocks(raw, T.Q4_K)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # (blocks, 8), as gguf.quants computes it
    offset = 8 * scale - dmin * m.astype(np.float32)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).astype(np.int8) - 8
    return q.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1), 32


def _q6_k(raw):
    blocks, rows = _blocks(raw, T.Q6_K)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks, 208)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
    return q.reshape(rows, -1), (d * scales).reshape(rows, -1), None, 16


DECODERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k}


def decode(raw: np.ndarray, qtype: T) -> Quantized:
    """The quant_linear form of a quantized 2-D GGUF tensor's raw blocks (uint8 (rows, bytes))."""
    q, scales, offsets, group_size = DECODERS[qtype](raw)
    q = torch.from_numpy(np.ascontiguousarray(q))
    in_features = q.shape[1]
    qweight = pack_int4(q) if qtype in (T.Q4_0, T.Q4_K) else q.contiguous()
    return Quantized(qtype.name, qweight, torch.from_numpy(np.ascontiguousarray(scales)), group_size, in_features,
                     None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets)))


def take_rows(weight: Quantized, index: torch.Tensor) -> Quantized:
    """The rows `index` of a quantized weight (quantization groups run along a row, so rows move whole)."""
    return Quantized(weight.kind, weight.qweight[index], weight.scales[index], weight.group_size, weight.in_features,
                     None if weight.offsets is None else weight.offsets[index])


def concat_rows(parts: list[Quantized]) -> Quantized | None:
    """The parts stacked row-wise, or None where their formats differ (the caller dequantizes instead)."""
    first = parts[0]
    if any((p.kind, p.group_size, p.in_features, p.offsets is None) != (first.kind, first.group_size,
           first.in_features, first.offsets is None) for p in parts):
        return None
    return Quantized(first.kind, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                     first.group_size, first.in_features,
                     None if first.offsets is None else torch.cat([p.offsets for p in parts]))
