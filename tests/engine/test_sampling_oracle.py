"""Sampling checked against an independent computation from HF's own logits.

For a seeded request the engine draws each token with `torch.multinomial` on a generator seeded
with the request's seed, one draw per step. The oracle here recomputes every step's distribution
from HF's logits (temperature, then top-k, then top-p over what top-k kept, as vLLM does), written
independently of runtime/sampler.py, and draws from it with a generator seeded the same way: the
tokens must be equal, draw for draw. Unseeded requests are checked by their statistics.
"""

import json
import math
import shutil

import pytest
import torch

from runtime import LLM, SamplingParams

PROMPT = "The page pool holds attention"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bamba(tiny_checkpoint):
    return tiny_checkpoint("bamba")


@pytest.fixture(scope="module")
def llm(bamba):
    return LLM(bamba[0], dtype="float32")


def hf_step_logits(hf, prompt_ids, tokens):
    """HF's logits for each new token of prompt + tokens (one forward over the whole text): (len(tokens), vocab)."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0].double()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)]


def oracle_probs(logits, temperature, top_k, top_p):
    """The sampling distribution, in float64, one token at a time in descending order."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    candidates = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in candidates)
    kept, cumulative = [], 0.0
    for t in candidates:
        if cumulative >= top_p:
            break
        kept.append(t)
        cumulative += probs[t].item() / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def oracle_tokens(hf, prompt_ids, engine_tokens, params):
    """The tokens the oracle draws, each from the distribution after the engine's tokens so far."""
    generator = torch.Generator().manual_seed(params.seed)
    logits = hf_step_logits(hf, prompt_ids, engine_tokens)
    drawn, supports = [], []
    for row in logits:
        probs = oracle_probs(row, params.temperature, params.top_k, params.top_p)
        drawn.append(torch.multinomial(probs.float(), 1, generator=generator).item())
        supports.append(set(probs.nonzero().flatten().tolist()))
    return drawn, supports, logits.log_softmax(dim=-1)


SAMPLED = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.9, top_k=20, top_p=0.8),
]


@pytest.mark.parametrize("options", SAMPLED, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_seeded_tokens_are_multinomial_draws_from_hf_probabilities(llm, bamba, options):
    hf = bamba[1]
    params = SamplingParams(**options, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    # Other requests in the same batch, sampled and greedy, draw from their own generators.
    others = [SamplingParams(temperature=1.0, seed=5, max_tokens=4), SamplingParams(temperature=0, max_tokens=6)]
    outputs = llm.generate([PROMPT, "A hybrid model", "The"], [params, *others], use_tqdm=False)
    prompt_ids, completion = outputs[0].prompt_token_ids, outputs[0].outputs[0]
    expected, supports, logprobs = oracle_tokens(hf, prompt_ids, completion.token_ids, params)
    assert completion.token_ids == expected
    assert all(t in support for t, support in zip(completion.token_ids, supports))
    # Sampling really happened: the draws are not the greedy continuation.
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert completion.token_ids != greedy
    # Logprobs at T > 0 are those of the model's own distribution (before temperature and filters, as vLLM's).
    for step, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert token in top and len(top) >= 3
        ids = sorted(top)
        torch.testing.assert_close(torch.tensor([top[t].logprob for t in ids], dtype=torch.float64),
                                   logprobs[step, ids], atol=1e-4, rtol=0)
    assert math.isclose(completion.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(completion.token_ids,
                                                                                 completion.logprobs)), rel_tol=1e-6)


def test_seeds_are_reproducible_and_different_seeds_differ(llm):
    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)
        return tuple(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)

    runs = [run(seed) for seed in range(6)]
    assert [run(seed) for seed in range(6)] == runs
    # Twelve draws each from a distribution of hundreds of tokens: six seeds give six sequences.
    assert len(set(runs)) == 6


def first_step_distribution(hf, llm, temperature, top_k, top_p):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    return oracle_probs(hf_step_logits(hf, prompt_ids, [0])[0], temperature, top_k, top_p)


@pytest.mark.parametrize("top_k, top_p", [(6, 1.0), (0, 0.5)])
def test_unseeded_draws_follow_the_distribution_and_never_leave_top_k_top_p(llm, bamba, top_k, top_p):
    draws = 600
    params = SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p, max_tokens=1, ignore_eos=True)
    tokens = [o.outputs[0].token_ids[0] for o in llm.generate([PROMPT] * draws, params, use_tqdm=False)]
    probs = first_step_distribution(bamba[1], llm, 1.5, top_k, top_p)
    support = set(probs.nonzero().flatten().tolist())
    assert 2 <= len(support) < 30
    assert set(tokens) <= support, "a token outside top-k / top-p was sampled"
    # Each kept token's frequency is within 5 standard deviations of its probability (a false
    # alarm has odds below 1e-5 per token); sampling at the wrong temperature or ignoring a
    # filter moves the large probabilities by far more than that.
    for token in support:
        p = probs[token].item()
        frequency = tokens.count(token) / draws
        assert abs(frequency - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (token, frequency, p)


def checkpoint_with_eos(bamba, tmp_path, eos):
    """A copy of the tiny checkpoint whose generation_config.json names `eos`."""
    directory = tmp_path / "model"
    shutil.copytree(bamba[0], directory)
    path = directory / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, "eos_token_id": eos}))
    return directory


