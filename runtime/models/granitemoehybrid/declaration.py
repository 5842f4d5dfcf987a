from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.bamba.declaration import (
    MAMBA2_HYBRID_DEFAULTS,
    BambaForCausalLM,
    Mamba2HybridDims,
    mamba2_hybrid_fields,
)
from runtime.models.common import LORA_NO_EXPERTS, ON_ENGINE, capabilities
from runtime.models.dims import read_dims
from runtime.models.interface import LayerKind, supported

# Both spellings occur in published configs: transformers 4.x wrote "mamba"/"attention".
LAYER_TYPES = {
    "mamba": LayerKind.MAMBA2,
    "linear_attention": LayerKind.MAMBA2,
    "attention": LayerKind.ATTENTION,
    "full_attention": LayerKind.ATTENTION,
}


def layers_from_types(cfg: HFConfig, key: str, names: dict[str, LayerKind]) -> tuple[LayerKind, ...]:
    types = cfg[key]
    if not isinstance(types, list) or len(types) != cfg.positive_int("num_hidden_layers"):
        raise ConfigError(
            f"{cfg.architecture}: {key} must list one type per layer "
            f"({cfg.num_hidden_layers} layers), got {types!r:.80}"
        )
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise ConfigError(f"{cfg.architecture}: {key} has unknown layer types {unknown}; expected {sorted(names)}")
    return tuple(names[t] for t in types)


@dataclass(frozen=True)
class GraniteMoeHybridDims(Mamba2HybridDims):
    """GraniteMoeHybridConfig's defaults where they differ from Bamba's, then its own keys."""

    vocab_size: int = 32000
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-6
    attention_multiplier: float | None = 1.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    layers_block_type: tuple[str, ...] = ()  # derived from the layout


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Granite 4.0-H: Bamba's Mamba-2 and attention layers, MoE feed-forward and Granite multipliers."""

    architecture = "GraniteMoeHybridForCausalLM"
    model_name = "Granite 4.0-H"
    example_models = ("ibm-granite/granite-4.0-h-tiny", "ibm-granite/granite-4.0-h-small")
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_NO_EXPERTS)
    implementation = "runtime.models.granitemoehybrid.model:GraniteMoeHybridForCausalLM"
    quantizations = ("int8", "int4", "compressed-tensors", "gguf")
    defaults = {**MAMBA2_HYBRID_DEFAULTS, "num_key_value_heads": None}

    @classmethod
    def dims(cls, cfg: HFConfig) -> GraniteMoeHybridDims:
        types = tuple("full_attention" if kind.has_attention else "linear_attention" for kind in cls.layout(cfg))
        return read_dims(GraniteMoeHybridDims, cfg, **mamba2_hybrid_fields(cfg), layers_block_type=types)

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is None:
            return (LayerKind.MAMBA2,) * cfg.positive_int("num_hidden_layers")
        return layers_from_types(cfg, "layer_types", LAYER_TYPES)
