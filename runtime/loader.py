"""Loading an HF checkpoint directory (config.json + *.safetensors, sharded or not) into our modules."""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from runtime.config import EngineConfig
from runtime.models.causal_lm import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists {', '.join(missing)}, which is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in model_dir.glob("*.bin"))) or "nothing"
        raise CheckpointError(
            f"no *.safetensors weights in {model_dir} (found {found}); Tandem loads safetensors only: "
            "re-save the model with transformers' save_pretrained()"
        )
    return files


def hf_config(config: EngineConfig) -> PretrainedConfig:
    """transformers' own config object: its defaults and legacy-key handling build the modules."""
    return AutoConfig.from_pretrained(config.model_dir)


def module_config(config: EngineConfig):
    """What the torch module is built from: the declaration's frozen dims where it reads them from
    config.json itself (`dims`), else transformers' config object."""
    dims = getattr(config.declaration, "dims", None)
    return dims(config.hf_config) if dims is not None else hf_config(config)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: EngineConfig, device: torch.device) -> CausalLM:
    module_name, _, class_name = config.declaration.implementation.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    with default_dtype(DTYPES[config.model_dtype]), device:
        model = cls(module_config(config))
    model.tie_weights()
    load_weights(model, checkpoint_files(config.model_dir))
    return model.eval()


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_weights(model: CausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_name(name)
                if target is None:
                    continue
                if target not in params:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                param = params[target]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{name}: the checkpoint has shape {tuple(tensor.shape)} but the model expects "
                        f"{tuple(param.shape)}; does config.json match the weights?"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(target)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {_names(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {_names(missing)}")
