from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.hf_config import ConfigError, HFConfig
from runtime.models.common import LORA_NO_DT_PROJ, ON_ENGINE, capabilities
from runtime.models.interface import LayerKind, ModelDeclaration, supported
from runtime.models.shapes import mamba1_state_shape

# transformers' FalconMambaConfig defaults for the fields the declaration reads.
FALCON_MAMBA_DEFAULTS = {
    "vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5,
    "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
    "residual_in_fp32": True, "time_step_rank": "auto", "tie_word_embeddings": True, "mixer_rms_eps": 1e-6,
}
# The conv kernels apply SiLU, as every published checkpoint does.
CONV_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class FalconMambaDims:
    """Everything the FalconMamba torch module is built from, read once from config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    mixer_rms_eps: float  # the weightless RMS norms on dt, B and C
    residual_in_fp32: bool
    tie_word_embeddings: bool


def inner_size(cfg: HFConfig) -> int:
    # transformers derives intermediate_size from expand, whatever config.json says.
    return int(cfg.expand * cfg.positive_int("hidden_size"))


class FalconMambaForCausalLM(ModelDeclaration):
    """Mamba-1 in every layer, with weightless RMS norms on dt, B and C; no attention."""

    architecture = "FalconMambaForCausalLM"
    model_name = "FalconMamba"
    example_models = ("tiiuae/falcon-mamba-7b", "tiiuae/falcon-mamba-7b-instruct")
    layer_kinds = frozenset({LayerKind.MAMBA1})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_NO_DT_PROJ)
    implementation = "runtime.models.falcon_mamba.model:FalconMambaForCausalLM"
    defaults = FALCON_MAMBA_DEFAULTS

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.MAMBA1,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        return mamba1_state_shape(cls.architecture, d_inner=inner_size(cfg), d_state=cfg.positive_int("state_size"),
                                  d_conv=cfg.positive_int("conv_kernel"), tp=tp)

    @classmethod
    def dims(cls, cfg: HFConfig) -> FalconMambaDims:
        if cfg.hidden_act not in CONV_ACTIVATIONS:
            raise ConfigError(
                f"{cls.architecture}: hidden_act={cfg.hidden_act!r} is not supported by the Mamba-1 conv; "
                f"Tandem runs {' or '.join(CONV_ACTIVATIONS)} (the value every published checkpoint uses)"
            )
        hidden = cfg.positive_int("hidden_size")
        dt_rank = cfg.time_step_rank
        return FalconMambaDims(
            vocab_size=cfg.positive_int("vocab_size"),
            hidden_size=hidden,
            num_layers=cfg.positive_int("num_hidden_layers"),
            d_inner=inner_size(cfg),
            d_state=cfg.positive_int("state_size"),
            d_conv=cfg.positive_int("conv_kernel"),
            dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank),
            conv_bias=bool(cfg.use_conv_bias),
            proj_bias=bool(cfg.use_bias),
            norm_eps=float(cfg.layer_norm_epsilon),
            mixer_rms_eps=float(cfg.mixer_rms_eps),
            residual_in_fp32=bool(cfg.residual_in_fp32),
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
        )
