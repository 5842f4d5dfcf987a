from __future__ import annotations

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import LayerKind, ModelDeclaration, supported
from runtime.models.shapes import mamba1_state_shape


class MambaForCausalLM(ModelDeclaration):
    """Mamba-1 (selective scan) in every layer; no attention."""

    architecture = "MambaForCausalLM"
    model_name = "Mamba"
    example_models = ("state-spaces/mamba-130m-hf", "state-spaces/mamba-2.8b-hf")
    layer_kinds = frozenset({LayerKind.MAMBA1})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.mamba.model:MambaForCausalLM"
    defaults = {"hidden_size": 768, "num_hidden_layers": 32, "state_size": 16, "conv_kernel": 4, "expand": 2}

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.MAMBA1,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        return mamba1_state_shape(
            cls.architecture,
            d_inner=int(cfg.expand * cfg.positive_int("hidden_size")),
            d_state=cfg.positive_int("state_size"),
            d_conv=cfg.positive_int("conv_kernel"),
            tp=tp,
        )
