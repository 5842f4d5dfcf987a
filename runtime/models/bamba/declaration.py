from __future__ import annotations

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import AttentionShape, LayerKind, ModelDeclaration, supported
from runtime.models.shapes import attention_shape, mamba2_state_shape

# transformers' BambaConfig defaults for the fields the declaration reads.
MAMBA2_HYBRID_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
}


def layer_indices(cfg: HFConfig, key: str) -> set[int]:
    num_layers = cfg.positive_int("num_hidden_layers")
    indices = set(cfg.first(key, default=[]))
    outside = sorted(i for i in indices if not (isinstance(i, int) and 0 <= i < num_layers))
    if outside:
        raise ConfigError(f"{cfg.architecture}: {key} names layers {outside}, but the model has {num_layers} layers")
    return indices


class BambaForCausalLM(ModelDeclaration):
    """Mamba-2 layers with attention layers at `attn_layer_indices`."""

    architecture = "BambaForCausalLM"
    model_name = "Bamba"
    example_models = ("ibm-ai-platform/Bamba-9B", "ibm-ai-platform/Bamba-9B-v2")
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA2})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.bamba.model:BambaForCausalLM"
    defaults = MAMBA2_HYBRID_DEFAULTS

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        attention = layer_indices(cfg, "attn_layer_indices")
        return tuple(
            LayerKind.ATTENTION if i in attention else LayerKind.MAMBA2
            for i in range(cfg.positive_int("num_hidden_layers"))
        )

    @classmethod
    def attention_shape(cls, cfg: HFConfig, tp: int) -> AttentionShape:
        return attention_shape(cfg, tp)

    @classmethod
    def mamba_inner_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("mamba_expand") * cfg.positive_int("hidden_size")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        d_inner = cls.mamba_inner_size(cfg)
        heads = cfg.positive_int("mamba_n_heads")
        head_dim = cfg.mamba_d_head
        if head_dim == "auto":
            head_dim = d_inner // heads
        return mamba2_state_shape(
            cls.architecture,
            d_inner=d_inner,
            n_heads=heads,
            head_dim=head_dim,
            n_groups=cfg.positive_int("mamba_n_groups"),
            d_state=cfg.positive_int("mamba_d_state"),
            d_conv=cfg.positive_int("mamba_d_conv"),
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("mamba_chunk_size")
