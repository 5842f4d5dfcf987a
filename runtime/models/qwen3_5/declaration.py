from __future__ import annotations

from typing import Any

from runtime.models.qwen3_next.declaration import QWEN_MTP_CAPABILITIES, Qwen3NextForCausalLM

# transformers' Qwen3_5TextConfig defaults for the fields the declaration reads.
QWEN3_5_DEFAULTS = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next's layer layout and states (Gated DeltaNet with gated full attention), with a dense MLP and
    unfused Gated DeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). The text model: its
    rotary sections (mrope) all see the same position for text, which makes them plain partial rotary."""

    architecture = "Qwen3_5ForCausalLM"
    model_name = "Qwen3.5"
    example_models = ("Qwen/Qwen3.5-27B",)
    capabilities = QWEN_MTP_CAPABILITIES
    implementation = "runtime.models.qwen3_5.model:Qwen3_5ForCausalLM"
    quantizations = ("fp8",)
    defaults = QWEN3_5_DEFAULTS

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # Qwen3.5 has no experts, whatever a config.json says (Qwen3_5TextConfig drops the MoE keys).
        raw.pop("num_experts", None)
        return raw
