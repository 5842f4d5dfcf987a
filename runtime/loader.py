"""Loading a checkpoint directory into our modules.

Weights come as save_pretrained writes them (*.safetensors, sharded or not) or as mamba_ssm and older
transformers releases wrote them (pytorch_model.bin, sharded or not). Tensors HF and vLLM ignore on
load (rotary `inv_freq` buffers) are skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from runtime.config import EngineConfig
from runtime.dtypes import DTYPES
from runtime.models.causal_lm import CausalLM

# Buffers that older checkpoints saved and that HF and vLLM skip on load: we compute them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Any one of these makes a directory loadable by AutoTokenizer (fast, sentencepiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors."""


def check_tokenizer_files(model_dir: Path) -> None:
    """Name the missing files before transformers' own (misleading "sentencepiece or tiktoken") message."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer in {model_dir}: it needs one of {', '.join(TOKENIZER_FILES)} (with tokenizer_config.json); "
            "copy the tokenizer files of the original checkpoint into the directory"
        )


def load_tokenizer(config: EngineConfig) -> Any:
    """transformers' tokenizer for the directory; its files are checked first, so a missing one is named."""
    check_tokenizer_files(config.model_dir)
    # AutoTokenizer would read config.json again, only for these fields, and refuse the spellings we
    # translate (mamba_ssm's, pre-4.48 Zamba2's): hand it our reading instead.
    hint = SimpleNamespace(model_type=config.hf_config.first("model_type"), _name_or_path=str(config.model_dir),
                           tokenizer_class=config.hf_config.first("tokenizer_class"))
    return AutoTokenizer.from_pretrained(config.model_dir, config=hint)


def _indexed(model_dir: Path, index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text())["weight_map"]
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index.name} lists {', '.join(missing)}, which is missing from {model_dir}")
    return files


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files, safetensors first (as transformers prefers them), else pytorch_model*.bin."""
    for index, pattern in (("model.safetensors.index.json", "*.safetensors"),
                           ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        if (model_dir / index).is_file():
            return _indexed(model_dir, model_dir / index)
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise CheckpointError(
        f"no weights in {model_dir}: expected *.safetensors (or pytorch_model.bin); "
        "download the checkpoint's weight files into the directory"
    )


def read_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, load) for each tensor of one file; safetensors reads a tensor only when asked."""
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, lambda name=name: f.get_tensor(name)
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for name, tensor in state.items():
        yield name, lambda tensor=tensor: tensor


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
        model = cls(config.dims)
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
        for name, load in read_tensors(path):
            target = None if name.endswith(IGNORED_SUFFIXES) else model.checkpoint_name(name)
            if target is None:
                continue
            if target not in params:
                unexpected.append(name)
                continue
            tensor, param = load(), params[target]
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
