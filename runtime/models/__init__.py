"""The model registry: HF `architectures` names to declaration classes, imported lazily.

The runtime and the docs generator share this one list, so the docs cannot name a
model the runtime does not know. Declarations import no torch.
"""

from __future__ import annotations

import functools
import importlib

from runtime.hf_config import ConfigError
from runtime.models.interface import ModelDeclaration, validate_declaration

REGISTRY: dict[str, str] = {
    "BambaForCausalLM": "runtime.models.bamba.declaration",
    "FalconH1ForCausalLM": "runtime.models.falcon_h1.declaration",
    "FalconMambaForCausalLM": "runtime.models.falcon_mamba.declaration",
    "GraniteForCausalLM": "runtime.models.granite.declaration",
    "GraniteMoeHybridForCausalLM": "runtime.models.granitemoehybrid.declaration",
    "JambaForCausalLM": "runtime.models.jamba.declaration",
    "KimiLinearForCausalLM": "runtime.models.kimi_linear.declaration",
    "Lfm2ForCausalLM": "runtime.models.lfm2.declaration",
    "Lfm2MoeForCausalLM": "runtime.models.lfm2_moe.declaration",
    "LlamaForCausalLM": "runtime.models.llama.declaration",
    "Mamba2ForCausalLM": "runtime.models.mamba2.declaration",
    "MambaForCausalLM": "runtime.models.mamba.declaration",
    "MiniMaxForCausalLM": "runtime.models.minimax.declaration",
    "NemotronHForCausalLM": "runtime.models.nemotron_h.declaration",
    "OlmoHybridForCausalLM": "runtime.models.olmo_hybrid.declaration",
    "Qwen3NextForCausalLM": "runtime.models.qwen3_next.declaration",
    "Qwen3_5ForCausalLM": "runtime.models.qwen3_5.declaration",
    "Qwen3_5MoeForCausalLM": "runtime.models.qwen3_5_moe.declaration",
    "Zamba2ForCausalLM": "runtime.models.zamba2.declaration",
}


class UnknownArchitecture(ConfigError):
    pass


@functools.cache
def resolve(architecture: str) -> type[ModelDeclaration]:
    """The validated declaration class for an HF architecture name."""
    if architecture not in REGISTRY:
        raise UnknownArchitecture(
            f"unknown architecture {architecture!r}; supported architectures: {', '.join(sorted(REGISTRY))}"
        )
    cls = getattr(importlib.import_module(REGISTRY[architecture]), architecture)
    assert cls.architecture == architecture, f"{cls.__name__} registered as {architecture}"
    validate_declaration(cls)
    return cls


def all_declarations() -> list[type[ModelDeclaration]]:
    return [resolve(architecture) for architecture in sorted(REGISTRY)]
