"""`quantization_config` from config.json, resolved once into a frozen CheckpointQuant.

Supported: `"quant_method": "fp8"` (FP8 e4m3 weights with 128 x 128 block scales, `weight_scale_inv`, as DeepSeek's
and Qwen3-Next's FP8 releases write them, or one `weight_scale` per tensor) and `"compressed-tensors"` (parsed by
the compressed-tensors package: `float-quantized` FP8 weights with per-tensor, per-channel or block scales, and
`pack-quantized` int4/int8 weights, symmetric or with a zero point, per channel or grouped). Activations stay in
the model dtype on the CPU: a scheme's dynamic FP8 activation quantization is a GPU speed-up, not a different
model, so it is accepted and not applied; integer or static activations (W8A8) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.hf_config import ConfigError

if TYPE_CHECKING:  # config time imports no torch (the docs check runs without it)
    from torch import nn

# The format names a declaration lists (runtime/models/interface.py) and `quantization=` accepts.
CHECKPOINT_FORMATS = ("fp8", "compressed-tensors")
SUPPORTED = ("quant_method fp8 (FP8 e4m3 weights, block-wise weight_scale_inv or per-tensor weight_scale) and "
             "compressed-tensors (float-quantized FP8 weights; pack-quantized int4/int8 weights, W4A16/W8A16)")
CT_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightFormat:
    """How one linear's weight is stored. kind: "fp8" (float8_e4m3fn `weight` + scale) or "packed" (int32
    `weight_packed` of `num_bits` values); strategy: tensor, channel, group or block; group_size along K for
    group; block (rows, cols) for block; symmetric False adds a `weight_zero_point`; scale_name names the scale."""
    kind: str
    strategy: str
    num_bits: int = 8
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    scale_name: str = "weight_scale"

    def describe(self) -> str:
        what = "FP8 e4m3" if self.kind == "fp8" else f"int{self.num_bits}"
        how = {"tensor": "one scale per tensor", "channel": "one scale per output channel",
               "group": f"one scale per {self.group_size} inputs",
               "block": f"one scale per {self.block and 'x'.join(map(str, self.block))} block"}[self.strategy]
        return f"{what}, {how}" + ("" if self.symmetric else ", zero points")


@dataclass(frozen=True)
class CheckpointQuant:
    """The checkpoint's quantization. method: "fp8" or "compressed-tensors"; for fp8 one WeightFormat for every
    linear the file quantizes (it decides which, by holding a scale); for compressed-tensors the parsed
    QuantizationConfig, whose targets/ignore pick each linear's scheme."""
    method: str
    fp8: WeightFormat | None = None
    ct: Any = None  # compressed_tensors.QuantizationConfig
    ct_formats: tuple[tuple[str, WeightFormat], ...] = ()  # (config group name, its weight format)

    def describe(self) -> str:
        """One line, as `tandem plan` prints it."""
        if self.fp8 is not None:
            return f"fp8 checkpoint: {self.fp8.describe()}; activations in the model dtype"
        groups = "; ".join(f"{name}: {fmt.describe()}" for name, fmt in self.ct_formats)
        return f"compressed-tensors {self.ct.format} checkpoint: {groups}; activations in the model dtype"

    def format_for(self, name: str, module: "nn.Module") -> WeightFormat | None:
        """The format config.json gives the linear at this module path (compressed-tensors' matching of its
        targets and ignore list), or None where it leaves it unquantized; fp8 leaves it to the file."""
        if self.ct is None:
            return None
        from compressed_tensors.utils.match import is_match
        for group, fmt in self.ct_formats:
            scheme = self.ct.config_groups[group]
            if is_match(name, module, scheme.targets, self.ct.ignore or ()):
                return fmt
        return None


def read_quantization(raw: dict[str, Any]) -> CheckpointQuant | None:
    """config.json's `quantization_config` (None where it has none); an unsupported one is a ConfigError."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config in config.json must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return CheckpointQuant("fp8", fp8=_fp8_format(qc))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ConfigError(f"quantization_config: quant_method {method!r} is not supported; supported: {SUPPORTED}")


def _fp8_format(qc: dict[str, Any]) -> WeightFormat:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config: fp8 fmt {qc['fmt']!r} is not supported; supported: e4m3")
    block = qc.get("weight_block_size")
    if block is None:
        return WeightFormat("fp8", "tensor")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config: weight_block_size must be two positive integers, got {block!r}")
    return WeightFormat("fp8", "block", block=(block[0], block[1]), scale_name="weight_scale_inv")


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    from compressed_tensors.quantization import QuantizationConfig
    try:
        config = QuantizationConfig.model_validate(qc)
    except ValueError as err:  # pydantic's ValidationError
        first = str(err).splitlines()
        raise ConfigError(f"quantization_config is not a valid compressed-tensors config: {' '.join(first[:3])}") \
            from None
    formats = []
    for name, scheme in config.config_groups.items():
        fmt = scheme.format or config.format
        if fmt not in CT_FORMATS:
            raise ConfigError(f"quantization_config: compressed-tensors format {fmt!r} (config group {name!r}) is "
                              f"not supported; supported: {SUPPORTED}")
        formats.append((name, _ct_weight_format(name, scheme, fmt)))
    if config.kv_cache_scheme is not None:
        raise ConfigError(f"quantization_config: a quantized KV cache (kv_cache_scheme) is not supported; "
                          f"supported: {SUPPORTED}")
    return CheckpointQuant("compressed-tensors", ct=config, ct_formats=tuple(formats))


def _ct_weight_format(group: str, scheme: Any, fmt: str) -> WeightFormat:
    w, acts = scheme.weights, scheme.input_activations
    where = f"quantization_config: config group {group!r}"
    if w is None:
        raise ConfigError(f"{where} quantizes no weights; supported: {SUPPORTED}")
    if acts is not None and not (acts.type == "float" and acts.dynamic in (True, "true")):
        raise ConfigError(f"{where} quantizes activations ({acts.type}{acts.num_bits}, "
                          f"{'dynamic' if acts.dynamic else 'static'}), which is not supported; supported: "
                          f"{SUPPORTED}, with activations unquantized or dynamic FP8")
    if scheme.output_activations is not None:
        raise ConfigError(f"{where} quantizes output activations, which is not supported; supported: {SUPPORTED}")
    strategy = w.strategy or ("group" if w.group_size else "tensor")
    if w.type == "float" and w.num_bits == 8 and fmt in ("float-quantized", "naive-quantized") \
            and strategy in ("tensor", "channel", "block", "group") and w.symmetric:
        block = tuple(w.block_structure) if strategy == "block" else None
        return WeightFormat("fp8", strategy, group_size=w.group_size, block=block)
    if w.type == "int" and w.num_bits in (4, 8) and fmt == "pack-quantized" and strategy in ("channel", "group") \
            and not w.actorder:
        return WeightFormat("packed", strategy, num_bits=w.num_bits, group_size=w.group_size, symmetric=w.symmetric)
    raise ConfigError(f"{where}: {w.type}{w.num_bits} weights by {strategy} in {fmt} format"
                      f"{' with activation ordering' if w.actorder else ''} are not supported; supported: {SUPPORTED}")
