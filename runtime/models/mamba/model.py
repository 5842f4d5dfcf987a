from __future__ import annotations

from runtime.layers.mamba1 import Mamba1Mixer
from runtime.layers.norm import RMSNorm
from runtime.models.backbone import BackboneForCausalLM, MixerBlock
from runtime.models.mamba.declaration import MambaDims

# The conv kernels apply SiLU; HF's Mamba-1 mixers take the conv activation from hidden_act.
CONV_ACTIVATIONS = ("silu", "swish")


def check_conv_activation(config: object) -> None:
    if config.hidden_act not in CONV_ACTIVATIONS:
        raise ValueError(
            f"hidden_act={config.hidden_act!r} is not supported by the Mamba-1 conv; "
            f"Tandem runs {' or '.join(CONV_ACTIVATIONS)} (the value every published checkpoint uses)"
        )


def mamba1_mixer(config: MambaDims, layer_idx: int) -> Mamba1Mixer:
    check_conv_activation(config)
    return Mamba1Mixer(
        layer_idx,
        hidden_size=config.hidden_size,
        d_inner=config.intermediate_size,
        d_state=config.state_size,
        d_conv=config.conv_kernel,
        dt_rank=config.time_step_rank,
        conv_bias=config.use_conv_bias,
        proj_bias=config.use_bias,
    )


class MambaForCausalLM(BackboneForCausalLM):
    def __init__(self, config: MambaDims):
        eps = config.layer_norm_epsilon
        layers = (MixerBlock(RMSNorm(config.hidden_size, eps), mamba1_mixer(config, i), config.residual_in_fp32)
                  for i in range(config.num_hidden_layers))
        super().__init__(config, layers, RMSNorm(config.hidden_size, eps))
