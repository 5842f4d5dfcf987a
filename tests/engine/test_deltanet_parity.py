"""Gated DeltaNet families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) against HF transformers, the oracle, on tiny
checkpoints whose every parameter is random: greedy tokens of a mixed-length batch, the same with chunked
prefill and with preemption, last-token logits (float32), bfloat16 within the bounds of test_families_parity.py,
and the engine on the Triton kernels. The helpers are test_families_parity.py's."""

import copy

import pytest
import torch
from test_families_parity import (
    BF16_INITIALIZER_RANGE,
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    assert_pool_free,
    last_token_logits,
    prompt_ids,
    tokens,
)
from tiny_models import build_deltanet_model, hf_greedy, hf_last_logits

from runtime import LLM, SamplingParams, kernels
from runtime.config import EngineConfig

# Each case proves that its architecture runs on the engine (the V1 column; see docs/contributing.md).
MODELS = [
    pytest.param("qwen3_next", marks=pytest.mark.proves("Qwen3NextForCausalLM", "engine")),
    pytest.param("qwen3_5", marks=pytest.mark.proves("Qwen3_5ForCausalLM", "engine")),
    pytest.param("qwen3_5_moe", marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "engine")),
    pytest.param("olmo_hybrid", marks=pytest.mark.proves("OlmoHybridForCausalLM", "engine")),
]
SCHEDULED = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"]
# Tiny Qwen3.5 at BF16_INITIALIZER_RANGE is more sensitive than a trained model: HF's own bfloat16 forward
# misses its float32 logits by 12% of their largest (ours by 13%), over the 10% sanity bound. At 0.1 both
# are near 5%, and the comparison with HF's bfloat16 error stays as strict.
BF16_RANGES = {"qwen3_5": 0.1}


@pytest.fixture(scope="session")
def deltanet_checkpoint(tmp_path_factory, tokenizer_dir):
    """deltanet_checkpoint(name, **overrides) -> (directory, HF model); built once per name and overrides."""
    built = {}

    def make(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(name)
            built[key] = (directory, build_deltanet_model(name, directory, tokenizer_dir, **overrides))
        return built[key]

    return make


@pytest.fixture(scope="module")
def hf_tokens_of(deltanet_checkpoint):
    """HF's greedy tokens per (model, prompt), computed once: every test below compares against them."""
    cache = {}

    def get(name, ids, max_new_tokens=NEW_TOKENS):
        _, hf = deltanet_checkpoint(name)
        for prompt in ids:
            key = (name, tuple(prompt), max_new_tokens)
            if key not in cache:
                cache[key] = hf_greedy(hf, prompt, max_new_tokens)
        return [cache[(name, tuple(prompt), max_new_tokens)] for prompt in ids]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_of_a_mixed_batch_match_transformers(name, deltanet_checkpoint, hf_tokens_of):
    directory, _ = deltanet_checkpoint(name)
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    assert max(map(len, ids)) > 64, "the longest prompt must cross a delta-rule chunk"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == hf_tokens_of(name, ids), name
    assert_pool_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_last_token_logits_match_transformers(name, deltanet_checkpoint):
    directory, hf = deltanet_checkpoint(name)
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    for prompt, row in zip(ids, last_token_logits(llm, ids)):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs_and_stays_close_to_float32(name, deltanet_checkpoint):
    directory, hf = deltanet_checkpoint(name, initializer_range=BF16_RANGES.get(name, BF16_INITIALIZER_RANGE))
    reference = LLM(directory, dtype="float32")
    ids = prompt_ids(reference)
    expected = last_token_logits(reference, ids)
    got = last_token_logits(LLM(directory, dtype="bfloat16"), ids)
    hf_rows = torch.stack([hf_last_logits(copy.deepcopy(hf).to(torch.bfloat16), p) for p in ids])
    hf_error = (hf_rows - expected).abs().max()
    error = (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max(), name
    # Our bfloat16 path loses no more than HF's own bfloat16 forward does (up to a factor 2).
    assert error <= 2 * hf_error, (name, error, hf_error)
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept]), name


@pytest.mark.proves("chunked prefill", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                    "OlmoHybridForCausalLM")
@pytest.mark.parametrize("name", SCHEDULED)
def test_chunked_prefill_matches_transformers(name, deltanet_checkpoint, hf_tokens_of):
    directory, _ = deltanet_checkpoint(name)
    # 7 tokens a step: prompts resume mid-chunk, from their carried conv and recurrent states, over many steps.
    chunked = LLM(directory, dtype="float32", max_num_batched_tokens=7)
    outputs = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == hf_tokens_of(name, prompt_ids(chunked))
    assert_pool_free(chunked)


@pytest.mark.parametrize("name", SCHEDULED)
def test_preemption_recomputes_the_same_tokens_as_transformers(name, deltanet_checkpoint, hf_tokens_of):
    directory, _ = deltanet_checkpoint(name)
    layout = EngineConfig(str(directory), dtype="float32").cache
    # Pages for one full-length sequence only: the two medium prompts start together and the later one
    # is preempted when the earlier one's next block does not fit.
    small = LLM(directory, dtype="float32", max_model_len=128, num_pages=layout.pages_per_sequence(128))
    prompts = [PROMPTS[i] for i in (1, 2, 0, 3)]
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    ids = [small.get_tokenizer().encode(p) for p in prompts]
    assert tokens(outputs) == hf_tokens_of(name, ids)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_pool_free(small)


@pytest.fixture
def restore_backend():
    yield
    # Later tests build engines on CPU, whose references must not be left rebound.
    kernels.bind("torch", torch.device("cpu"))


# One model: the others differ from it only in torch code (projections, MLP), not in the kernels they run.
@pytest.mark.parametrize("name", ["qwen3_next"])
def test_triton_kernels_give_the_tokens_of_transformers(name, deltanet_checkpoint, hf_tokens_of, restore_backend):
    """The whole engine on the Triton kernels (the interpreter on a CPU), prompts prefilled in pieces."""
    directory, _ = deltanet_checkpoint(name)
    llm = LLM(directory, dtype="float32", kernel_backend="triton", max_num_batched_tokens=24)
    assert kernels.backend == "triton"
    few = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:3], few, use_tqdm=False)
    assert tokens(outputs) == hf_tokens_of(name, prompt_ids(llm)[:3], 4)
