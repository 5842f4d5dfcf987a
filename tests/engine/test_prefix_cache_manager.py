"""Prefix-cache bookkeeping is pure Python: block names, sharing, snapshots, eviction, chunk cuts."""

import json

import pytest

from runtime.cache.manager import CacheManager
from runtime.cache.prefix import PrefixCache, prefix_block_size
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerLimits
from runtime.sequence import Sequence

HYBRID = {
    "architectures": ["BambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3, "attn_layer_indices": [1],
    "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16, "torch_dtype": "float32",
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
MAMBA2 = {"architectures": ["Mamba2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8,
          "head_dim": 16, "n_groups": 2, "state_size": 16, "chunk_size": 32, "expand": 2, "torch_dtype": "float32"}


def layout_of(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return EngineConfig(str(tmp_path), enable_prefix_caching=True).cache


def manager(layout, num_pages, block_size=None):
    return CacheManager(layout, num_pages, PrefixCache(layout, block_size or layout.block_size))


def seq(tokens, name="0") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(max_tokens=8))


def compute(cache: CacheManager, s: Sequence, n: int) -> None:
    """What a scheduled step does to the books: allocate, compute n tokens, commit."""
    if not s.has_pages:
        cache.admit(s, cache.lookup(s), n)
    else:
        cache.allocate(s, n)
    s.num_computed_tokens += n
    cache.commit(s)


@pytest.fixture
def hybrid(tmp_path):
    return layout_of(tmp_path, HYBRID)


def test_block_names_chain_the_whole_prefix(hybrid):
    prefix = PrefixCache(hybrid, 4)
    a, b, c = seq(range(1, 13)), seq(range(1, 13)), seq([99, *range(2, 13)])
    assert prefix.hashes(a) == prefix.hashes(b) and len(prefix.hashes(a)) == 3
    # One different token in the first block renames every block after it.
    assert not set(prefix.hashes(a)) & set(prefix.hashes(c))
    a.output_token_ids.extend([7, 7, 7, 7])
    assert prefix.hashes(a)[:3] == prefix.hashes(b) and len(prefix.hashes(a)) == 4


def test_a_block_name_covers_every_token_of_its_block(hybrid):
    prefix = PrefixCache(hybrid, 4)
    tokens = list(range(1, 13))
    names = prefix.hashes(seq(tokens))
    for i in range(len(tokens)):
        changed = seq([*tokens[:i], 99, *tokens[i + 1:]])
        # The blocks before the changed token keep their names; its own block and every later one are renamed.
        assert prefix.hashes(changed)[: i // 4] == names[: i // 4]
        assert not set(prefix.hashes(changed)[i // 4 :]) & set(names), f"token {i} is not in its block's name"


def test_a_sequence_finds_only_the_blocks_before_its_first_different_token(tmp_path):
    layout = layout_of(tmp_path, LLAMA)
    size = layout.block_size
    cache = manager(layout, num_pages=16)
    first = seq(range(1, 3 * size + 2))
    compute(cache, first, first.num_tokens)
    for i in (0, size - 1, size, 2 * size - 1):  # the first and last token of a block
        tokens = list(range(1, 3 * size + 2))
        tokens[i] = 9999
        assert cache.lookup(seq(tokens, "1")).num_tokens == i // size * size, i


def test_prefix_block_size():
    from runtime.cache.layout import CacheLayout

    no_attention = CacheLayout((), None, None, None, 1)
    assert prefix_block_size(no_attention, 32, 16) == 32
    assert prefix_block_size(no_attention, 24, 16) == 48
    assert prefix_block_size(no_attention, None, 16) == 16  # Mamba-1: any boundary holds a state


def test_attention_blocks_are_shared_and_reference_counted(tmp_path):
    layout = layout_of(tmp_path, LLAMA)
    size = layout.block_size
    cache = manager(layout, num_pages=16)
    first = seq(range(1, 3 * size + 2))
    compute(cache, first, first.num_tokens)
    assert cache.num_cached_pages == 3
    second = seq(range(1, 3 * size + 2), "1")
    hit = cache.lookup(second)
    assert hit.num_tokens == 3 * size and hit.blocks == tuple((p,) for p in first.block_tables[0][:3])
    compute(cache, second, second.num_tokens - hit.num_tokens)
    assert second.block_tables[0][:3] == first.block_tables[0][:3]
    assert second.num_cached_tokens == 3 * size
    cache.free(first)
    assert all(cache._refs[p] == 1 for p in second.block_tables[0][:3])
    cache.free(second)
    assert cache.num_free_pages == 16 and cache.num_cached_pages == 3
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (2 * (3 * size + 1), 3 * size)


def test_free_pages_holding_nothing_are_used_before_cached_ones_and_those_least_recently_used_first(tmp_path):
    layout = layout_of(tmp_path, LLAMA)
    size = layout.block_size
    cache = manager(layout, num_pages=6)
    old, new = seq(range(1, 2 * size + 1)), seq(range(100, 100 + 2 * size + 1), "1")
    for s in (old, new):
        compute(cache, s, s.num_tokens)
        cache.free(s)
    # 2 + 2 full blocks cached, 2 pages (partial blocks) free and uncached.
    assert cache.num_cached_pages == 4
    third = seq(range(200, 200 + 3 * size), "2")
    cache.admit(third, cache.lookup(third), third.num_tokens)
    # The two uncached pages, then the least recently used: `old`'s second block (freed first).
    assert cache.num_cached_pages == 3
    assert cache.lookup(seq(range(1, 2 * size + 1))).num_tokens == size
    assert cache.lookup(seq(range(100, 100 + 2 * size + 1))).num_tokens == 2 * size


def test_a_state_snapshot_is_copied_out_at_a_cut_and_into_a_sequence_that_resumes(hybrid):
    size = hybrid.block_size
    cache = manager(hybrid, num_pages=20)
    first = seq(range(1, 2 * size + 5))
    compute(cache, first, 2 * size)  # a chunk that the scheduler cut at the last boundary
    copies = cache.take_copies()
    snapshot = cache.prefix.snapshots[cache.prefix.hashes(first)[1]]
    assert copies == list(zip(first.state_pages, snapshot))
    compute(cache, first, 4)
    assert cache.take_copies() == []  # the prompt's end is not a boundary: no snapshot
    second = seq(range(1, 2 * size + 9), "1")
    hit = cache.lookup(second)
    assert (hit.num_tokens, hit.snapshot) == (2 * size, snapshot)
    compute(cache, second, second.num_tokens - hit.num_tokens)
    assert cache.take_copies() == list(zip(snapshot, second.state_pages))


def test_snapshot_pages_are_not_handed_out_before_their_copy(hybrid):
    size = hybrid.block_size
    states = hybrid.num_state_groups
    cache = manager(hybrid, num_pages=3 + 2 * states)
    first = seq(range(1, 2 * size + 5))
    compute(cache, first, 2 * size)
    compute(cache, first, 4)
    cache.free(first)
    second = seq(range(1, 2 * size + 9), "1")
    hit = cache.lookup(second)
    # 3 pages free beside the snapshot; the hit needs its state pages and one block.
    assert hit.num_tokens == 2 * size and cache.can_admit(second, hit, 8)
    cache.admit(second, hit, 8)
    assert not set(second.state_pages) & set(hit.snapshot)
    third = seq(range(1, 2 * size + 9), "2")
    assert not cache.can_admit(third, cache.lookup(third), 8)


def test_without_attention_a_snapshot_alone_makes_a_hit(tmp_path):
    layout = layout_of(tmp_path, MAMBA2)
    cache = manager(layout, num_pages=8, block_size=32)
    first = seq(range(1, 70))
    compute(cache, first, 64)
    compute(cache, first, 5)
    assert cache.lookup(seq(range(1, 80), "1")).num_tokens == 64
    assert cache.lookup(seq(range(1, 60), "2")).num_tokens == 0  # only the 64-token boundary was kept


def test_chunks_end_at_the_last_boundary_and_where_a_prompt_leaves_what_was_seen(hybrid):
    size = hybrid.block_size
    cache = manager(hybrid, num_pages=64)
    scheduler = Scheduler(cache, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=10 * size))
    first = seq(range(1, 4 * size + 10))
    scheduler.add(first)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4 * size]  # the last boundary of the prompt
    scheduler.update(batch)
    # Shares 2 blocks and a half with `first`: its first chunk ends where it leaves them.
    second = seq([*range(1, 2 * size + size // 2), *range(500, 500 + 2 * size)], "1")
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_new_tokens == [9, 2 * size]
    scheduler.update(batch)
    assert cache.prefix.has_snapshot(cache.prefix.hashes(second)[1])


def test_a_chunk_cut_by_the_budget_ends_on_a_boundary(hybrid):
    size = hybrid.block_size
    cache = manager(hybrid, num_pages=64)
    scheduler = Scheduler(cache, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=size + size // 2))
    s = seq(range(1, 3 * size + 10))
    scheduler.add(s)
    chunks = []
    while s.num_computed_tokens < s.num_tokens:
        batch = scheduler.schedule()
        chunks.append(batch.num_new_tokens[0])
        scheduler.update(batch)
    assert chunks == [size, size, size, 9]


def test_reset_forgets_everything_and_keeps_pages_in_use(hybrid):
    cache = manager(hybrid, num_pages=20)
    first = seq(range(1, 2 * hybrid.block_size + 5))
    compute(cache, first, 2 * hybrid.block_size)
    held = cache.num_pages - cache.num_free_pages
    cache.reset_prefix_cache()
    assert cache.num_cached_pages == 0 and cache.num_pages - cache.num_free_pages == held
    compute(cache, first, 4)
    cache.free(first)
    assert cache.num_free_pages == 20 and not any(cache._refs)


# Bookkeeping outcomes asserted here, not left to the runtime's own asserts (`python -O` removes those).


def test_a_shared_block_leaves_the_free_queue_and_is_never_handed_out_again(tmp_path):
    layout = layout_of(tmp_path, LLAMA)
    size = layout.block_size
    cache = manager(layout, num_pages=8)
    first = seq(range(1, 2 * size + 2))
    compute(cache, first, first.num_tokens)
    cached = first.block_tables[0][:2]
    cache.free(first)
    assert cache.num_free_pages == 8 and cache.num_cached_pages == 2
    second = seq(range(1, 2 * size + 2), "1")
    compute(cache, second, second.num_tokens - cache.lookup(second).num_tokens)
    assert second.block_tables[0][:2] == cached
    assert cache.num_free_pages == 8 - 3  # the two cached blocks it shares and a new third one
    # Every page left goes to a third sequence: none that `second` holds.
    third = seq(range(500, 500 + 5 * size), "2")
    assert cache.can_admit(third, cache.lookup(third), third.num_tokens)
    compute(cache, third, third.num_tokens)
    assert not set(third.block_tables[0]) & set(second.block_tables[0])
    assert cache.num_free_pages == 0 and not cache.can_admit(seq([9], "3"), cache.lookup(seq([9], "3")), 1)
    cache.free(second)
    cache.free(third)
    assert cache.num_free_pages == 8 and not any(cache._refs)


def decode(scheduler: Scheduler) -> list[Sequence]:
    """One scheduled step, and a new token for each sequence whose prompt is done; returns the step's sequences."""
    batch = scheduler.schedule()
    scheduler.update(batch)
    for s in batch.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(7)
    return batch.seqs


def test_a_preempted_sequence_keeps_no_pages_and_nothing_computed(tmp_path):
    layout = layout_of(tmp_path, LLAMA)
    size = layout.block_size
    cache = manager(layout, num_pages=4)
    scheduler = Scheduler(cache, SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=4 * size))
    first, second = seq(range(1, size + 1)), seq(range(100, 100 + size + 1), "1")
    scheduler.add(first)
    scheduler.add(second)
    while len(decode(scheduler)) == 2:
        pass  # two pages each, then `first` needs a third: the last admitted is preempted
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    assert second.num_computed_tokens == 0 and not second.has_pages and second.num_preemptions == 1
    assert second.num_uncomputed_tokens == second.num_tokens and second.output_token_ids
    assert cache.num_free_pages == 4 - len(first.block_tables[0])
    # Readmitted, it computes its whole text again, less what it finds cached.
    scheduler.finish(first, "length")
    assert decode(scheduler) == [second]
    assert second.num_computed_tokens == second.num_tokens - 1 and second.num_preemptions == 1
    scheduler.finish(second, "length")
    assert cache.num_free_pages == 4 and not any(cache._refs)
