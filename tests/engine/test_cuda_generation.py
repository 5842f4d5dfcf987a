"""On a CUDA device the whole engine on the compiled Triton kernels gives the torch references' tokens,
and HF's (skipped without CUDA; tests/conftest.py compiles the kernels whenever CUDA is there).

Small token budgets split prefills across Mamba chunks and attention pages, and mix them with decodes.
"""

import pytest
import torch
from tiny_models import hf_greedy_logprobs

from runtime import LLM, SamplingParams, kernels
from runtime.kernels._triton_utils import interpreting

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(interpreting(), reason="compiled kernels: TRITON_INTERPRET=0")]

PROMPTS = [
    "The",
    "A hybrid model mixes attention layers with state-space layers.",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches prefills "
    "and decodes, and preempts when pages run out.",
]
NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


@pytest.fixture
def restore_backend():
    yield
    # Later tests build engines on CPU, whose references must not be left rebound.
    kernels.bind("torch", torch.device("cpu"))


def generate(directory, backend):
    llm = LLM(directory, dtype="float32", device="cuda", kernel_backend=backend, max_num_batched_tokens=21)
    assert llm.engine.runner.kernel_backend == kernels.backend == backend
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "nemotron_h", "zamba2", "jamba", "mamba"])
def test_triton_on_cuda_gives_the_torch_and_hf_tokens(tiny_checkpoint, restore_backend, name):
    directory, hf = tiny_checkpoint(name)
    expected = generate(directory, "torch")
    got = generate(directory, "triton")
    for ours, reference in zip(got, expected):
        tokens, logprobs = hf_greedy_logprobs(hf, ours.prompt_token_ids, NEW_TOKENS)
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids == tokens, name
        for step, top in enumerate(ours.outputs[0].logprobs):
            ids = sorted(top)
            # Compiled kernels sum in another order than the references: float32 rounding, not 1e-4 of HF.
            got = torch.tensor([top[t].logprob for t in ids])
            torch.testing.assert_close(got, logprobs[step, ids], atol=1e-3, rtol=0)
