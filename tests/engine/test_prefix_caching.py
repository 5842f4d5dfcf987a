"""Prefix caching changes how much of a prompt is computed, never the tokens (float32, greedy).

Prompts are token ids sized in blocks of the engine's own prefix block size B, so that each
case lands where it means to: a shared prefix ending inside a block or exactly on a boundary,
an exact repeat, and a suffix longer than a block (the last boundary of a prompt lies past
the shared part, so a model with state resumes only where the cache chose to snapshot).
"""

import random

import pytest
from tiny_models import DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model

from runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VOCAB = 320  # tests/tiny_models.py


@pytest.fixture(scope="module", params=[
    pytest.param("llama", marks=pytest.mark.proves("LlamaForCausalLM", "prefix caching")),
    pytest.param("granite", marks=pytest.mark.proves("GraniteForCausalLM", "prefix caching")),
    pytest.param("mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "prefix caching")),
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "prefix caching")),
    pytest.param("granitemoehybrid", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "prefix caching")),
    pytest.param("jamba", marks=pytest.mark.proves("JambaForCausalLM", "prefix caching")),
    pytest.param("mamba", marks=pytest.mark.proves("MambaForCausalLM", "prefix caching")),
    pytest.param("falcon_h1", marks=pytest.mark.proves("FalconH1ForCausalLM", "prefix caching")),
    pytest.param("nemotron_h", marks=pytest.mark.proves("NemotronHForCausalLM", "prefix caching")),
    pytest.param("zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "prefix caching")),
    pytest.param("lfm2", marks=pytest.mark.proves("Lfm2ForCausalLM", "prefix caching")),
    pytest.param("lfm2_moe", marks=pytest.mark.proves("Lfm2MoeForCausalLM", "prefix caching")),
    pytest.param("falcon_mamba", marks=pytest.mark.proves("FalconMambaForCausalLM", "prefix caching")),
    pytest.param("qwen3_next", marks=pytest.mark.proves("Qwen3NextForCausalLM", "prefix caching")),
    pytest.param("qwen3_5", marks=pytest.mark.proves("Qwen3_5ForCausalLM", "prefix caching")),
    pytest.param("qwen3_5_moe", marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "prefix caching")),
    pytest.param("olmo_hybrid", marks=pytest.mark.proves("OlmoHybridForCausalLM", "prefix caching")),
])
def checkpoint(request, tiny_checkpoint, tmp_path_factory, tokenizer_dir):
    if request.param in FAMILY_CONFIGS:
        directory = tmp_path_factory.mktemp(request.param)
        build_family_model(request.param, directory, tokenizer_dir)
        return directory
    if request.param in DELTANET_CONFIGS:
        directory = tmp_path_factory.mktemp(request.param)
        build_deltanet_model(request.param, directory, tokenizer_dir)
        return directory
    return tiny_checkpoint(request.param)[0]


@pytest.fixture(scope="module")
def off(checkpoint):
    return LLM(checkpoint, dtype="float32")


@pytest.fixture(scope="module")
def on(checkpoint):
    return LLM(checkpoint, dtype="float32", enable_prefix_caching=True)


def block(llm) -> int:
    return llm.engine.cache.prefix.block_size


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run(llm, prompts, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs], outputs


def assert_same_tokens(on, off, prompts, params=GREEDY) -> list[int]:
    """Generate with caching on and off; the tokens must be equal. Returns the cached token counts."""
    tokens, cached, _ = run(on, prompts, params)
    assert tokens == run(off, prompts, params)[0]
    return cached


def assert_all_free_after_reset(llm) -> None:
    cache = llm.engine.cache
    assert not llm.engine.has_unfinished()
    assert cache.num_free_pages == cache.num_pages
    assert llm.reset_prefix_cache()
    assert cache.num_cached_pages == 0 and cache.num_free_pages == cache.num_pages


