from __future__ import annotations

from dataclasses import dataclass

from runtime.hf_config import HFConfig
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.dims import read_dims
from runtime.models.interface import LayerKind, ModelDeclaration, supported
from runtime.models.shapes import mamba2_state_shape


@dataclass(frozen=True)
class Mamba2Dims:
    """Mamba2Config's defaults."""

    hidden_size: int = 4096
    num_hidden_layers: int = 64
    vocab_size: int = 32768
    num_heads: int = 128
    head_dim: int = 64
    n_groups: int = 8
    state_size: int = 128
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    tie_word_embeddings: bool = False

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.hidden_size)


class Mamba2ForCausalLM(ModelDeclaration):
    """Mamba-2 (state-space duality) in every layer; no attention."""

    architecture = "Mamba2ForCausalLM"
    model_name = "Mamba2"
    example_models = ("state-spaces/mamba2-130m", "state-spaces/mamba2-2.7b", "mistralai/Mamba-Codestral-7B-v0.1")
    layer_kinds = frozenset({LayerKind.MAMBA2})
    capabilities = capabilities(ON_ENGINE, chunked_prefill=supported(), prefix_caching=supported(),
                                tensor_parallel=supported(),
                                pipeline_parallel=supported(), lora=supported())
    implementation = "runtime.models.mamba2.model:Mamba2ForCausalLM"
    quantizations = ("gguf",)
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
    def dims(cls, cfg: HFConfig) -> Mamba2Dims:
        return read_dims(Mamba2Dims, cfg)

    @classmethod
    def mamba_state_shape(cls, cfg: HFConfig, tp: int) -> tuple[tuple[int, ...], ...]:
        dims = cls.dims(cfg)
        return mamba2_state_shape(cls.architecture, d_inner=dims.d_inner, n_heads=dims.num_heads,
                                  head_dim=dims.head_dim, n_groups=dims.n_groups, d_state=dims.state_size,
                                  d_conv=dims.conv_kernel, tp=tp)

    @classmethod
    def mamba_chunk_size(cls, cfg: HFConfig) -> int:
        return cls.dims(cfg).chunk_size
