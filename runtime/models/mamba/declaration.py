from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.hf_config import HFConfig
from runtime.models.common import LORA_NO_DT_PROJ, ON_ENGINE, capabilities
from runtime.models.dims import read_dims
from runtime.models.interface import LayerKind, ModelDeclaration, supported
from runtime.models.shapes import mamba1_state_shape


@dataclass(frozen=True)
class MambaDims:
    """MambaConfig's defaults; intermediate_size and time_step_rank are derived as MambaConfig does."""

    intermediate_size: int
    time_step_rank: int
    hidden_size: int = 768
    num_hidden_layers: int = 32
    vocab_size: int = 50280
    state_size: int = 16
    conv_kernel: int = 4
    expand: int = 2
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    use_bias: bool = False
    use_conv_bias: bool = True
    tie_word_embeddings: bool = True


class MambaForCausalLM(ModelDeclaration):
    """Mamba-1 (selective scan) in every layer; no attention."""

    architecture = "MambaForCausalLM"
    model_name = "Mamba"
    example_models = ("state-spaces/mamba-130m-hf", "state-spaces/mamba-2.8b-hf")
    layer_kinds = frozenset({LayerKind.MAMBA1})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=LORA_NO_DT_PROJ)
    implementation = "runtime.models.mamba.model:MambaForCausalLM"
    quantizations = ("gguf",)
    defaults = {"hidden_size": 768, "num_hidden_layers": 32, "state_size": 16, "conv_kernel": 4, "expand": 2}

    @classmethod
    def dims(cls, cfg: HFConfig) -> MambaDims:
        hidden = cfg.positive_int("hidden_size")
        rank = cfg.first("time_step_rank", default="auto")
        return read_dims(MambaDims, cfg, intermediate_size=int(cfg.positive_int("expand") * hidden),
                         time_step_rank=math.ceil(hidden / 16) if rank == "auto" else rank)

    @classmethod
    def layout(cls, cfg: HFConfig) -> tuple[LayerKind, ...]:
        return (LayerKind.MAMBA1,) * cfg.positive_int("num_hidden_layers")

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba1_state_shape(cls.architecture, d_inner=dims.intermediate_size, d_state=dims.state_size,
                                  d_conv=dims.conv_kernel, tp=tp)
