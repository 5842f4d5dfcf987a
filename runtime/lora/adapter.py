"""Reading a PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`) onto our linears.

Our modules keep HF's names and each HF linear is one of ours of the same shape (the loader checks it), so
an adapter's module maps onto ours through the model's `checkpoint_name`. Everything is checked before the
adapter is kept: a bad adapter raises a ValueError naming the adapter and the module, and nothing of it is
loaded. B is multiplied by PEFT's scale here (lora_alpha / r, or / sqrt(r) with rsLoRA), so the kernels add
x @ A.T @ B.T and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runtime.lora.request import LoRARequest

PEFT_PREFIX = "base_model.model."
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Config keys whose non-default value changes the adapter's function in a way the engine does not reproduce.
REFUSED = {"use_dora": "DoRA (use_dora)", "target_parameters": "parameter targets (target_parameters, e.g. "
           "fused expert weights)", "layer_replication": "layer_replication", "modules_to_save": "modules_to_save "
           "(fully trained copies of modules)", "trainable_token_indices": "trainable_token_indices",
           "use_qalora": "QALoRA (use_qalora)"}


@dataclass
class ModuleWeights:
    """One linear's adapter, full size (unsharded), float32: y += x @ a.T @ b.T + bias."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r), scale included
    bias: torch.Tensor | None  # (out,): lora_B's bias (scaled) plus a replaced base bias's change
    replaced_bias: torch.Tensor | None  # (out,): PEFT's `bias` option's trained bias, less ours at loading


@dataclass
class Adapter:
    request: LoRARequest
    rank: int
    modules: dict[str, ModuleWeights]  # our module name -> weights

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def _fail(request: LoRARequest, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {what}")


def read_config(request: LoRARequest) -> dict[str, Any]:
    directory = Path(request.lora_path).expanduser()
    if not directory.is_dir():
        raise _fail(request, "no such directory; give the directory PEFT's save_pretrained wrote")
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise _fail(request, "no adapter_config.json in the directory; give the directory PEFT's save_pretrained "
                             "wrote")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _fail(request, f"adapter_config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise _fail(request, f"peft_type {kind!r} is not supported; only LORA adapters are")
    for key, what in REFUSED.items():
        if config.get(key):
            raise _fail(request, f"{what} is not supported")
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise _fail(request, f"lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    return config


def read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    directory = Path(request.lora_path).expanduser()
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    return load_file(path)
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # a truncated or foreign file: the adapter's fault, not the engine's
                raise _fail(request, f"{name} cannot be read ({type(err).__name__}: {err})") from None
    raise _fail(request, "no adapter_model.safetensors in the directory")


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def group_tensors(request: LoRARequest, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{HF module name: {"lora_A.weight": ..., "lora_B.weight": ..., "lora_B.bias"?: ..., "bias"?: ...}}."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        name = re.sub(r"\.(lora_[AB])\.[^.]+\.(weight|bias)$", r".\1.\2", name)  # unnamed-adapter saves
        match = re.fullmatch(r"(.+?)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|bias)", name)
        if match is None:
            what = "DoRA (lora_magnitude_vector)" if "lora_magnitude_vector" in name else (
                "LoRA on embeddings" if "lora_embedding" in name else "this tensor")
            raise _fail(request, f"{key}: {what} is not supported")
        module = match.group(1).removesuffix(".base_layer")
        modules.setdefault(module, {})[match.group(2)] = tensor.float()
    return modules


def read_adapter(request: LoRARequest, checkpoint_name: Any, layers: dict[str, Any], max_rank: int,
                 elsewhere: frozenset[str] = frozenset()) -> Adapter:
    """The adapter at request.lora_path, checked against `layers` (our module name -> LoRALinear). `elsewhere`:
    the linears other pipeline stages hold, whose part of the adapter those stages read and check."""
    config = read_config(request)
    modules: dict[str, ModuleWeights] = {}
    sources: dict[str, str] = {}  # our module name -> the adapter's module name it came from
    rank, skipped = 0, False
    for module, parts in group_tensors(request, read_tensors(request)).items():
        ours = _our_module(request, checkpoint_name, layers, module, elsewhere)
        if ours is None:
            skipped = True
            continue
        layer = layers[ours]
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            if set(parts) == {"bias"}:
                raise _fail(request, f"{module}: a trained bias on a module without LoRA weights is not supported")
            raise _fail(request, f"{module}: lora_A or lora_B is missing")
        a, b = parts["lora_A.weight"], parts["lora_B.weight"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise _fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a LoRA pair")
        if r > max_rank:
            raise _fail(request, f"{module}: rank {r} is more than max_lora_rank={max_rank}; raise max_lora_rank "
                                 f"(--max-lora-rank) to {r} or more")
        if (a.shape[1], b.shape[0]) != (layer.full_in, layer.full_out):
            raise _fail(request, f"{module}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit this model's "
                                 f"({layer.full_in} in, {layer.full_out} out); was it trained for another base model?")
        alpha = pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        bias = parts["lora_B.bias"] * scale if "lora_B.bias" in parts else None
        replaced = parts.get("bias")
        if replaced is not None and replaced.shape != (layer.full_out,):
            raise _fail(request, f"{module}: bias shape {tuple(replaced.shape)} does not fit ({layer.full_out},)")
        weights = ModuleWeights(a.contiguous(), (b * scale).contiguous(), bias, replaced)
        if ours in modules and not _same(modules[ours], weights):
            raise _fail(request, f"{sources[ours]} and {module} are one shared module in this engine (applied "
                                 "at several layers, e.g. Zamba2's shared transformer) but have different adapter "
                                 "weights; adapters that differ per application of a shared module are not supported")
        modules[ours], sources[ours] = weights, module
        rank = max(rank, r)
    if not modules and not skipped:
        raise _fail(request, "adapter_model.safetensors holds no LoRA weights")
    return Adapter(request, rank, modules)


def _same(x: ModuleWeights, y: ModuleWeights) -> bool:
    def equal(p: torch.Tensor | None, q: torch.Tensor | None) -> bool:
        return (p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))

    return all(equal(getattr(x, f), getattr(y, f)) for f in ("a", "b", "bias", "replaced_bias"))


def _our_module(request: LoRARequest, checkpoint_name: Any, layers: dict[str, Any], module: str,
                elsewhere: frozenset[str]) -> str | None:
    target = checkpoint_name(module + ".weight")
    ours = target.removesuffix(".weight") if target else None
    if ours in elsewhere:
        return None
    if ours not in layers:
        hint = ("expert projections are not supported" if ".experts." in module
                else "transformers' Mamba-1 mixers read dt_proj's weight directly, so PEFT's adapter on it has no "
                     "effect there; it is not supported" if module.endswith("mamba.dt_proj") or
                module.endswith("mixer.dt_proj")
                else "this model has no linear the engine can adapt by that name")
        raise _fail(request, f"target module {module}: {hint}")
    return ours
