"""Sampling with speculation draws from the same distribution as without, and seeded requests reproduce.

Each of N requests samples 4 tokens among three (allowed_token_ids, so that prompt lookup always proposes
and drafts are accepted and rejected often) at temperature 1 with its own seed. The third and fourth
tokens come after drafts were accepted or rejected; their joint frequencies (9 cells) with and without
speculation must pass a chi-square test of homogeneity (p = 0.001). Keeping every row's token whether or
not the draft before it matched (no acceptance test) gave a statistic of 371 against the bound of 26.
"""

import pytest

from runtime import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
CHOICES = [9, 40, 41]
PROMPT = {"prompt_token_ids": [9, 40, 41, 200, 9, 41, 40, 9, 9]}
N = 600
# chi-square with (9 - 1) degrees of freedom: P(X > 26.12) = 0.001.
CRITICAL_8_DF = 26.12


def sample(llm, seed0: int) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=seed0 + i, allowed_token_ids=CHOICES)
              for i in range(N)]
    outputs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def chi_square(a: list, b: list) -> float:
    """Two-sample homogeneity statistic over the cells either sample hit."""
    cells = sorted(set(a) | set(b))
    total = len(a) + len(b)
    stat = 0.0
    for cell in cells:
        observed = (a.count(cell), b.count(cell))
        for count, n in zip(observed, (len(a), len(b))):
            expected = sum(observed) * n / total
            stat += (count - expected) ** 2 / expected
    return stat


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("bamba")[0]


def test_speculative_sampling_keeps_the_distribution(checkpoint):
    plain = sample(LLM(checkpoint, dtype="float32"), 0)
    llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC)
    spec = sample(llm, 10_000)  # other seeds: the two samples are independent
    tails = lambda samples: [s[2:] for s in samples]  # noqa: E731
    assert len(set(tails(plain))) > 4  # the test has cells to compare
    assert chi_square(tails(plain), tails(spec)) < CRITICAL_8_DF
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


def test_seeded_requests_reproduce(checkpoint):
    llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC)
    first = sample(llm, 7)
    assert sample(llm, 7) == first
    assert sample(LLM(checkpoint, dtype="float32", speculative_config=SPEC), 7) == first
