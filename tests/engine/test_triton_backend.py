"""The whole engine on the Triton kernels (the interpreter on CPU) gives the torch references' greedy tokens.

A tiny Bamba (attention and Mamba-2 layers; 48-token pages, 16-token Mamba chunks) with a small
token budget, so prompts are prefilled in pieces that resume from cached state, cross pages and
chunks, and share steps with decodes.
"""

import pytest
import torch

from runtime import LLM, SamplingParams, kernels

PROMPTS = [
    "The",
    "A hybrid model mixes attention layers with state-space layers.",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches prefills "
    "and decodes, and preempts when pages run out.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def restore_backend():
    yield
    # Later tests build engines on CPU, whose references must not be left rebound.
    kernels.bind("torch", torch.device("cpu"))


def generate(directory, backend):
    llm = LLM(directory, dtype="float32", kernel_backend=backend, max_num_batched_tokens=24)
    assert llm.engine.runner.kernel_backend == kernels.backend == backend
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_triton_backend_gives_the_torch_tokens(tiny_checkpoint, restore_backend):
    directory, _ = tiny_checkpoint("bamba")
    expected = generate(directory, "torch")
    assert generate(directory, "triton") == expected
