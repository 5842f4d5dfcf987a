from __future__ import annotations

from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import attention_shape, mamba2_state_shape

LAYER_TYPES = {
    "mamba": LayerKind.MAMBA2,
    "linear_attention": LayerKind.MAMBA2,
    "attention": LayerKind.ATTENTION,
    "full_attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP,
    "moe": LayerKind.MLP,
}
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class NemotronHForCausalLM(ModelDeclaration):
    """Mamba-2, attention and MLP-only layers, as `hybrid_override_pattern` spells them."""

    architecture = "NemotronHForCausalLM"
    model_name = "Nemotron-H"
    example_models = ("nvidia/Nemotron-H-8B-Base-8K", "nvidia/Nemotron-H-56B-Base-8K")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA2, LayerKind.MLP})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported())
    implementation = "runtime.models.nemotron_h.model:NemotronHForCausalLM"
    # vLLM keeps Nemotron-H's SSM state in float32 unless told otherwise ("only float32 is known to
    # have no accuracy issues"); NVIDIA's newer configs say so with mamba_ssm_cache_dtype.
    default_ssm_dtype = "float32"
    defaults = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
    }

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        pattern = raw.pop("hybrid_override_pattern", None)
        if raw.get("layers_block_type") is None and pattern is not None:
            unknown = sorted(set(pattern) - PATTERN.keys())
            if unknown:
                raise ConfigError(
                    f"{cls.architecture}: hybrid_override_pattern has unknown characters {unknown}; "
                    f"expected {''.join(PATTERN)} (Mamba, attention, MLP, MoE)"
                )
            raw["layers_block_type"] = [PATTERN[c] for c in pattern]
        if raw.get("layers_block_type") is not None:
            raw["num_hidden_layers"] = len(raw["layers_block_type"])
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layers_block_type") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layers_block_type or hybrid_override_pattern")
        return layers_from_types(cfg, "layers_block_type", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp, head_size=cfg.first("head_dim", "attention_head_dim", default=128))

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        heads, head_dim = cfg.positive_int("mamba_num_heads"), cfg.positive_int("mamba_head_dim")
        return mamba2_state_shape(
            cls.architecture,
            d_inner=heads * head_dim,
            n_heads=heads,
            head_dim=head_dim,
            n_groups=cfg.positive_int("n_groups"),
            d_state=cfg.positive_int("ssm_state_size"),
            d_conv=cfg.positive_int("conv_kernel"),
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("chunk_size")