def test_shared_system_prompt_with_different_suffixes(on, off):
    size = block(on)
    system = ids(3 * size + 5, seed=1)  # ends inside a block
    prompts = [system + ids(size + 7 + i, seed=10 + i) for i in range(4)]
    # The first request caches its blocks; the second finds the shared blocks (and, with Mamba state,
    # ends a chunk where it leaves them, so the state there is kept); the rest resume there.
    assert assert_same_tokens(on, off, prompts[:1]) == [0]
    assert_same_tokens(on, off, prompts[1:2])
    assert assert_same_tokens(on, off, prompts[2:]) == [3 * size, 3 * size]
    assert_all_free_after_reset(on)


def test_prefix_ending_exactly_on_a_block_boundary(on, off):
    size = block(on)
    system = ids(2 * size, seed=2)
    prompts = [system + ids(size + 3 + i, seed=20 + i) for i in range(4)]
    for prompt in prompts[:2]:
        assert_same_tokens(on, off, [prompt])
    assert assert_same_tokens(on, off, prompts[2:]) == [2 * size, 2 * size]
    assert_all_free_after_reset(on)


def test_exact_repeat_ending_inside_a_block(on, off):
    check_exact_repeat(on, off, extra=5)


def test_exact_repeat_ending_on_a_boundary(on, off):
    check_exact_repeat(on, off, extra=0)


# One parametrization (the architecture, on the fixture) per test: the matrix's static read of the proofs
# names tests as pytest does only then.
def check_exact_repeat(on, off, extra: int) -> None:
    size = block(on)
    prompt = ids(3 * size + extra, seed=3)
    assert assert_same_tokens(on, off, [prompt]) == [0]
    # At least the last prompt token is computed again: its logits give the first new token.
    expected = (len(prompt) - 1) // size * size
    assert assert_same_tokens(on, off, [prompt]) == [expected]
    # Two at once both resume from the cache, each from its own copy of any state snapshot.
    assert assert_same_tokens(on, off, [prompt, prompt]) == [expected, expected]
    assert_all_free_after_reset(on)


def other_token(token: int) -> int:
    return 3 + (token - 3 + 1) % (VOCAB - 3)


def test_prompts_that_differ_only_at_a_blocks_last_token_share_only_the_blocks_before_it(on, off):
    # A block name that left out any of its tokens (the last, by an off-by-one) would give the second
    # prompt the first one's KV pages or state snapshot at 3 blocks: wrong tokens.
    size = block(on)
    first = ids(3 * size + 4, seed=9)
    second = first.copy()
    second[2 * size - 1] = other_token(first[2 * size - 1])
    assert assert_same_tokens(on, off, [first]) == [0]
    # Attention blocks are found one by one: the first is shared. A state resumes only at a snapshot,
    # and the first prompt left one at its last boundary alone.
    assert assert_same_tokens(on, off, [second]) == [0 if on.engine.cache.prefix.has_state else size]
    assert_all_free_after_reset(on)


def test_a_block_after_a_different_first_block_is_not_found(on, off):
    # The same second block after a different first one: a name that left out its parent would give a
    # model without attention (which resumes at any snapshot, not block by block) the first prompt's state.
    size = block(on)
    tail = ids(size + 3, seed=11)
    first, second = ids(size, seed=12) + tail, ids(size, seed=13) + tail
    assert assert_same_tokens(on, off, [first]) == [0]
    assert on.engine.cache.num_cached_pages > 0
    assert assert_same_tokens(on, off, [second]) == [0]
    assert_all_free_after_reset(on)


def test_reset_forgets_every_prefix(on, off):
    prompt = ids(3 * block(on) + 1, seed=4)
    assert_same_tokens(on, off, [prompt])
    assert on.engine.cache.num_cached_pages > 0
    assert_all_free_after_reset(on)
    assert assert_same_tokens(on, off, [prompt]) == [0]
    assert_all_free_after_reset(on)


