"""Checkpoints published quantized (`quantization_config` in config.json): the format read once at config time
(config.py) and the loader's conversion of their tensors to the runtime's quantized linears (convert.py)."""

from runtime.quant.config import CHECKPOINT_FORMATS, CheckpointQuant, WeightFormat, read_quantization

__all__ = ["CHECKPOINT_FORMATS", "CheckpointQuant", "WeightFormat", "read_quantization"]
