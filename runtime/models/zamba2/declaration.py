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
    "hybrid": LayerKind.HYBRID,
}
# Zyphra's checkpoints before transformers 4.48 used other names for the same fields.
LEGACY_KEYS = {
    "state_size": "mamba_d_state",
    "conv_dimension": "mamba_d_conv",
    "expansion_factor": "mamba_expand",
    "ffn_hidden_size": "intermediate_size",
    "lora_rank": "adapter_rank",
    "use_shared_attention_lora": "use_shared_attention_adapter",
}


class Zamba2ForCausalLM(ModelDeclaration):
    """Mamba-2 layers; some also apply a shared attention block, each application with its own KV cache."""

    architecture = "Zamba2ForCausalLM"
    model_name = "Zamba2"
    example_models = ("Zyphra/Zamba2-1.2B", "Zyphra/Zamba2-2.7B-Instruct-v2")
    layer_kinds = frozenset({LayerKind.MAMBA2, LayerKind.HYBRID})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported())
    implementation = "runtime.models.zamba2.model:Zamba2ForCausalLM"
    defaults = {
        "hidden_size": 2560,
        "num_hidden_layers": 54,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "n_mamba_heads": 8,
        "chunk_size": 256,
    }

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        for old, new in LEGACY_KEYS.items():
            if old in raw and new not in raw:
                raw[new] = raw.pop(old)
        types = raw.get("layers_block_type")
        if isinstance(types, list):
            raw["layers_block_type"] = [{"m": "mamba", "g": "hybrid"}.get(t, t) for t in types]
        if "mamba_headdim" in raw and "n_mamba_heads" not in raw:
            d_inner = raw.get("mamba_expand", 2) * raw.get("hidden_size", cls.defaults["hidden_size"])
            raw["n_mamba_heads"] = d_inner // raw["mamba_headdim"]
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layers_block_type") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layers_block_type")
        return layers_from_types(cfg, "layers_block_type", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        # The shared block attends over [hidden, embedding], twice the hidden width.
        head_size = 2 * cfg.positive_int("hidden_size") // cfg.positive_int("num_attention_heads")
        return attention_shape(cfg, tp, head_size=head_size)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        d_inner = cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size")
        heads = cfg.positive_int("n_mamba_heads")
        return mamba2_state_shape(
            cls.architecture,
            d_inner=d_inner,
            n_heads=heads,
            head_dim=d_inner // heads,
            n_groups=cfg.positive_int("mamba_ngroups"),
            d_state=cfg.positive_int("mamba_d_state"),
            d_conv=cfg.positive_int("mamba_d_conv"),
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("chunk_size")
