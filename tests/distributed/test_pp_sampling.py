"""Sampling on the last stage: for a step whose tokens are plain greedy picks, the last stage sends rank 0 the
token ids (8 bytes a sequence) instead of the logits (4 bytes a vocabulary entry); any request whose sampling
reads the logits' values (logprobs, penalties, bans, temperature, ...) makes its step send the logits. The
tokens and logprobs equal one device's either way."""

import pytest
from pp_helpers import PROMPTS, STEP_TOKENS

from runtime import LLM, SamplingParams
from runtime.distributed import group, state

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def generate(directory, pp, params):
    """Outputs of PROMPTS (one SamplingParams per prompt), and what rank 0 received from the last stage."""
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=pp, max_num_batched_tokens=STEP_TOKENS)
    try:
        with state.record() as stats:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return outputs, stats, llm.engine.runner.model.config.vocab_size
    finally:
        llm.engine.shutdown()


def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_steps_receive_token_ids_not_logits(tiny_checkpoint):
    directory, _ = tiny_checkpoint("bamba")
    params = [SamplingParams(**GREEDY)] * len(PROMPTS)
    pp2, stats, vocab = generate(directory, 2, params)
    pp1, _, _ = generate(directory, 1, params)
    assert tokens(pp2) == tokens(pp1)
    steps = stats.counts["recv"]
    # At most one id per prompt a step; the logits of one row alone are vocab * 4 bytes.
    assert steps > 0 and stats.bytes["recv"] <= 8 * len(PROMPTS) * steps < 4 * vocab


@pytest.mark.parametrize("extra", [
    dict(logprobs=2), dict(repetition_penalty=1.5), dict(min_tokens=4, stop_token_ids=[0, 1, 2, 3]),
    dict(logit_bias={5: 30.0}), dict(allowed_token_ids=[7, 8, 9]), dict(temperature=0.8, seed=3),
], ids=["logprobs", "penalty", "min_tokens", "logit_bias", "allowed", "seeded"])
def test_a_request_that_reads_the_logits_gets_them(tiny_checkpoint, extra):
    """One such request among plain greedy ones: its steps carry the logits, and every request's tokens (and
    logprobs) equal one device's."""
    directory, _ = tiny_checkpoint("bamba")
    params = [SamplingParams(**{**GREEDY, **extra})] + [SamplingParams(**GREEDY)] * (len(PROMPTS) - 1)
    pp2, stats, vocab = generate(directory, 2, params)
    pp1, _, _ = generate(directory, 1, params)
    assert tokens(pp2) == tokens(pp1)
    # The first request's steps received logits: all 8, or the 4 that min_tokens bans the stop tokens in.
    assert stats.bytes["recv"] >= 4 * vocab * 4
    ours, theirs = pp2[0].outputs[0].logprobs, pp1[0].outputs[0].logprobs
    assert (ours is None) == (theirs is None)
    for a, b in zip(ours or [], theirs or []):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
