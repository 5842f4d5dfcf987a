"""Drive one of the engine's own mixer modules as the runner does: packed steps, decodes first, inside a
ForwardContext, on state pools that start as NaN (so a state read before it is written shows)."""

from __future__ import annotations

import torch

from runtime.context import ForwardContext, forward_context
from runtime.kernels import build_mamba_prefill_metadata
from runtime.models import resolve


def engine_dims(config):
    """The frozen dimensions the engine builds its modules from, read from `config` as from its config.json."""
    declaration = resolve(type(config).__name__.removesuffix("Config") + "ForCausalLM")
    return declaration.dims(declaration.read_config(config.to_dict()))


class PackedMixer:
    def __init__(self, mixer: torch.nn.Module, num_slots: int, chunk_size: int) -> None:
        self.mixer, self.chunk_size = mixer, chunk_size
        conv_shape, ssm_shape = mixer.state_shapes()
        self.conv_states = torch.full((num_slots, *conv_shape), float("nan"))
        self.ssm_states = torch.full((num_slots, *ssm_shape), float("nan"))
        mixer.bind(0, self.conv_states, self.ssm_states)

    def step(self, decodes=(), prefills=()) -> torch.Tensor:
        """decodes: [(slot, hidden (H,))]; prefills: [(slot, hidden (T, H), tokens already cached)].

        Returns the mixer's output rows in the packed order: decodes, then each prefill's tokens.
        """
        rows = [hidden[None] for _, hidden in decodes] + [hidden for _, hidden, _ in prefills]
        meta = None
        if prefills:
            meta = build_mamba_prefill_metadata([len(h) for _, h, _ in prefills], [start for _, _, start in prefills],
                                                self.chunk_size, "cpu")
        slots = lambda items: torch.tensor([item[0] for item in items], dtype=torch.long)  # noqa: E731
        context = ForwardContext(
            num_decodes=len(decodes), num_prefill_tokens=sum(len(h) for _, h, _ in prefills), attention=None,
            block_tables=(), slot_mappings=(), mamba_prefill=meta, decode_state_indices=(slots(decodes),),
            prefill_state_indices=(slots(prefills),),
        )  # fmt: skip
        with forward_context(context):
            return self.mixer(torch.cat(rows))
