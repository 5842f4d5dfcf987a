"""Speculative decoding (n-gram) changes how many tokens a step computes, never the tokens (float32, greedy).

Random tiny models rarely repeat themselves, so two requests may only pick between two tokens
(allowed_token_ids; the logprobs reported stay the model's own): prompt lookup then proposes drafts
that are sometimes accepted and sometimes rejected, by the model's own choice. A free request gets
drafts only when its output happens to repeat, and a long prompt is prefilled in chunks alongside
them, so that steps mix verifies, plain decodes and prefill chunks.
"""

import random

import pytest
from spec_helpers import assert_drafts_accepted_and_rejected, assert_same_outputs, run_watching_steps
from tiny_models import DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model

from runtime import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CHOICES = [9, 40]
_rng = random.Random(1)
PROMPTS = [
    {"prompt_token_ids": [9, 40, 41, 200, 7] * 3},
    {"prompt_token_ids": [77, 78, 79] * 4},
    {"prompt_token_ids": _rng.sample(range(3, 320), 20)},
    {"prompt_token_ids": [_rng.randrange(3, 320) for _ in range(60)]},
]
FEW = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1, allowed_token_ids=CHOICES)
FREE = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
PARAMS = [FEW, FEW, FREE, FREE]
BUDGET = 24  # tokens per step: the 60-token prompt takes three steps, beside the others' verifies


@pytest.fixture(scope="module", params=[
    pytest.param("llama", marks=pytest.mark.proves("LlamaForCausalLM", "speculative decoding")),
    pytest.param("granite", marks=pytest.mark.proves("GraniteForCausalLM", "speculative decoding")),
    pytest.param("mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "speculative decoding")),
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "speculative decoding")),
    pytest.param("granitemoehybrid", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "speculative decoding")),
    pytest.param("jamba", marks=pytest.mark.proves("JambaForCausalLM", "speculative decoding")),
    pytest.param("mamba", marks=pytest.mark.proves("MambaForCausalLM", "speculative decoding")),
    pytest.param("falcon_h1", marks=pytest.mark.proves("FalconH1ForCausalLM", "speculative decoding")),
    pytest.param("nemotron_h", marks=pytest.mark.proves("NemotronHForCausalLM", "speculative decoding")),
    pytest.param("zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "speculative decoding")),
    pytest.param("lfm2", marks=pytest.mark.proves("Lfm2ForCausalLM", "speculative decoding")),
    pytest.param("lfm2_moe", marks=pytest.mark.proves("Lfm2MoeForCausalLM", "speculative decoding")),
    pytest.param("falcon_mamba", marks=pytest.mark.proves("FalconMambaForCausalLM", "speculative decoding")),
    pytest.param("qwen3_next", marks=pytest.mark.proves("Qwen3NextForCausalLM", "speculative decoding")),
    pytest.param("qwen3_5", marks=pytest.mark.proves("Qwen3_5ForCausalLM", "speculative decoding")),
    pytest.param("qwen3_5_moe", marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "speculative decoding")),
    pytest.param("olmo_hybrid", marks=pytest.mark.proves("OlmoHybridForCausalLM", "speculative decoding")),
])
def checkpoint(request, tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    if request.param in FAMILY_CONFIGS or request.param in DELTANET_CONFIGS:
        directory = tmp_path_factory.mktemp(request.param)
        build = build_family_model if request.param in FAMILY_CONFIGS else build_deltanet_model
        build(request.param, directory, tokenizer_dir)
        return directory
    return tiny_checkpoint(request.param)[0]


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET)
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def assert_pool_free(llm):
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages


def test_greedy_tokens_and_logprobs_equal_without_speculation(checkpoint, reference):
    llm = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC)
    outputs, mixed = run_watching_steps(llm, PROMPTS, PARAMS)
    assert_same_outputs(outputs, reference)
    assert_drafts_accepted_and_rejected(llm)
    assert mixed, "no step held a verify, a plain decode and a prefill chunk together"
    # Each request's own counters (RequestOutput.spec_decode) add up to the engine's.
    counters = llm.engine.speculator.counters
    mine = [o.spec_decode for o in outputs if o.spec_decode is not None]
    assert sum(c.num_accepted_tokens for c in mine) == counters.num_accepted_tokens
    assert sum(c.num_draft_tokens for c in mine) == counters.num_draft_tokens
    assert_pool_free(llm)


def test_with_prefix_caching(checkpoint):
    llm = LLM(checkpoint, dtype="float32", max_num_batched_tokens=BUDGET, speculative_config=SPEC,
              enable_prefix_caching=True)
    # A shared prefix longer than a cache block, so that later requests start from the cache.
    shared = random.Random(2).sample(range(3, 320), llm.engine.cache.prefix.block_size + 3)
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in PROMPTS[:3]]
    reference = LLM(checkpoint, dtype="float32").generate(prompts, PARAMS[:3], use_tqdm=False)
    assert_same_outputs(llm.generate(prompts, PARAMS[:3], use_tqdm=False), reference)
    again = llm.generate(prompts, PARAMS[:3], use_tqdm=False)  # drafts verified after a cached prefix
    assert_same_outputs(again, reference)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_drafts_accepted_and_rejected(llm)


def test_with_preemption(checkpoint):
    from runtime.config import EngineConfig

    # Long enough outputs that every sequence outgrows its first block, in a pool that holds one sequence
    # of 64 tokens and the states of a second, less a page where blocks and states share it: sequences
    # wait, or are preempted and recomputed, and verifies find pages for the states they keep only some of the
    # time, verifying fewer drafts (a model without attention holds two states and one verify's kept states).
    prompts, params = PROMPTS[:3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1,
                                                  allowed_token_ids=CHOICES)
    reference = LLM(checkpoint, dtype="float32").generate(prompts, params, use_tqdm=False)
    layout = EngineConfig(str(checkpoint), dtype="float32").cache
    groups = layout.num_state_groups
    pages = layout.pages_per_sequence(64) + 2 * groups - (1 if layout.block_size and groups else 0)
    llm = LLM(checkpoint, dtype="float32", speculative_config=SPEC, max_model_len=64, num_pages=pages,
              max_num_seqs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, reference)
    if layout.block_size:  # attention pages grow with each sequence, so the pool runs dry mid-decode
        assert sum(o.num_preemptions for o in outputs) > 0
    # Some models settle on one token here: every draft then holds (the other tests see rejections).
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert_pool_free(llm)
