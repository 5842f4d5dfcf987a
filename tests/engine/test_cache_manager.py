"""Page bookkeeping and scheduling are pure Python: these tests need no torch and no model."""

import json

import pytest

from runtime.cache.manager import CacheManager
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerLimits
from runtime.sequence import Sequence, SequenceStatus

HYBRID = {
    "architectures": ["BambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3, "attn_layer_indices": [1],
    "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16, "torch_dtype": "float32",
}


@pytest.fixture
def layout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HYBRID))
    return EngineConfig(str(tmp_path)).cache


def seq(n: int, i: int = 0) -> Sequence:
    return Sequence(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=8))


def test_hybrid_layout_of_the_test_model(layout):
    # 2 mamba layers and 1 attention layer: groups of 1, one attention group and two state groups.
    assert (layout.group_size, layout.num_attention_groups, layout.num_state_groups) == (1, 1, 2)
    assert layout.block_size == 48


def test_attention_blocks_and_states_share_one_free_list(layout):
    cache = CacheManager(layout, num_pages=8)
    a = seq(100)
    assert cache.pages_needed(a, 100) == 2 + 3  # two state pages, ceil(100 / 48) blocks
    cache.allocate(a, 100)
    assert cache.num_free_pages == 3
    b = seq(10, 1)
    assert cache.can_allocate(b, 10)
    cache.allocate(b, 10)
    assert not cache.can_allocate(seq(10, 2), 10)
    cache.free(a)
    cache.free(b)
    assert cache.num_free_pages == 8
    # The page that held a's attention block can now hold a Mamba state.
    c = seq(1, 3)
    cache.allocate(c, 1)
    assert set(c.state_pages) <= set(range(8))


def test_decode_grows_the_block_table_only_at_block_boundaries(layout):
    cache = CacheManager(layout, num_pages=16)
    s = seq(48)
    cache.allocate(s, 48)
    s.num_computed_tokens = 48
    assert cache.pages_needed(s, 1) == 1
    cache.allocate(s, 1)
    s.num_computed_tokens = 49
    assert cache.pages_needed(s, 1) == 0


def test_preemption_frees_the_last_admitted_and_resets_it(layout):
    cache = CacheManager(layout, num_pages=7)
    scheduler = Scheduler(cache, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=1000))
    first, second = seq(40, 0), seq(40, 1)
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and cache.num_free_pages == 1
    scheduler.update(batch)
    # Both need a second block at token 49; only one page is free.
    for s in (first, second):
        s.output_token_ids.extend([5] * 9)
        s.num_computed_tokens = s.num_tokens - 1
    batch = scheduler.schedule()
    assert batch.seqs == [first]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert second.num_preemptions == 1 and not second.has_pages
    assert list(scheduler.waiting) == [second]


def test_chunked_prefill_splits_a_prompt_over_steps(layout):
    cache = CacheManager(layout, num_pages=16)
    scheduler = Scheduler(cache, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=16))
    s = seq(40)
    scheduler.add(s)
    chunks = []
    while s.num_computed_tokens < s.num_tokens:
        batch = scheduler.schedule()
        chunks.append(batch.num_new_tokens[0])
        scheduler.update(batch)
    assert chunks == [16, 16, 8]


def test_without_chunked_prefill_a_long_prompt_waits_for_a_whole_step(layout):
    cache = CacheManager(layout, num_pages=16)
    scheduler = Scheduler(cache, SchedulerLimits(8, 16, enable_chunked_prefill=False))
    scheduler.add(seq(40))
    assert not scheduler.schedule()


def test_finish_frees_every_page(layout):
    cache = CacheManager(layout, num_pages=16)
    scheduler = Scheduler(cache, SchedulerLimits(8, 1000))
    for i in range(3):
        scheduler.add(seq(30, i))
    batch = scheduler.schedule()
    scheduler.update(batch)
    for s in list(batch.seqs):
        scheduler.finish(s, "stop")
    assert cache.num_free_pages == 16 and not scheduler.has_unfinished()
