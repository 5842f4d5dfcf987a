"""LoRA adapters as PEFT saves them, served many at once: see docs/features/lora.md."""

from runtime.lora.request import LoRARequest

__all__ = ["LoRARequest"]
