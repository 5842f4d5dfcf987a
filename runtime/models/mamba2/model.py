from __future__ import annotations

from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.norm import RMSNorm
from runtime.models.backbone import BackboneForCausalLM, MixerBlock
from runtime.models.mamba2.declaration import Mamba2Dims


def mamba2_mixer(config: Mamba2Dims, layer_idx: int, eps: float) -> Mamba2Mixer:
    return Mamba2Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=config.d_inner,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        n_groups=config.n_groups,
        d_state=config.state_size,
        d_conv=config.conv_kernel,
        conv_bias=config.use_conv_bias,
        proj_bias=config.use_bias,
        eps=eps,
        dt_limit=config.time_step_limit,
    )


class Mamba2ForCausalLM(BackboneForCausalLM):
    def __init__(self, config: Mamba2Dims):
        eps = config.layer_norm_epsilon
        layers = (MixerBlock(RMSNorm(config.hidden_size, eps), mamba2_mixer(config, i, eps), config.residual_in_fp32)
                  for i in range(config.num_hidden_layers))
        super().__init__(config, layers, RMSNorm(config.hidden_size, eps))
