from __future__ import annotations

from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import capabilities
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, planned
from runtime.models.shapes import attention_shape

LAYER_TYPES = {"conv": LayerKind.SHORT_CONV, "full_attention": LayerKind.ATTENTION, "attention": LayerKind.ATTENTION}


class Lfm2ForCausalLM(ModelDeclaration):
    """Gated short-convolution layers with a few attention layers."""

    architecture = "Lfm2ForCausalLM"
    model_name = "LFM2"
    example_models = ("LiquidAI/LFM2-700M", "LiquidAI/LFM2-1.2B")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.SHORT_CONV})
    capabilities = capabilities(planned("Short-convolution layers have no kernel on the engine yet."))
    defaults = {"hidden_size": 1536, "num_attention_heads": 24, "num_key_value_heads": 8, "conv_L_cache": 3}

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # Early LFM2 configs list the attention layers (full_attn_idxs) instead of every layer's type.
        if raw.get("layer_types") is None and raw.get("full_attn_idxs") is not None:
            attention = set(raw["full_attn_idxs"])
            raw["layer_types"] = [
                "full_attention" if i in attention else "conv" for i in range(raw.get("num_hidden_layers", 0))
            ]
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is None:
            raise ConfigError(f"{cls.architecture}: config.json needs layer_types or full_attn_idxs")
        return layers_from_types(cfg, "layer_types", LAYER_TYPES)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        hidden = cfg.positive_int("hidden_size")
        if hidden % tp:
            raise ConfigError(f"{cls.architecture}: hidden_size={hidden} is not divisible by tensor_parallel_size={tp}")
        return ((cfg.positive_int("conv_L_cache") - 1, hidden // tp),)
