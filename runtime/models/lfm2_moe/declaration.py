from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.dims import read_rope
from runtime.models.lfm2.declaration import Lfm2Dims, Lfm2ForCausalLM
from runtime.models.shapes import attention_shape

# transformers' Lfm2MoeConfig defaults for the fields the declaration reads.
LFM2_MOE_DEFAULTS = {
    "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5,
    "tie_word_embeddings": True, "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2,
    "num_experts_per_tok": 4, "num_experts": 32, "use_expert_bias": True, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "rope_theta": 1_000_000.0,
}


@dataclass(frozen=True)
class Lfm2MoeDims(Lfm2Dims):
    """LFM2's dims (intermediate_size is the dense layers' MLP width) plus the experts'."""

    num_dense_layers: int  # layers 0..num_dense_layers-1 have a dense MLP, the others experts
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    use_expert_bias: bool
    routed_scaling_factor: float
    norm_topk_prob: bool


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2 (gated short convolutions and a few attention layers) with sigmoid-routed experts after the first
    dense layers."""

    architecture = "Lfm2MoeForCausalLM"
    model_name = "LFM2-MoE"
    example_models = ("LiquidAI/LFM2-8B-A1B",)
    implementation = "runtime.models.lfm2_moe.model:Lfm2MoeForCausalLM"
    quantizations = ()  # LFM2-MoE GGUF files (architecture lfm2moe) are not mapped
    defaults = LFM2_MOE_DEFAULTS

    @classmethod
    def dims(cls, cfg: HFConfig) -> Lfm2MoeDims:
        num_experts, top_k = cfg.positive_int("num_experts"), cfg.positive_int("num_experts_per_tok")
        if top_k > num_experts:
            raise ConfigError(f"{cls.architecture}: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
        attention = attention_shape(cfg, 1)
        return Lfm2MoeDims(
            vocab_size=cfg.positive_int("vocab_size"),
            hidden_size=cfg.positive_int("hidden_size"),
            layers=cls.layout(cfg),
            num_heads=cfg.positive_int("num_attention_heads"),
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_size,
            intermediate_size=cfg.positive_int("intermediate_size"),  # no auto-adjustment in LFM2-MoE
            norm_eps=float(cfg.norm_eps),
            conv_width=cfg.positive_int("conv_L_cache"),
            conv_bias=bool(cfg.conv_bias),
            rope=read_rope(cfg, attention.head_size),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            num_dense_layers=int(cfg.num_dense_layers),
            moe_intermediate_size=cfg.positive_int("moe_intermediate_size"),
            num_experts=num_experts,
            top_k=top_k,
            use_expert_bias=bool(cfg.use_expert_bias),
            routed_scaling_factor=float(cfg.routed_scaling_factor),
            norm_topk_prob=bool(cfg.norm_topk_prob),
        )
