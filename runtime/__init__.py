"""Tandem: a runtime for hybrid attention/state-space (Mamba) language models.

`from runtime import LLM, SamplingParams` is the public surface. The names are
resolved lazily so that declarations and `tandem plan` never import torch.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
