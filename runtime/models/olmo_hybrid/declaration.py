from __future__ import annotations

from typing import Any

from runtime.hf_config import HFConfig
from runtime.models.common import capabilities
from runtime.models.interface import AttentionShape, LayerKind, planned
from runtime.models.qwen3_next.declaration import Qwen3NextForCausalLM
from runtime.models.shapes import attention_shape

# transformers' OlmoHybridConfig defaults for the fields the declaration reads (the linear-attention
# sizes left unset are derived in translate_legacy, as OlmoHybridConfig derives them).
OLMO_HYBRID_DEFAULTS = {
    "hidden_size": 3840, "num_hidden_layers": 32, "num_attention_heads": 30, "linear_conv_kernel_dim": 4,
}


class OlmoHybridForCausalLM(Qwen3NextForCausalLM):
    """Gated DeltaNet layers with full attention every fourth layer (Qwen3-Next's state shapes)."""

    architecture = "OlmoHybridForCausalLM"
    model_name = "OLMo-Hybrid"
    example_models = ("allenai/Olmo-Hybrid-7B",)
    implementation = None  # no forward pass yet (see the note)
    capabilities = capabilities(planned(
        "Missing: the Gated DeltaNet kernels (chunked prefill over varlen batches, decode update; OLMo-Hybrid "
        "allows negative eigenvalues) and the forward pass."
    ))
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
