"""Speculation with captured steps (verify steps are captured and replayed as decode steps are) and tensor
parallelism (the plan, drafts included, goes to every rank; the copies of kept states too)."""

import pytest

from runtime import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPTS = [{"prompt_token_ids": [9, 40, 41, 200, 7] * 3}, {"prompt_token_ids": [77, 78, 79] * 4},
           {"prompt_token_ids": list(range(100, 120))}]
FEW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, allowed_token_ids=[9, 40, 41])
FREE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
PARAMS = [FEW, FEW, FREE]


def assert_same(outputs, reference):
    for got, want in zip(outputs, reference):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(got.logprobs, want.logprobs) for t in a)


@pytest.fixture(scope="module")
def bamba(tiny_checkpoint):
    return tiny_checkpoint("bamba")[0]


@pytest.fixture(scope="module")
def reference(bamba):
    return LLM(bamba, dtype="float32", enforce_eager=True).generate(PROMPTS, PARAMS, use_tqdm=False)


def test_captured_verify_and_decode_steps_replay(bamba, reference):
    llm = LLM(bamba, dtype="float32", speculative_config=SPEC)
    graphs = llm.engine.runner.graphs
    if graphs is None:
        pytest.skip("no captured decode steps here (the native CPU library is not built)")
    assert_same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    assert not graphs.disabled
    # Keys: a decode step's batch size, a verify's rows per sequence (1 + its drafts, longest first).
    verifies = [key for key in graphs.replays if isinstance(key, tuple)]
    decodes = [key for key in graphs.replays if isinstance(key, int)]
    assert verifies and decodes, graphs.replays
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # drafts kept and drafts rolled back


def test_tensor_parallel_verify_steps(bamba, reference):
    llm = LLM(bamba, dtype="float32", tensor_parallel_size=2, speculative_config=SPEC)
    try:
        assert_same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
        counters = llm.engine.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    finally:
        llm.engine.shutdown()
