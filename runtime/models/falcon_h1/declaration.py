from __future__ import annotations

from runtime.hf_config import HFConfig
from runtime.models.bamba.declaration import MAMBA2_HYBRID_DEFAULTS, BambaForCausalLM
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import LayerKind, supported


class FalconH1ForCausalLM(BambaForCausalLM):
    """Attention and Mamba-2 side by side in every layer, with muP multipliers."""

    architecture = "FalconH1ForCausalLM"
    model_name = "Falcon-H1"
    example_models = ("tiiuae/Falcon-H1-0.5B-Instruct", "tiiuae/Falcon-H1-7B-Instruct")
    layer_kinds = frozenset({LayerKind.PARALLEL})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.falcon_h1.model:FalconH1ForCausalLM"
    defaults = {**MAMBA2_HYBRID_DEFAULTS, "mamba_d_ssm": 1024}

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.PARALLEL,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_inner_size(cls, cfg: HFConfig) -> int:
        # mamba_d_ssm, when set, replaces expand x hidden as the Mamba inner size.
        return cfg.first("mamba_d_ssm") or super().mamba_inner_size(cfg)
