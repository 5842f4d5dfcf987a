"""Speculative decoding with a draft model and with an MTP head under tensor and pipeline parallelism: the
proposer runs unsharded in rank 0's process (the draft model on one device, as vLLM's
draft_tensor_parallel_size=1; the MTP head on the hidden states rank 0 holds whole after the all-reduce),
the model verifies across the group. Float32 greedy tokens and logprobs equal one device without
speculation, with drafts accepted and rejected. One group of two processes serves every engine here."""

import pytest
from spec_helpers import ATTENTION_LAYER, add_mtp_head, assert_drafts_accepted_and_rejected, perturbed_copy
from tiny_models import build_deltanet_model

from runtime import LLM, SamplingParams
from runtime.distributed import group

PROMPTS = [{"prompt_token_ids": [9, 40, 41, 200, 7] * 3}, {"prompt_token_ids": [77, 78, 79] * 4},
           {"prompt_token_ids": list(range(100, 130))}]
FEW = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, allowed_token_ids=[9, 40])
FREE = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
PARAMS = [FEW, FREE, FREE]
BUDGET = 16  # the 30-token prompt is prefilled in two chunks beside the others' verifies


@pytest.fixture(scope="module", autouse=True)
def shared_group():
    yield
    group.shutdown()


def generate(directory, **options):
    """The outputs and the speculator's counters of one engine (shut down after, so the group serves the next)."""
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=BUDGET, **options)
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        if "speculative_config" in options:
            assert_drafts_accepted_and_rejected(llm)
        return outputs
    finally:
        llm.engine.shutdown()


def assert_same(outputs, reference):
    for got, want in zip(outputs, reference):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


# A draft model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bamba(tiny_checkpoint, tmp_path_factory):
    """A hybrid target and a draft of its own architecture (stateful: it rolls its own cache back)."""
    target = tiny_checkpoint("bamba")[0]
    return target, perturbed_copy(target, tmp_path_factory.mktemp("bamba") / "draft")


@pytest.fixture(scope="module")
def bamba_reference(bamba):
    return generate(bamba[0])


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_draft_model_beside_a_parallel_model(bamba, bamba_reference, parallel):
    target, draft = bamba
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    assert_same(generate(target, speculative_config=spec, **{parallel: 2}), bamba_reference)
