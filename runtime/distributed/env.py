"""What torchrun tells a process about its place in the group (environment only; no torch)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def torchrun_rank() -> int:
    """This process's global rank under torchrun; 0 when not under torchrun."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0


def local_rank() -> int:
    """This process's rank on its machine (its GPU index); 0 when not under torchrun."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) if under_torchrun() else 0
