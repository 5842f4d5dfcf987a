from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import capabilities
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, planned
from runtime.models.shapes import attention_shape

LAYER_TYPES = {"linear_attention": LayerKind.GATED_DELTANET, "full_attention": LayerKind.ATTENTION}


class Qwen3NextForCausalLM(ModelDeclaration):
    """Gated DeltaNet linear-attention layers with gated full attention every few layers."""

    architecture = "Qwen3NextForCausalLM"
    model_name = "Qwen3-Next"
    example_models = ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Thinking")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.GATED_DELTANET})
    state_name = "gated-deltanet state"
    capabilities = capabilities(planned(
        "Missing: the Gated DeltaNet kernels (chunked prefill over varlen batches, decode update) and the forward "
        "pass (gated attention with partial rotary, sparse MoE with a shared expert)."
    ))
    defaults = {
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is not None:
            return layers_from_types(cfg, "layer_types", LAYER_TYPES)
        interval = cfg.positive_int("full_attention_interval")
        return tuple(
            LayerKind.ATTENTION if (i + 1) % interval == 0 else LayerKind.GATED_DELTANET
            for i in range(cfg.positive_int("num_hidden_layers"))
        )

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp, head_size=cfg.positive_int("head_dim"))

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        key_heads, value_heads = cfg.positive_int("linear_num_key_heads"), cfg.positive_int("linear_num_value_heads")
        key_dim, value_dim = cfg.positive_int("linear_key_head_dim"), cfg.positive_int("linear_value_head_dim")
        for field, value in (("linear_num_key_heads", key_heads), ("linear_num_value_heads", value_heads)):
            if value % tp:
                raise ConfigError(f"{cls.architecture}: {field}={value} is not divisible by tensor_parallel_size={tp}")
        conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        conv = (cfg.positive_int("linear_conv_kernel_dim") - 1, conv_dim // tp)
        return conv, (value_heads // tp, key_dim, value_dim)
