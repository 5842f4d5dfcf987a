"""Speculative decoding with a draft model and with an MTP head under tensor and pipeline parallelism: the
proposer runs unsharded in rank 0's process (the draft model on one device, as vLLM's
draft_tensor_parallel_size=1; the MTP head on the final hidden states rank 0 holds whole after the
all-reduce, or receives from the last pipeline stage), the model verifies across the group. Float32 greedy
tokens and logprobs equal one device without speculation, with drafts accepted and rejected, again from the
prefix cache, and under preemption. One group of two processes serves every engine here."""

import pytest
from spec_helpers import (ATTENTION_LAYER, add_mtp_head, assert_drafts_accepted_and_rejected, assert_same_outputs,
                          perturbed_copy)
from tiny_models import build_deltanet_model

from runtime import LLM, SamplingParams
from runtime.distributed import group

PROMPTS = [{"prompt_token_ids": [9, 40, 41, 200, 7] * 3}, {"prompt_token_ids": [77, 78, 79] * 4},
           {"prompt_token_ids": list(range(100, 170))}]
FEW = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, allowed_token_ids=[9, 40])
FREE = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
PARAMS = [FEW, FREE, FREE]
# The 70-token prompt is prefilled in chunks beside the others' verifies, and is longer than a prefix-cache
# block (48 tokens for Bamba, 64 for Qwen3.5): the second time, its first block is read from the cache.
BUDGET = 24


def generate(directory, **options):
    """One engine's outputs (shut down after, so that the group serves the next engine)."""
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=BUDGET, **options)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def speculate(directory, spec, **parallel):
    """The outputs of a speculating engine, twice: the second time its prompts are read from the prefix cache."""
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=BUDGET, enable_prefix_caching=True,
              speculative_config=spec, **parallel)
    try:
        first = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        again = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert again[2].num_cached_tokens > 0
        assert_drafts_accepted_and_rejected(llm)
        return first, again
    finally:
        llm.engine.shutdown()


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
    for outputs in speculate(target, spec, **{parallel: 2}):
        assert_same_outputs(outputs, bamba_reference)


# An MTP head ---------------------------------------------------------------------------------------

MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, tokenizer_dir):
    """Qwen3.5 with random `mtp.*` weights that guess right some of the time (tests/spec_decode/test_spec_mtp.py)."""
    directory = tmp_path_factory.mktemp("qwen3_5")
    build_deltanet_model("qwen3_5", directory, tokenizer_dir)
    layer, echo = ATTENTION_LAYER["qwen3_5"]
    add_mtp_head(directory, layer, echo=echo)
    return directory


@pytest.fixture(scope="module")
def qwen3_5_reference(qwen3_5):
    return generate(qwen3_5)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_an_mtp_head_beside_a_parallel_model(qwen3_5, qwen3_5_reference, parallel):
    for outputs in speculate(qwen3_5, MTP, **{parallel: 2}):
        assert_same_outputs(outputs, qwen3_5_reference)


# Preemption ----------------------------------------------------------------------------------------

SHORT = [{"prompt_token_ids": [9, 40, 41, 200, 7] * 3}, {"prompt_token_ids": [77, 78, 79] * 4},
         {"prompt_token_ids": list(range(100, 120))}]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("method, parallel", [("draft", "tensor_parallel_size"), ("mtp", "pipeline_parallel_size")])
def test_preemption_beside_a_parallel_model(bamba, qwen3_5, method, parallel):
    """A pool that holds one sequence of 64 tokens and the states of a second (less a page where blocks and
    states share one), as tests/spec_decode/test_spec_mtp.py's: sequences are preempted and recomputed, and the
    proposer's cache of them (the draft's pool, the head's K and V) is rebuilt."""
    from runtime.config import EngineConfig

    directory, spec = (bamba[0], {"model": str(bamba[1]), "num_speculative_tokens": 3}) if method == "draft" \
        else (qwen3_5, MTP)
    reference = LLM(directory, dtype="float32").generate(SHORT, LONG, use_tqdm=False)
    layout = EngineConfig(str(directory), dtype="float32").cache
    groups = layout.num_state_groups
    pages = layout.pages_per_sequence(64) + 2 * groups - (1 if layout.block_size and groups else 0)
    llm = LLM(directory, dtype="float32", speculative_config=spec, max_model_len=64, num_pages=pages, max_num_seqs=2,
              **{parallel: 2})
    try:
        outputs = llm.generate(SHORT, LONG, use_tqdm=False)
        assert sum(o.num_preemptions for o in outputs) > 0
        assert_drafts_accepted_and_rejected(llm)
    finally:
        llm.engine.shutdown()
    assert_same_outputs(outputs, reference)
