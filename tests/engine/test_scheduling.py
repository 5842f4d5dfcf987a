"""Batching, chunked prefill and preemption change how work is split, never the tokens."""

import pytest

from runtime import LLM, SamplingParams

PROMPTS = [
    "The",
    "A hybrid model mixes attention with state-space layers",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches prefills "
    "and decodes, and preempts when pages run out.",
    "Numbers like 1, 2, 3, 42 and 528 appear in the cache layout table.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=[
    "llama", "granite", "mamba2", "bamba", "granitemoehybrid", "jamba", "mamba", "falcon_h1", "nemotron_h", "zamba2",
])
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)[0]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_free(llm):
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages
    assert not llm.engine.has_unfinished()


def test_batch_equals_each_request_alone(checkpoint):
    llm = LLM(checkpoint, dtype="float32")
    batched = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert batched == alone
    assert_pool_free(llm)


@pytest.mark.proves(
    "chunked prefill", "LlamaForCausalLM", "GraniteForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM",
    "GraniteMoeHybridForCausalLM", "JambaForCausalLM", "MambaForCausalLM", "FalconH1ForCausalLM",
    "NemotronHForCausalLM", "Zamba2ForCausalLM",
)
def test_chunked_prefill_equals_one_shot(checkpoint):
    one_shot = LLM(checkpoint, dtype="float32", max_num_batched_tokens=4096)
    chunked = LLM(checkpoint, dtype="float32", max_num_batched_tokens=7)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(
        one_shot.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert_pool_free(chunked)


def test_running_out_of_pages_preempts_and_recomputes_the_same_tokens(checkpoint):
    reference = tokens(LLM(checkpoint, dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False))
    # Pages for two full-length sequences only: requests wait, or are preempted, and never fail.
    small = LLM(checkpoint, dtype="float32", max_model_len=128, num_pages=_pages_for(checkpoint, 2))
    outputs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference
    if small.engine.config.cache.block_size:
        # Attention pages grow with each sequence, so the pool runs dry mid-decode.
        assert sum(o.num_preemptions for o in outputs) > 0
    assert_pool_free(small)


def _pages_for(checkpoint, num_sequences: int) -> int:
    from runtime.config import EngineConfig

    layout = EngineConfig(str(checkpoint), dtype="float32").cache
    return num_sequences * layout.pages_per_sequence(128)
