from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import LORA_NO_EXPERTS_DT_PROJ, ON_ENGINE, capabilities
from runtime.models.dims import AttentionDims, attention_fields, read_dims
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import kv_shape, mamba1_state_shape


@dataclass(frozen=True)
class JambaDims(AttentionDims):
    """JambaConfig's defaults; layers_block_type and layers_num_experts are derived as JambaConfig does."""

    vocab_size: int = 65536
    num_key_value_heads: int = 8
    intermediate_size: int = 14336
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    num_experts_per_tok: int = 2
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    layers_block_type: tuple[str, ...] = ()
    layers_num_experts: tuple[int, ...] = ()


class JambaForCausalLM(ModelDeclaration):
    """Mamba-1 layers with attention every `attn_layer_period` layers, and MoE feed-forward."""

    architecture = "JambaForCausalLM"
    model_name = "Jamba"
    example_models = ("ai21labs/Jamba-v0.1", "ai21labs/AI21-Jamba-Mini-1.7")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA1})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_NO_EXPERTS_DT_PROJ)
    implementation = "runtime.models.jamba.model:JambaForCausalLM"
    quantizations = ("gguf",)
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
    def dims(cls, cfg: HFConfig) -> JambaDims:
        period, offset = cfg.first("expert_layer_period", default=2), cfg.first("expert_layer_offset", default=1)
        experts = cfg.first("num_experts", default=16)
        num_layers = cfg.positive_int("num_hidden_layers")
        dt_rank = cfg.first("mamba_dt_rank", default="auto")
        return read_dims(
            JambaDims, cfg, **attention_fields(cfg, {}, rope=False),
            layers_block_type=tuple("attention" if k.has_attention else "mamba" for k in cls.layout(cfg)),
            layers_num_experts=tuple(experts if i % period == offset else 1 for i in range(num_layers)),
            mamba_dt_rank=math.ceil(cfg.positive_int("hidden_size") / 16) if dt_rank == "auto" else dt_rank,
        )

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
        dims = cls.dims(cfg)
        return kv_shape(cls.architecture, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, tp)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba1_state_shape(cls.architecture, d_inner=dims.mamba_expand * dims.hidden_size,
                                  d_state=dims.mamba_d_state, d_conv=dims.mamba_d_conv, tp=tp)
