"""The adapters an engine knows: checked copies in CPU memory (LRU, max_cpu_loras) and a fixed pool of
max_loras slots on the device (LRU), filled by the steps that need them.

A request's adapter is read and checked when the request is added (a bad one is refused then, before
anything is queued); a step maps each sequence's adapter to a slot, loading it (from the CPU copy, or
from disk again if the copy was evicted) into the slot its least recently used, unneeded adapter held.
Every tensor-parallel rank runs the same steps in the same order, so every rank picks the same slots.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from runtime.lora.adapter import Adapter, read_adapter
from runtime.lora.layer import LoRALinear, wrap_linears
from runtime.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 model_dtype: torch.dtype = torch.float32):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras
        self.layers: dict[str, LoRALinear] = wrap_linears(model, max_loras, max_rank, model_dtype)
        self.cpu: OrderedDict[int, Adapter] = OrderedDict()  # id -> checked adapter
        # request -> slot, least recently used first. Keyed by the whole request, not its id, and never changed
        # but by steps: tensor-parallel ranks see the same steps (not the same remove calls), so pick the same slots.
        self.slots: OrderedDict[LoRARequest, int] = OrderedDict()
        self.num_loads = 0  # adapters written into slots (tests and the bench read it)
        # A pipeline stage holds its own layers' linears: the other stages' part of an adapter is theirs.
        stage = getattr(model, "stage_model", None)
        self.elsewhere = frozenset(n.removesuffix(".weight") for n in set(stage.full_names.values()) - set(stage.holds)
                                   ) if stage is not None else frozenset()

    @property
    def zero_slot(self) -> int:
        return self.max_loras

    def add(self, request: LoRARequest) -> Adapter:
        """Read and check the adapter (ValueError naming it when it does not fit), and keep it in CPU memory."""
        cached = self.cpu.get(request.lora_int_id)
        if cached is not None and cached.request == request:
            self.cpu.move_to_end(request.lora_int_id)
            return cached
        adapter = read_adapter(request, self.model.checkpoint_name, self.layers, self.max_rank, self.elsewhere)
        self.remove(request.lora_int_id)  # the id named another directory: that one is gone
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)  # a step that needs it reads it from disk again
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget the checked copy; its slot goes when it is the least recently used one."""
        self.cpu.pop(lora_id, None)

    def indices(self, loras: list[LoRARequest | None], counts: list[int], device: torch.device) -> torch.Tensor | None:
        """(T,) slot per token row of a step whose sequences carry `loras` and compute `counts` tokens; None
        when no sequence has an adapter."""
        if not any(loras):
            return None
        wanted = dict.fromkeys(r for r in loras if r is not None)  # in batch order: the same on every rank
        assert len(wanted) <= self.max_loras, "the scheduler admits at most max_loras adapters"
        slot_of = {r: self._activate(r, wanted) for r in wanted}
        rows = [slot_of[r] if r is not None else self.zero_slot for r in loras]
        return torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor(counts)).to(device)

    def _activate(self, request: LoRARequest, wanted: dict[LoRARequest, None]) -> int:
        slot = self.slots.get(request)
        if slot is not None:
            self.slots.move_to_end(request)
            return slot
        adapter = self.add(request)
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slots if i not in wanted)
            slot = self.slots.pop(victim)
        self._write(slot, adapter)
        self.slots[request] = slot
        self.num_loads += 1
        return slot

    def _write(self, slot: int, adapter: Adapter | None) -> None:
        modules: dict[str, Any] = adapter.modules if adapter is not None else {}
        for name, layer in self.layers.items():
            layer.load_slot(slot, modules.get(name))

    def slot_bytes(self) -> int:
        return sum(layer.slot_bytes() for layer in self.layers.values())