def test_sharing_while_sequences_are_preempted(on, off):
    size = block(on)
    system = ids(2 * size + 3, seed=5)
    prompts = [system + ids(size // 2 + i, seed=50 + i) for i in range(4)]
    assert_same_tokens(on, off, prompts[:1])
    engine = on.engine
    ids_ = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in prompts]
    outputs, preempted = {}, 0
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        running = engine.scheduler.running
        # Preempt sequences that share their prefix pages with others, mid-decode, twice.
        if preempted < 2 and len(running) > 1 and all(seq.output_token_ids for seq in running):
            engine.scheduler.preempt(running[-1 - preempted])
            preempted += 1
    assert preempted == 2
    got = [outputs[i] for i in ids_]
    assert [o.outputs[0].token_ids for o in got] == run(off, prompts)[0]
    assert [o.num_cached_tokens for o in got] == [2 * size] * 4
    assert sum(o.num_preemptions for o in got) == 2
    assert_all_free_after_reset(on)


def test_shared_prefixes_in_a_pool_for_two_sequences(checkpoint, on, off):
    size = block(on)
    system = ids(2 * size + 3, seed=6)
    prompts = [system + ids(size // 2 + i, seed=60 + i) for i in range(4)]
    layout = on.engine.config.cache
    # Room for two sequences at full length: requests wait, or are preempted, and never fail.
    max_model_len = len(prompts[-1]) + GREEDY.max_tokens + 1
    llm = LLM(checkpoint, dtype="float32", enable_prefix_caching=True, max_model_len=max_model_len,
              num_pages=2 * layout.pages_per_sequence(max_model_len))
    assert_same_tokens(llm, off, prompts[:1])
    assert_same_tokens(llm, off, prompts)
    assert_all_free_after_reset(llm)


def test_eviction_when_the_pool_cannot_keep_everything(checkpoint, on, off):
    size = block(on)
    prompts = [ids(3 * size + 2, seed=60 + i) for i in range(3)]
    # Room for one sequence, one state snapshot and one page more.
    layout = on.engine.config.cache
    llm = LLM(checkpoint, dtype="float32", enable_prefix_caching=True, max_model_len=4 * size,
              num_pages=layout.pages_per_sequence(4 * size) + layout.num_state_groups + 1)
    for prompt in prompts:
        assert assert_same_tokens(llm, off, [prompt]) == [0]
    # The later prompts took the pages that held the first one's blocks and snapshots.
    again = assert_same_tokens(llm, off, [prompts[0]])
    assert again[0] < 3 * size
    # What the pool can hold is still found: the prompt just run is cached.
    assert assert_same_tokens(llm, off, [prompts[0]]) == [3 * size]
    assert_all_free_after_reset(llm)


def test_num_cached_tokens_and_counters(on, off):
    cache = on.engine.cache
    queried, hit = cache.num_queried_tokens, cache.num_hit_tokens
    prompt = ids(2 * block(on) + 1, seed=7)
    assert_same_tokens(on, off, [prompt, prompt[:-1] + [prompt[-1] % 100 + 3]])
    assert cache.num_queried_tokens - queried == 2 * len(prompt)
    assert cache.num_hit_tokens == hit  # both admitted in the same step: nothing was cached yet
    _, cached, _ = run(on, [prompt])
    assert cache.num_queried_tokens - queried == 3 * len(prompt)
    assert cache.num_hit_tokens - hit == cached[0] == 2 * block(on)
    assert_all_free_after_reset(on)


@pytest.mark.parametrize("name, finds_prefix", [("llama", True), ("bamba", False)])
def test_without_chunked_prefill_only_attention_models_find_prefixes(tiny_checkpoint, name, finds_prefix):
    # Every step ends a whole prompt, so no state is ever snapshotted at a block boundary.
    directory = tiny_checkpoint(name)[0]
    options = dict(dtype="float32", enable_chunked_prefill=False, max_model_len=512)
    on, off = LLM(directory, enable_prefix_caching=True, **options), LLM(directory, **options)
    prompt = ids(3 * block(on) + 2, seed=8)
    assert assert_same_tokens(on, off, [prompt]) == [0]
    assert assert_same_tokens(on, off, [prompt]) == [3 * block(on) if finds_prefix else 0]
    assert_all_free_after_reset(on)
