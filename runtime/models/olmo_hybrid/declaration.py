from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.dims import RopeDims, read_rope
from runtime.models.interface import AttentionShape, LayerKind
from runtime.models.qwen3_next.declaration import GATED_DELTANET_TP_CAPABILITIES, Qwen3NextForCausalLM
from runtime.models.shapes import attention_shape

# transformers' OlmoHybridConfig defaults for the fields the declaration reads (the linear-attention
# sizes left unset are derived in translate_legacy, as OlmoHybridConfig derives them).
OLMO_HYBRID_DEFAULTS = {
    "vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 30, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "rope_theta": 10000.0, "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
}


@dataclass(frozen=True)
class OlmoHybridDims:
    """Everything the OLMo-Hybrid torch module is built from, read once from config.json."""

    vocab_size: int
    hidden_size: int
    layers: tuple[LayerKind, ...]
    hidden_act: str
    rms_norm_eps: float
    tie_word_embeddings: bool
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    rope: RopeDims | None  # None: no position embedding (NoPE)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    linear_allow_neg_eigval: bool


def nope(cfg: HFConfig) -> bool:
    """HF builds no rotary embedding when rope_parameters names no rope_theta (its NoPE checkpoints)."""
    params = cfg.first("rope_parameters")
    return isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None


class OlmoHybridForCausalLM(Qwen3NextForCausalLM):
    """Gated DeltaNet layers with full attention every fourth layer (Qwen3-Next's state shapes)."""

    architecture = "OlmoHybridForCausalLM"
    model_name = "OLMo-Hybrid"
    example_models = ("allenai/Olmo-Hybrid-7B",)
    implementation = "runtime.models.olmo_hybrid.model:OlmoHybridForCausalLM"
    quantizations = ()  # Olmo-Hybrid publishes no FP8 checkpoint; untested here
    capabilities = GATED_DELTANET_TP_CAPABILITIES
    defaults = OLMO_HYBRID_DEFAULTS

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any]) -> dict[str, Any]:
        heads = raw.get("num_attention_heads", OLMO_HYBRID_DEFAULTS["num_attention_heads"])
        hidden = raw.get("hidden_size", OLMO_HYBRID_DEFAULTS["hidden_size"])
        for key in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
            if raw.get(key) is None:
                raw[key] = heads
        if raw.get("linear_key_head_dim") is None:
            raw["linear_key_head_dim"] = int(0.75 * hidden / raw["linear_num_key_heads"])
        if raw.get("linear_value_head_dim") is None:
            raw["linear_value_head_dim"] = 2 * raw["linear_key_head_dim"]
        return raw

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        if cfg.first("layer_types") is not None:
            return super().layout(cfg)
        # OlmoHybridConfig's default: full attention every fourth layer, and at least in the last one.
        num_layers = cfg.positive_int("num_hidden_layers")
        kinds = [LayerKind.ATTENTION if i % 4 == 3 else LayerKind.GATED_DELTANET for i in range(num_layers)]
        if LayerKind.ATTENTION not in kinds:
            kinds[-1] = LayerKind.ATTENTION
        return tuple(kinds)

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def dims(cls, cfg: HFConfig) -> OlmoHybridDims:
        attention = cls.attention_shape(cfg, 1)
        key_heads, value_heads = cfg.positive_int("linear_num_key_heads"), cfg.positive_int("linear_num_value_heads")
        if value_heads % key_heads:
            raise ConfigError(f"{cls.architecture}: linear_num_value_heads={value_heads} is not a multiple of "
                              f"linear_num_key_heads={key_heads}")
        return OlmoHybridDims(
            vocab_size=cfg.positive_int("vocab_size"),
            hidden_size=cfg.positive_int("hidden_size"),
            layers=cls.layout(cfg),
            hidden_act=str(cfg.hidden_act),
            rms_norm_eps=float(cfg.rms_norm_eps),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            intermediate_size=cfg.positive_int("intermediate_size"),
            num_heads=cfg.positive_int("num_attention_heads"),
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_size,
            attention_bias=bool(cfg.attention_bias),
            rope=None if nope(cfg) else read_rope(cfg, attention.head_size),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=cfg.positive_int("linear_key_head_dim"),
            linear_value_head_dim=cfg.positive_int("linear_value_head_dim"),
            linear_conv_kernel_dim=cfg.positive_int("linear_conv_kernel_dim"),
            linear_allow_neg_eigval=bool(cfg.linear_allow_neg_eigval),
        )
