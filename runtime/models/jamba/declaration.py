from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import attention_shape, mamba1_state_shape


class JambaForCausalLM(ModelDeclaration):
    """Mamba-1 layers with attention every `attn_layer_period` layers, and MoE feed-forward."""

    architecture = "JambaForCausalLM"
    model_name = "Jamba"
    example_models = ("ai21labs/Jamba-v0.1", "ai21labs/AI21-Jamba-Mini-1.7")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA1})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.jamba.model:JambaForCausalLM"
    defaults = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        period, offset = cfg.positive_int("attn_layer_period"), cfg.attn_layer_offset
        if not 0 <= offset < period:
            raise ConfigError(
                f"{cls.architecture}: attn_layer_offset={offset} must be in [0, attn_layer_period={period})"
            )
        return tuple(
            LayerKind.ATTENTION if i % period == offset else LayerKind.MAMBA1
            for i in range(cfg.positive_int("num_hidden_layers"))
        )

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        return mamba1_state_shape(
            cls.architecture,
            d_inner=cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size"),
            d_state=cfg.positive_int("mamba_d_state"),
            d_conv=cfg.positive_int("mamba_d_conv"),
            tp=tp,
        )
