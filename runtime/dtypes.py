"""The torch dtype of each dtype name the configs use (runtime.hf_config.DTYPE_SIZES spells the same names)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
