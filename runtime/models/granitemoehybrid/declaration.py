from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.bamba.declaration import MAMBA2_HYBRID_DEFAULTS, BambaForCausalLM
from runtime.models.common import ON_ENGINE, capabilities
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


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Granite 4.0-H: Bamba's Mamba-2 and attention layers, MoE feed-forward and Granite multipliers."""

    architecture = "GraniteMoeHybridForCausalLM"
    model_name = "Granite 4.0-H"
    example_models = ("ibm-granite/granite-4.0-h-tiny", "ibm-granite/granite-4.0-h-small")
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.granitemoehybrid.model:GraniteMoeHybridForCausalLM"
    defaults = {**MAMBA2_HYBRID_DEFAULTS, "num_key_value_heads": None}

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is None:
            return (LayerKind.MAMBA2,) * cfg.positive_int("num_hidden_layers")
        return layers_from_types(cfg, "layer_types", LAYER_TYPES)
