"""What `tandem plan --enable-lora` prints: the memory the LoRA slots take, per rank.

The model is built on the meta device (shapes, no memory; torch is imported only for this), sharded like a
rank's, and wrapped as the engine wraps it, so the figure counts the same linears and sizes the engine allocates.
"""

from __future__ import annotations

import importlib
from typing import Any


def lora_report(config: Any) -> dict[str, Any]:
    import torch

    from runtime.distributed.sharding import shard_model
    from runtime.dtypes import DTYPES
    from runtime.loader import default_dtype
    from runtime.lora.layer import wrap_linears

    module_name, _, class_name = config.declaration.implementation.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    with default_dtype(DTYPES[config.model_dtype]), torch.device("meta"):
        model = cls(config.dims)
        if config.tensor_parallel_size > 1:
            model.weight_shards = shard_model(model, 0, config.tensor_parallel_size)
        layers = wrap_linears(model, config.max_loras, config.max_lora_rank, DTYPES[config.model_dtype])
    per_slot = sum(layer.slot_bytes() for layer in layers.values())
    slots = config.max_loras + 1  # and the zero slot the base model's rows read
    return {"max_loras": config.max_loras, "max_lora_rank": config.max_lora_rank, "num_linears": len(layers),
            "bytes_per_slot": per_slot, "slots": slots, "total_bytes": per_slot * slots}
