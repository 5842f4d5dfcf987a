from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import HFConfig
from runtime.models.bamba.declaration import (
    MAMBA2_HYBRID_DEFAULTS,
    BambaForCausalLM,
    Mamba2HybridDims,
    mamba2_hybrid_fields,
)
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import read_dims
from runtime.models.interface import LayerKind, supported


@dataclass(frozen=True)
class FalconH1Dims(Mamba2HybridDims):
    """FalconH1Config's own keys (muP multipliers, the Mamba width and norm) on Bamba's."""

    num_key_value_heads: int = 8
    mamba_d_ssm: int | None = 1024
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    projectors_bias: bool = False
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0


class FalconH1ForCausalLM(BambaForCausalLM):
    """Attention and Mamba-2 side by side in every layer, with muP multipliers."""

    architecture = "FalconH1ForCausalLM"
    model_name = "Falcon-H1"
    example_models = ("tiiuae/Falcon-H1-0.5B-Instruct", "tiiuae/Falcon-H1-7B-Instruct")
    layer_kinds = frozenset({LayerKind.PARALLEL})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.falcon_h1.model:FalconH1ForCausalLM"
    quantizations = ("compressed-tensors", "gguf")
    defaults = {**MAMBA2_HYBRID_DEFAULTS, "mamba_d_ssm": 1024}

    @classmethod
    def dims(cls, cfg: HFConfig) -> FalconH1Dims:
        fields = mamba2_hybrid_fields(cfg)
        if cfg.first("mamba_d_head", default="auto") == "auto":
            fields["mamba_d_head"] = cls.mamba_inner_size(cfg) // cfg.positive_int("mamba_n_heads")
        # A null mamba_d_ssm means expand x hidden, not the default width.
        return read_dims(FalconH1Dims, cfg, **fields, mamba_d_ssm=cfg.first("mamba_d_ssm"))

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.PARALLEL,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_inner_size(cls, cfg: HFConfig) -> int:
        # mamba_d_ssm, when set, replaces expand x hidden as the Mamba inner size.
        return cfg.first("mamba_d_ssm") or super().mamba_inner_size(cfg)
