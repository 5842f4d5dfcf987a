"""Tandem: a runtime for hybrid attention/state-space (Mamba) language models.

`from runtime import LLM, SamplingParams` is the public surface. The names are
resolved lazily so that declarations and `tandem plan` never import torch.
"""

from __future__ import annotations

import importlib
import os

# OpenMP threads that spin while they wait take the cores they share with other processes: on a
# busy machine two spinning threads ran a step 10-30x slower than passive ones (docs/performance.md).
# libgomp reads this when torch loads, so it holds when Tandem is imported first (the CLI always is).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

_LOCATIONS = {"LLM": "runtime.llm", "SamplingParams": "runtime.sampling_params", "RequestOutput": "runtime.outputs",
              "CompletionOutput": "runtime.outputs", "Logprob": "runtime.outputs"}


def __getattr__(name: str):
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
