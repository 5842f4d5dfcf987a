from __future__ import annotations

from runtime.layers.mamba1 import Mamba1Mixer
from runtime.layers.norm import RMSNorm
from runtime.models.backbone import BackboneForCausalLM, MixerBlock
from runtime.models.falcon_mamba.declaration import FalconMambaDims


def falcon_mamba_mixer(dims: FalconMambaDims, layer_idx: int) -> Mamba1Mixer:
    return Mamba1Mixer(
        layer_idx,
        hidden_size=dims.hidden_size,
        d_inner=dims.d_inner,
        d_state=dims.d_state,
        d_conv=dims.d_conv,
        dt_rank=dims.dt_rank,
        conv_bias=dims.conv_bias,
        proj_bias=dims.proj_bias,
        dt_bc_norm_eps=dims.mixer_rms_eps,
        dt_bc_norm_weights=False,
    )


class FalconMambaForCausalLM(BackboneForCausalLM):
    """HF's Mamba layout (`backbone.*`, `lm_head`) with FalconMamba's mixers."""

    def __init__(self, dims: FalconMambaDims):
        layers = (MixerBlock(RMSNorm(dims.hidden_size, dims.norm_eps), falcon_mamba_mixer(dims, i),
                             dims.residual_in_fp32) for i in range(dims.num_layers))
        super().__init__(dims, layers, RMSNorm(dims.hidden_size, dims.norm_eps))
