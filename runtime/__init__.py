"""Tandem: a runtime for hybrid attention/state-space (Mamba) language models.

`from runtime import LLM, SamplingParams` is the public surface. The names are
resolved lazily so that declarations and `tandem plan` never import torch.
"""

from __future__ import annotations

import importlib
import os

# How long an idle OpenMP thread spins before it sleeps. libgomp's default (300,000 spins) took the
# cores a busy machine shares with other processes: a step ran 10-30x slower. Not spinning at all
# (OMP_WAIT_POLICY=PASSIVE, the earlier default) pays a futex wake-up between every two ops: on an
# idle machine decode steps took 1.5x as long, the shipped model's 32 tokens 2.5x. A short spin spans
# the gap between ops and gives the core back soon after (docs/performance.md). libgomp reads this
# when torch loads, so it holds when Tandem is imported first (the CLI always is); a policy the
# environment sets is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StructuredOutputsParams",
           "LoRARequest"]

_LOCATIONS = {"LLM": "runtime.llm", "SamplingParams": "runtime.sampling_params", "RequestOutput": "runtime.outputs",
              "CompletionOutput": "runtime.outputs", "Logprob": "runtime.outputs",
              "StructuredOutputsParams": "runtime.structured_outputs", "LoRARequest": "runtime.lora.request"}


def __getattr__(name: str):
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
