"""LoRA with n-gram speculative decoding: a verify step computes several rows per sequence (its last token
and each draft), and every one of them must go through that sequence's adapter, so the tokens stay the
ones decoded without speculation (float32, greedy) in a batch mixing the base model and two adapters.

As tests/engine/test_speculative.py does, some requests may only pick between two tokens (allowed_token_ids)
so that prompt lookup proposes drafts the model sometimes accepts and sometimes rejects.
"""

import random

import pytest
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from spec_helpers import assert_same_outputs

from runtime import LLM, LoRARequest, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CHOICES = [9, 40]
_rng = random.Random(3)
PROMPTS = [
    {"prompt_token_ids": [9, 40, 41, 200, 7] * 3},
    {"prompt_token_ids": [77, 78, 79] * 4},
    {"prompt_token_ids": [9, 40, 9, 9, 40, 12] * 2},
    {"prompt_token_ids": _rng.sample(range(3, 320), 20)},
    {"prompt_token_ids": [40, 9, 55] * 5},
]
FEW = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, allowed_token_ids=CHOICES)
FREE = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
PARAMS = [FEW, FEW, FEW, FREE, FEW]
BUDGET = 24  # tokens per step: the prompts are prefilled over several steps, beside the first verifies


@pytest.fixture(scope="module", params=["llama", "bamba"])
def case(request, tmp_path_factory, tokenizer_dir):
    """(checkpoint, per prompt: its LoRARequest or None) of a pure-attention and a hybrid model (whose verifies
    also write a state per draft)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(request.param, directory, tokenizer_dir)
    loras = []
    for i in range(2):
        path = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(hf, path, seed=20 + i, r=4, lora_alpha=8, target_modules=targets(linear_names(hf)))
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    first, second = loras
    return directory, [None, first, second, first, None]


def generate(directory, loras, **options):
    llm = LLM(directory, dtype="float32", enable_lora=True, max_num_batched_tokens=BUDGET, **options)
    return llm, llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=loras)


def test_adapters_with_speculation_give_the_tokens_without(case):
    directory, loras = case
    _, reference = generate(directory, loras)
    _, base = generate(directory, [None] * len(loras))
    changed = [r.outputs[0].token_ids != b.outputs[0].token_ids for r, b in zip(reference, base)]
    assert changed == [lora is not None for lora in loras], "each adapter must change its request's tokens"
    llm, outputs = generate(directory, loras, speculative_config=SPEC)
    assert_same_outputs(outputs, reference)
    # Drafts were verified through each adapter, and some of them were rejected.
    per_request = [o.spec_decode for o in outputs]
    assert all(c is not None and c.num_draft_tokens > 0 for c, lora in zip(per_request, loras) if lora is not None)
    counters = llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
