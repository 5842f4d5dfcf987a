from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import LORA_NO_EXPERTS, ON_ENGINE, capabilities
from runtime.models.dims import read_dims
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import kv_shape, mamba2_state_shape

LAYER_TYPES = {
    "mamba": LayerKind.MAMBA2,
    "linear_attention": LayerKind.MAMBA2,
    "attention": LayerKind.ATTENTION,
    "full_attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP,
    "moe": LayerKind.MLP,
}
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# NemotronHConfig's older names for the same fields (its __post_init__ renames them too).
LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "attention_head_dim": "head_dim",
}


@dataclass(frozen=True)
class NemotronHDims:
    """NemotronHConfig's defaults (legacy names already translated)."""

    layers_block_type: tuple[str, ...]
    vocab_size: int = 131072
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False


class NemotronHForCausalLM(ModelDeclaration):
    """Mamba-2, attention and MLP-only layers, as `hybrid_override_pattern` spells them."""

    architecture = "NemotronHForCausalLM"
    model_name = "Nemotron-H"
    example_models = ("nvidia/Nemotron-H-8B-Base-8K", "nvidia/Nemotron-H-56B-Base-8K")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA2, LayerKind.MLP})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_NO_EXPERTS)
    implementation = "runtime.models.nemotron_h.model:NemotronHForCausalLM"
    quantizations = ("compressed-tensors", "gguf")
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
        for old, new in LEGACY_KEYS.items():
            if old in raw and new not in raw:
                raw[new] = raw.pop(old)
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
    def dims(cls, cfg: HFConfig) -> NemotronHDims:
        cls.layout(cfg)  # refuses a missing or unknown layer type with the config's own words
        return read_dims(NemotronHDims, cfg, num_key_value_heads=cfg.first(
            "num_key_value_heads", default=cfg.first("num_attention_heads", default=32)))

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layers_block_type") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layers_block_type or hybrid_override_pattern")
        return layers_from_types(cfg, "layers_block_type", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        dims = cls.dims(cfg)
        return kv_shape(cls.architecture, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba2_state_shape(
            cls.architecture,
            d_inner=dims.mamba_num_heads * dims.mamba_head_dim,
            n_heads=dims.mamba_num_heads,
            head_dim=dims.mamba_head_dim,
            n_groups=dims.n_groups,
            d_state=dims.ssm_state_size,
            d_conv=dims.conv_kernel,
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("chunk_size")
