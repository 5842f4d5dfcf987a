"""Tensor-parallel options as the config resolves them, without starting any process."""

from pathlib import Path

from runtime.config import EngineConfig, usable_cores

BAMBA_9B = Path(__file__).parents[2] / "docs" / "configs" / "ibm-ai-platform__Bamba-9B"


def test_ranks_on_one_machine_share_its_cores(monkeypatch):
    monkeypatch.delenv("TANDEM_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = EngineConfig(str(BAMBA_9B)).derived_threads
    assert one == usable_cores()  # a wide model: every core on one device
    assert EngineConfig(str(BAMBA_9B), tensor_parallel_size=2).derived_threads == max(1, one // 2)


def test_the_cache_is_laid_out_per_rank():
    """The shapes `tandem plan --tp 2` prints: half the Mamba heads and x channels per rank, and the one
    group's B and C (2 x 128 channels) whole on each."""
    one, two = EngineConfig(str(BAMBA_9B)).cache, EngineConfig(str(BAMBA_9B), tensor_parallel_size=2).cache
    assert one.mamba.shapes == ((3, 8192 + 2 * 128), (128, 64, 128))
    assert two.mamba.shapes == ((3, 8192 // 2 + 2 * 128), (64, 64, 128))
    assert two.attention.num_kv_heads == one.attention.num_kv_heads // 2
