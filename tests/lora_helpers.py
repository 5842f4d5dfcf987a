"""Tiny checkpoints of every engine architecture and random PEFT adapters for them, made with `peft` itself.

PEFT initialises lora_B to zeros (an adapter that changes nothing); these draw A and B at random, so that an
adapter applied to the wrong linear, scaled wrongly or not at all changes the tokens.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_models import CONFIGS, DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model, build_model


def build_checkpoint(name: str, directory: Path, tokenizer_dir: Path, **overrides):
    """The HF model of `name`, saved (with the tokenizer) into `directory`."""
    if name in CONFIGS:
        return build_model(name, directory, tokenizer_dir, **overrides)
    if name in FAMILY_CONFIGS:
        return build_family_model(name, directory, tokenizer_dir, **overrides)
    assert name in DELTANET_CONFIGS, name
    return build_deltanet_model(name, directory, tokenizer_dir, **overrides)


# PEFT refuses these on the Mamba model types it lists (HF's fused Mamba kernels read out_proj's weight).
# dt_proj: transformers' Mamba-1 mixers read its weight directly (PEFT's adapter is a no-op there; we refuse it).
PEFT_MAMBA_REFUSED = ("out_proj", "dt_proj")
PEFT_MAMBA_TYPES = ("mamba", "mamba2", "falcon_h1", "nemotron_h", "falcon_mamba", "jamba")


# The tiny Zamba2 applies shared block 0 at layers 1 and 4: HF holds a copy per layer, and PEFT gives each copy
# its own adapter, which one shared module cannot hold (the engine refuses that, tests/lora/test_lora_errors.py).
# Block 1 is applied at layer 3 alone.
ZAMBA2_SHARED_TWICE = ("model.layers.1.shared_transformer.", "model.layers.4.shared_transformer.")


# On these model types PEFT turns targets named like MLP projections into fused-expert parameter targets
# (transformers' MoE weight conversion), which it cannot combine with lora_bias and the engine refuses.
PEFT_MOE_RENAMED = ("gate", "gate_proj", "up_proj", "down_proj")
PEFT_MOE_TYPES = ("qwen3_next",)


def linear_names(hf) -> list[str]:
    """Every nn.Linear an adapter may target (not the LM head, not experts; not out_proj where PEFT refuses it)."""
    model_type = hf.config.model_type
    refused = PEFT_MAMBA_REFUSED if model_type in PEFT_MAMBA_TYPES else ()
    refused += PEFT_MOE_RENAMED if model_type in PEFT_MOE_TYPES else ()
    return [name for name, module in hf.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and ".experts." not in name
            and name.rsplit(".", 1)[-1] not in refused and not name.startswith(ZAMBA2_SHARED_TWICE)]


def targets(names: list[str]) -> str:
    """PEFT's target_modules as one regex of exact module names (a bare suffix such as "0" matches too much)."""
    return "(" + "|".join(re.escape(name) for name in names) + ")"


def make_adapter(hf, directory: Path, seed: int, **options):
    """A PEFT LoRA adapter of `hf` with random A and B, saved into `directory`; returns the PEFT model (eval)."""
    config = LoraConfig(init_lora_weights=False, target_parameters=[], **options)
    model = get_peft_model(copy.deepcopy(hf), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # lora_A, lora_B (and its bias), and the base biases PEFT's `bias` option trains.
            if "lora_" in name or (param.requires_grad and name.endswith(".bias")):
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return model.eval()
