from __future__ import annotations

from typing import Any

from runtime.models.qwen3_next.declaration import QWEN_MTP_CAPABILITIES, Qwen3NextForCausalLM

# transformers' Qwen3_5MoeTextConfig defaults for the fields the declaration reads.
QWEN3_5_MOE_DEFAULTS = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
    "num_experts": 256,
}


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's layers (unfused Gated DeltaNet projections, gated full attention) with Qwen3-Next's sparse
    MoE and sigmoid-gated shared expert in every layer."""

    architecture = "Qwen3_5MoeForCausalLM"
    model_name = "Qwen3.5-MoE"
    example_models = ("Qwen/Qwen3.5-35B-A3B",)
    capabilities = QWEN_MTP_CAPABILITIES
    implementation = "runtime.models.qwen3_5_moe.model:Qwen3_5MoeForCausalLM"
    quantizations = ("fp8",)
    defaults = QWEN3_5_MOE_DEFAULTS

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # Qwen3_5MoeDecoderLayer puts experts in every layer and its router always renormalises the top-k
        # weights: Qwen3-Next's keys for choosing otherwise do not apply.
        return {**raw, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
