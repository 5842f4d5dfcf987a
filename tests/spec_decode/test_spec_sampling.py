"""Sampling with speculation draws from the same distribution as without, and seeded requests reproduce,
for each proposer: prompt lookup, a draft model and an MTP head.

Each of N requests samples 4 tokens among three (allowed_token_ids, which every proposer's drafts keep to,
so that drafts are accepted and rejected often) at temperature 1 with its own seed. The third and fourth
tokens come after drafts were accepted or rejected; their joint frequencies (9 cells) with and without
speculation must pass a chi-square test of homogeneity (p = 0.001). Two bugs put in by hand made it fail
(statistics against the bound of 26; correct runs, three seed pairs each, gave 2 to 15):
- keeping every row's token whether or not the draft before it matched (no acceptance test): n-gram 371,
  draft model 125, MTP 180;
- keeping the drafts themselves, every one accepted (no rejection sampling): n-gram 483, draft model 511,
  MTP 922.
The proposers' drafts, all point masses (see runtime/spec_decode/verify.py):
- n-gram: prompt lookup over a prompt that holds all three choices;
- draft model: the target (Bamba, so rejected states are restored) with every weight moved by 5 %, a
  stateful draft that rolls its own state back too (test_spec_draft_model.py has a Llama drafting);
- MTP: Qwen3-Next with the `mtp.*` head of test_spec_mtp.py, whose embeddings are scaled so that the target
  repeats its last token often but not always, and the head's first draft is mostly that token.
"""

import pytest
from test_spec_draft_model import perturbed_copy
from test_spec_mtp import add_mtp_head
from tiny_models import build_deltanet_model

from runtime import LLM, SamplingParams

K = 3
CHOICES = [9, 40, 41]
PROMPT = {"prompt_token_ids": [9, 40, 41, 200, 9, 41, 40, 9, 9]}
N = 600
# chi-square with (9 - 1) degrees of freedom: P(X > 26.12) = 0.001.
CRITICAL_8_DF = 26.12
MTP_LAYER, MTP_ECHO = 1, 6.0  # Qwen3-Next's attention layer in tests/tiny_models.py, and the embeddings' scale


def sample(llm, seed0: int, n: int = N) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=seed0 + i, allowed_token_ids=CHOICES)
              for i in range(n)]
    outputs = llm.generate([PROMPT] * n, params, use_tqdm=False)
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


@pytest.fixture(scope="module", params=["ngram", "draft_model", "mtp"])
def setup(request, tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    """(the checkpoint, its speculative_config) for each proposer."""
    if request.param == "ngram":
        return tiny_checkpoint("bamba")[0], {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
    if request.param == "draft_model":
        target = tiny_checkpoint("bamba")[0]
        draft = perturbed_copy(target, tmp_path_factory.mktemp("draft") / "bamba")
        return target, {"model": str(draft), "num_speculative_tokens": K}
    directory = tmp_path_factory.mktemp("qwen3_next_mtp")
    build_deltanet_model("qwen3_next", directory, tokenizer_dir)
    add_mtp_head(directory, MTP_LAYER, echo=MTP_ECHO)
    return directory, {"method": "mtp", "num_speculative_tokens": K}


def test_speculative_sampling_keeps_the_distribution(setup):
    checkpoint, spec = setup
    plain = sample(LLM(checkpoint, dtype="float32"), 0)
    llm = LLM(checkpoint, dtype="float32", speculative_config=spec)
    speculated = sample(llm, 10_000)  # other seeds: the two samples are independent
    tails = lambda samples: [s[2:] for s in samples]  # noqa: E731
    assert len(set(tails(plain))) > 4  # the test has cells to compare
    assert chi_square(tails(plain), tails(speculated)) < CRITICAL_8_DF
    counters = llm.engine.speculator.counters
    # Enough drafts held and failed for a proposer that skipped the acceptance test to move the cells.
    assert 0.1 * counters.num_draft_tokens < counters.num_accepted_tokens < 0.9 * counters.num_draft_tokens


def test_seeded_requests_reproduce(setup):
    checkpoint, spec = setup
    llm = LLM(checkpoint, dtype="float32", speculative_config=spec)
    first = sample(llm, 7, 200)
    assert sample(llm, 7, 200) == first
    assert sample(LLM(checkpoint, dtype="float32", speculative_config=spec), 7, 200) == first
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
