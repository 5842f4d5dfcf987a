"""One request must never hurt another: values that cannot be sampled are normalised or refused as vLLM
does, and a request whose sampling still fails ends alone (finish reason "error") while the others in its
step get exactly the tokens they get alone."""

import math

import pytest

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.engine import Engine

PROMPTS = ["The page pool", "A hybrid model mixes attention with", "Numbers like 1, 2, 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("bamba")[0], dtype="float32")


def run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_a_request_whose_sampling_fails_ends_alone(tiny_checkpoint):
    # max_logprobs is raised past the vocabulary, so that the poison passes validation and fails in the
    # sampler (top-k of more tokens than there are), in the same step as its victims.
    engine = Engine(EngineConfig(str(tiny_checkpoint("bamba")[0]), dtype="float32", max_logprobs=10**6))
    victims = [(PROMPTS[0], GREEDY), (PROMPTS[1], SEEDED)]
    alone = [run(engine, [victim])[0] for victim in victims]
    poison = (PROMPTS[2], SamplingParams(max_tokens=8, logprobs=10**6))
    together = run(engine, [victims[0], poison, victims[1]])
    assert [o.outputs[0].token_ids for o in (together[0], together[2])] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].finish_reason for o in together] == ["length", "error", "length"]
    assert together[1].finished and "selected index k out of range" in together[1].error
    assert together[0].error is None
    stats = engine.stats()
    assert stats.num_pages_used == 0 and stats.finished["error"] == 1
    assert not engine.has_unfinished()


@pytest.mark.parametrize("poison", [
    SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=1e-300, seed=5, max_tokens=8, ignore_eos=True),
], ids=["temperature 1e-40 is greedy", "top_p 1e-300 keeps the top token"])
def test_values_that_cannot_be_computed_are_normalised(llm, poison):
    greedy = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    victim_alone = llm.generate(PROMPTS[1], SEEDED, use_tqdm=False)[0].outputs[0]
    victim, poisoned = llm.generate([PROMPTS[1], PROMPTS[2]], [SEEDED, poison], use_tqdm=False)
    assert victim.outputs[0].token_ids == victim_alone.token_ids
    assert poisoned.outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert poisoned.outputs[0].finish_reason == "length"


def test_temperature_below_the_epsilon_is_greedy():
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
def test_a_temperature_that_is_not_a_finite_non_negative_number_is_refused(value):
    with pytest.raises(ValueError, match="temperature must be non-negative and finite"):
        SamplingParams(temperature=value)


def test_more_logprobs_than_max_logprobs_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="logprobs=5000 is more than max_logprobs=20"):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(logprobs=5000)], use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.stats().num_pages_used == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_min_tokens_bans_the_stops_until_reached(tiny_checkpoint, dtype):
    llm = LLM(tiny_checkpoint("bamba")[0], dtype=dtype)
    free = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[0]
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    unbanned = llm.generate(PROMPTS[0], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert unbanned.token_ids == [stop] and unbanned.finish_reason == "stop"
    banned = llm.generate(PROMPTS[0], SamplingParams(**params, min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert stop not in banned.token_ids[:3] and len(banned.token_ids) >= 3
    sampled = llm.generate(PROMPTS[0], SamplingParams(**{**params, "temperature": 1.0}, seed=3, min_tokens=3),
                           use_tqdm=False)[0].outputs[0]
    assert stop not in sampled.token_ids[:3] and len(sampled.token_ids) >= 3
