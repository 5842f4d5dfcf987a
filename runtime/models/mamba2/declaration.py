from __future__ import annotations

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import LayerKind, ModelDeclaration, supported
from runtime.models.shapes import mamba2_state_shape


class Mamba2ForCausalLM(ModelDeclaration):
    """Mamba-2 (state-space duality) in every layer; no attention."""

    architecture = "Mamba2ForCausalLM"
    model_name = "Mamba2"
    example_models = ("state-spaces/mamba2-130m", "state-spaces/mamba2-2.7b", "mistralai/Mamba-Codestral-7B-v0.1")
    layer_kinds = frozenset({LayerKind.MAMBA2})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported())
    implementation = "runtime.models.mamba2.model:Mamba2ForCausalLM"
    defaults = {
        "hidden_size": 4096,
        "num_hidden_layers": 64,
        "num_heads": 128,
        "head_dim": 64,
        "n_groups": 8,
        "state_size": 128,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 256,
    }

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.MAMBA2,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        return mamba2_state_shape(
            cls.architecture,
            d_inner=cfg.positive_int("expand") * cfg.positive_int("hidden_size"),
            n_heads=cfg.positive_int("num_heads"),
            head_dim=cfg.positive_int("head_dim"),
            n_groups=cfg.positive_int("n_groups"),
            d_state=cfg.positive_int("state_size"),
            d_conv=cfg.positive_int("conv_kernel"),
            tp=tp,
        )

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cfg.positive_int("chunk_size")