def greedy(llm, **options):
    params = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, **options})
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("as_list", [False, True], ids=["int", "list"])
def test_eos_comes_from_generation_config(llm, bamba, tmp_path, as_list):
    free = greedy(llm, ignore_eos=True).token_ids
    stop_at = 3 if as_list else 2
    # A list names a token the model never produces first, then the one it produces at step `stop_at`.
    unused = next(t for t in range(3, 320) if t not in free)
    eos = [unused, free[stop_at]] if as_list else free[stop_at]
    assert free[stop_at] not in free[:stop_at] and llm.get_tokenizer().eos_token_id not in free[: stop_at + 1]
    eos_llm = LLM(checkpoint_with_eos(bamba, tmp_path, eos), dtype="float32")
    out = greedy(eos_llm)
    assert out.token_ids == free[: stop_at + 1] and out.finish_reason == "stop" and out.stop_reason is None
    assert greedy(eos_llm, ignore_eos=True).token_ids == free


def test_min_tokens_holds_eos_back_and_takes_the_next_best_token(llm, bamba, tmp_path):
    free = greedy(llm, ignore_eos=True).token_ids
    assert free[2] not in free[:2]
    eos_llm = LLM(checkpoint_with_eos(bamba, tmp_path, free[2]), dtype="float32")
    out = greedy(eos_llm, min_tokens=5, logprobs=1)
    assert out.token_ids[:2] == free[:2] and len(out.token_ids) >= 5
    # At step 2 EOS is banned: the token is HF's best among the others.
    logits = hf_step_logits(bamba[1], llm.get_tokenizer().encode(PROMPT), out.token_ids)
    assert logits[2].argmax().item() == free[2]
    logits[2, free[2]] = -math.inf
    assert out.token_ids[2] == logits[2].argmax().item()
    # Once min_tokens is reached EOS stops the request again, wherever the model produces it.
    later = [i for i, t in enumerate(out.token_ids) if t == free[2]]
    assert all(i >= 5 for i in later)
    if later:
        assert later == [len(out.token_ids) - 1] and out.finish_reason == "stop"


def test_stop_string_spanning_two_known_tokens(llm):
    tokenizer = llm.get_tokenizer()
    out = greedy(llm, ignore_eos=True, max_tokens=24)
    tokens, text = out.token_ids, out.text
    for k in range(len(tokens) - 1):
        prefix = tokenizer.decode(tokens[: k + 1])
        pair = text[len(prefix) - 1 : len(prefix) + 1]
        if text.startswith(prefix) and len(pair) == 2 and pair.isascii() and pair.isprintable() and \
                " " not in pair and text.find(pair) == len(prefix) - 1:
            break
    else:
        pytest.fail("no two adjacent tokens with printable ASCII text at their boundary")
    # The last character of token k and the first of token k+1: found only once token k+1 exists.
    assert tokenizer.decode(tokens[k : k + 1])[-1] == pair[0] and tokenizer.decode(tokens[k + 1 : k + 2])[0] == pair[1]
    stopped = greedy(llm, ignore_eos=True, max_tokens=24, stop=[pair])
    assert stopped.token_ids == tokens[: k + 2]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", pair)
    assert stopped.text == text[: len(prefix) - 1]
    kept = greedy(llm, ignore_eos=True, max_tokens=24, stop=[pair], include_stop_str_in_output=True)
    assert kept.text == text[: len(prefix) + 1]


def test_skip_special_tokens(llm):
    """A near-uniform draw soon emits one of the tokenizer's special tokens (<pad>, <s>, </s>); the text
    leaves it out unless skip_special_tokens=False."""
    tokenizer = llm.get_tokenizer()
    special = set(tokenizer.all_special_ids)
    params = [SamplingParams(temperature=20.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True) for seed in range(64)]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    seed = next(i for i, o in enumerate(outputs) if special & set(o.outputs[0].token_ids))
    tokens = outputs[seed].outputs[0].token_ids
    kept = llm.generate([PROMPT], SamplingParams(temperature=20.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                 skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == tokens
    names = {tokenizer.convert_ids_to_tokens(t) for t in special & set(tokens)}
    assert all(name in kept.text for name in names)
    assert kept.text == tokenizer.decode(tokens, skip_special_tokens=False)
    skipped = outputs[seed].outputs[0].text
    assert not any(name in skipped for name in names)
    assert skipped == tokenizer.decode([t for t in tokens if t not in special])
