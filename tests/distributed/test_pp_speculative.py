"""Speculative decoding through the stages: a verify step is an ordinary step with a row of logits per draft
(the plan carries the drafts to every stage; the drafts' checkpoint and restore copies reach every stage's
own slabs of the pages), so PP=2 gives one device's tokens and logprobs, drafts accepted and rejected."""

import pytest

from runtime import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPTS = [{"prompt_token_ids": [9, 40, 41, 200, 7] * 3}, {"prompt_token_ids": [77, 78, 79] * 4},
           {"prompt_token_ids": list(range(100, 120))}]
FEW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, allowed_token_ids=[9, 40, 41])
FREE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PARAMS = [FEW, FEW, FREE]


@pytest.mark.parametrize("name", ["bamba", "llama"])
def test_pp2_verify_steps_equal_one_device(tiny_checkpoint, name):
    directory, _ = tiny_checkpoint(name)
    reference = LLM(directory, dtype="float32", enforce_eager=True).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=2, speculative_config=SPEC)
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        counters = llm.engine.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # accepted and rejected drafts
    finally:
        llm.engine.shutdown()
    for got, want in zip(outputs, reference):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        assert (got.logprobs is None) == (want.logprobs is None)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(got.logprobs or [], want.logprobs or [])
                   for t in a)
