"""Sampling options behave as vLLM's do.

Sampled distributions, seeds, EOS from generation_config.json, min_tokens and stop strings spanning
two tokens are checked against HF's logits in test_sampling_oracle.py.
"""

import math

import pytest

from runtime import LLM, SamplingParams

PROMPTS = ["The page pool", "A hybrid model mixes attention with"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("bamba")[0], dtype="float32")


def generate(llm, params, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = generate(llm, params, PROMPTS[:1])[0].token_ids
    batched = generate(llm, [params, SamplingParams(temperature=1.0, seed=3, max_tokens=12)])[0].token_ids
    assert alone == batched == generate(llm, params, PROMPTS[:1])[0].token_ids


def test_top_k_1_is_greedy(llm):
    greedy = generate(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top1 = generate(llm, SamplingParams(temperature=2.0, top_k=1, seed=1, max_tokens=10, ignore_eos=True))
    assert [g.token_ids for g in greedy] == [t.token_ids for t in top1]


def test_tiny_top_p_is_greedy(llm):
    greedy = generate(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    nucleus = generate(llm, SamplingParams(temperature=1.0, top_p=1e-6, seed=1, max_tokens=10, ignore_eos=True))
    assert [g.token_ids for g in greedy] == [t.token_ids for t in nucleus]


def test_max_tokens_and_length_reason(llm):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out)


def test_stop_token_ids(llm):
    free = generate(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), PROMPTS[:1])[0]
    stop_at = free.token_ids[3]
    out = generate(llm, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True),
                   PROMPTS[:1])[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_logprobs(llm):
    out = generate(llm, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), PROMPTS[:1])[0]
    assert len(out.logprobs) == 4
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in top and len(top) == 3  # greedy: the sampled token is the top one
        assert max(lp.logprob for lp in top.values()) == top[token].logprob <= 0 and top[token].rank == 1
    assert math.isclose(out.cumulative_logprob, sum(top[t].logprob for t, top in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1), "temperature must be non-negative"),
        (dict(top_p=0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(top_k=-5), "top_k"),
        (dict(stop=[""]), "stop strings must not be empty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
