"""`LoRARequest`, shaped like vLLM's `vllm.lora.request.LoRARequest`. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request: its name (what a server's clients send as `model`), a positive integer id
    unique to the adapter (prefix caching and the slot pool key on it), and the PEFT directory to load."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                             f"got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
