"""Input that used to get through (issue 31): values that overflowed the sampler, constraints that ban every
token, arguments of the wrong kind. Each is either computed safely or refused up front with a ValueError
naming the argument; a request that still fails logs one line, not a traceback."""

import logging
import math

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.sampler import Sampler, SamplingError

PROMPT = "The page pool holds the pages of every sequence"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("bamba")[0], dtype="float32")


@pytest.mark.parametrize("penalty", [1e-38, 1e-45, 1e-300, 1e38])
@pytest.mark.parametrize("temperature", [0.0, 1e-4, 1.0])
def test_an_extreme_repetition_penalty_samples(llm, penalty, temperature):
    # 10 / 1e-38 is inf in float32, and the softmax of inf is nan: the request used to fail with a 500.
    params = SamplingParams(repetition_penalty=penalty, temperature=temperature, seed=3, max_tokens=6,
                            ignore_eos=True)
    output = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert output.error is None and output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 6


def test_a_tiny_repetition_penalty_favours_the_tokens_already_seen(llm):
    # The limit of a vanishing penalty: every seen token with a positive logit outweighs every unseen one.
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(repetition_penalty=1e-38, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 8
    seen = set(prompt_ids)
    for token in output.token_ids:
        assert token in seen
        seen.add(token)


def test_constraints_that_ban_every_token_are_refused_up_front(llm):
    eos = llm.get_tokenizer().eos_token_id
    for params in (SamplingParams(allowed_token_ids=[eos], min_tokens=1, temperature=0),
                   SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=2, seed=1)):
        with pytest.raises(ValueError, match=r"allowed_token_ids \[.*\] are all end-of-sequence or stop tokens, "
                                             r"which min_tokens=\d bans"):
            llm.generate(PROMPT, params, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.stats().num_pages_used == 0
    # Once min_tokens is 0, or EOS is not a stop (ignore_eos), the allowed token can be generated.
    for params in (SamplingParams(allowed_token_ids=[eos], temperature=0, max_tokens=3),
                   SamplingParams(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True, temperature=0, max_tokens=3)):
        output = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert set(output.token_ids) == {eos}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_token_left_fails_instead_of_emitting_a_banned_token(temperature):
    # Only the model's own logits can get here (the constraints are checked up front); greedy used to pick
    # token 0, which the row had banned.
    logits = torch.randn(2, 32)
    params = [SamplingParams(temperature=temperature)] * 2
    banned = [[], list(range(32))]
    with pytest.raises(SamplingError, match="no token can be generated"):
        Sampler()(logits, params, [None, None], banned)
    assert Sampler()(logits, params, [None, None], [[], []]).token_ids[0] in range(32)


def test_a_failed_request_logs_one_line_and_its_traceback_at_debug_level(tiny_checkpoint, caplog):
    # As in test_isolation: max_logprobs past the vocabulary lets a poison reach the sampler and fail there.
    engine = Engine(EngineConfig(str(tiny_checkpoint("bamba")[0]), dtype="float32", max_logprobs=10**6))
    poisons = [engine.add_request(PROMPT, SamplingParams(max_tokens=4, logprobs=10**6)) for _ in range(3)]
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0))
    with caplog.at_level(logging.DEBUG, logger="tandem"):
        while engine.has_unfinished():
            engine.step()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(r.getMessage().split(":")[0] for r in warnings) == sorted(f"request {p} failed" for p in poisons)
    assert all(r.exc_info is None for r in warnings)
    assert any(r.exc_info is not None and r.levelno == logging.DEBUG for r in caplog.records)


@pytest.mark.parametrize("prompts, params, words", [
    (None, None, "prompts must be a string, a {\"prompt_token_ids\": [...]} dict, or a list of them, got None"),
    (5, None, "prompts must be a string"),
    ("x", "temperature=0", "sampling_params must be a SamplingParams, a list of them, or None, got 'temperature=0'"),
    ("x", {"temperature": 0}, "sampling_params must be a SamplingParams"),
])
def test_generate_names_the_argument_of_the_wrong_kind(llm, prompts, params, words):
    with pytest.raises(ValueError) as raised:
        llm.generate(prompts, params, use_tqdm=False)
    assert words in str(raised.value)


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf, "5"])
def test_a_logit_bias_that_is_not_a_finite_number_is_refused_not_clamped(bias):
    # The finiteness check ran after the clamp: nan became -100 and inf 100.
    with pytest.raises(ValueError, match="logit_bias values must be finite numbers, got"):
        SamplingParams(logit_bias={5: bias})
    assert SamplingParams(logit_bias={5: 1e9}).logit_bias == {5: 100.0}


@pytest.mark.parametrize("field, value, words", [
    ("temperature", "0", "temperature must be a number, got '0' (str)"),
    ("top_p", None, "top_p must be a number, got None"),
    ("n", 2.0, "n must be an integer, got 2.0 (float)"),
    ("max_tokens", "16", "max_tokens must be an integer or None, got '16' (str)"),
    ("seed", True, "seed must be an integer or None, got True (bool)"),
])
def test_a_field_of_the_wrong_type_is_a_value_error_naming_it(field, value, words):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value).startswith(words)
