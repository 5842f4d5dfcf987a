from __future__ import annotations

from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import capabilities
from runtime.models.granitemoehybrid.declaration import layers_from_types
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, planned

# KDA layers keep a Gated DeltaNet's cache (a short-conv state over q, k and v, and a delta-rule state per head),
# so they are declared with that layer kind; their kernel differs (a decay per channel, not per head).
LAYER_TYPES = {"linear_attention": LayerKind.GATED_DELTANET, "full_attention": LayerKind.ATTENTION}
# The checkpoints nest the KDA sizes in `linear_attn_config`; KimiLinearConfig.__post_init__ reads them from there.
NESTED = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
          "short_conv_kernel_size": "linear_conv_kernel_dim"}
# transformers' KimiLinearConfig defaults for the fields the declaration reads.
KIMI_LINEAR_DEFAULTS = {
    "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
}


class KimiLinearForCausalLM(ModelDeclaration):
    """Kimi Delta Attention (a gated delta rule with a decay per channel) with MLA full attention between, and MoE."""

    architecture = "KimiLinearForCausalLM"
    model_name = "Kimi-Linear"
    example_models = ("moonshotai/Kimi-Linear-48B-A3B-Instruct",)
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.GATED_DELTANET})
    state_name = "KDA state"
    capabilities = capabilities(planned(
        "Missing: the KDA kernels (chunked delta-rule prefill with a per-channel decay over varlen batches, decode "
        "update) and the forward pass (MLA attention, MoE); and a cache for MLA layers, which keep per token one "
        "compressed latent (kv_lora_rank) and one rope key (qk_rope_head_dim) of other sizes, not K and V heads: "
        "the attention shape interface cannot express it yet, so `tandem plan` stops at the attention layers."
    ))
    defaults = KIMI_LINEAR_DEFAULTS

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        nested = raw.get("linear_attn_config") or {}
        raw = {**{ours: nested[theirs] for theirs, ours in NESTED.items() if theirs in nested}, **raw}
        if raw.get("layer_types") is None and {"full_attn_layers", "kda_layers"} <= set(nested):
            # 1-indexed layer numbers in the checkpoints, as KimiLinearConfig reads them.
            types = [None] * int(raw.get("num_hidden_layers", KIMI_LINEAR_DEFAULTS["num_hidden_layers"]))
            for name, layers in (("full_attention", nested["full_attn_layers"]), ("linear_attention",
                                                                                  nested["kda_layers"])):
                for layer in layers:
                    types[layer - 1] = name
            raw["layer_types"] = types
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is not None:
            return layers_from_types(cfg, "layer_types", LAYER_TYPES)
        # KimiLinearConfig's default: full attention in every fourth layer from layer 4 (index 4), KDA elsewhere.
        return tuple(LayerKind.ATTENTION if i and i % 4 == 0 else LayerKind.GATED_DELTANET
                     for i in range(cfg.positive_int("num_hidden_layers")))

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        # An AttentionShape is K and V heads of one size; declaring MLA's latent as such would size the pool wrong.
        raise ConfigError(
            f"{cls.architecture}: its MLA attention layers cache a compressed latent of kv_lora_rank="
            f"{cfg.positive_int('kv_lora_rank')} and a rope key of "
            f"qk_rope_head_dim={cfg.positive_int('qk_rope_head_dim')} per token, which the cache layout "
            "cannot express yet (the model is planned: see docs/models/supported_models.md)"
        )

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        heads, head_dim = cfg.positive_int("linear_num_heads"), cfg.positive_int("linear_head_dim")
        if heads % tp:
            raise ConfigError(f"{cls.architecture}: linear_num_heads={heads} is not divisible by "
                              f"tensor_parallel_size={tp}")
        conv = (cfg.positive_int("linear_conv_kernel_dim") - 1, 3 * heads * head_dim // tp)  # q, k and v convolved
        return conv, (heads // tp, head_dim, head_dim)
