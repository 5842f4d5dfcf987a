from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import capabilities
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, planned
from runtime.models.shapes import attention_shape

LAYER_TYPES = {"full_attention": LayerKind.ATTENTION, "linear_attention": LayerKind.LIGHTNING}
# transformers' MiniMaxConfig defaults for the fields the declaration reads.
MINIMAX_DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}


class MiniMaxForCausalLM(ModelDeclaration):
    """Lightning attention (linear attention with a per-head decay) with softmax attention between, and MoE."""

    architecture = "MiniMaxForCausalLM"
    model_name = "MiniMax"
    example_models = ("MiniMaxAI/MiniMax-Text-01-hf",)
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.LIGHTNING})
    state_name = "lightning state"
    capabilities = capabilities(planned(
        "Missing: the lightning-attention kernels (block-wise prefill with per-head decay over varlen batches, "
        "decode update) and the forward pass (sparse MoE, the alpha/beta residual factors)."
    ))
    defaults = MINIMAX_DEFAULTS

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is not None:
            return layers_from_types(cfg, "layer_types", LAYER_TYPES)
        # MiniMaxConfig's default: softmax attention in the even layers, lightning attention in the odd ones.
        return tuple(LayerKind.ATTENTION if i % 2 == 0 else LayerKind.LIGHTNING
                     for i in range(cfg.positive_int("num_hidden_layers")))

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        heads = cfg.positive_int("num_attention_heads")
        if heads % tp:
            raise ConfigError(f"{cls.architecture}: num_attention_heads={heads} is not divisible by "
                              f"tensor_parallel_size={tp}")
        head_dim = attention_shape(cfg, 1).head_size
        return ((heads // tp, head_dim, head_dim),)  # one key-value state per head, no conv

    @classmethod
    def mamba_state_dtypes(cls, cfg: HFConfig, dtype: str, ssm_dtype: str | None) -> tuple[str, ...]:
        return (ssm_dtype or dtype,)  # the one state is recurrent: it follows the SSM state dtype
