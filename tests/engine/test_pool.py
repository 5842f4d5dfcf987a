"""The page pool's CPU memory: zeroed, aligned to a huge page, and asked for on huge pages."""

import gc
import re
from pathlib import Path

import pytest
import torch

from runtime.cache.pool import HUGE_PAGE, huge_page_zeros


def mapping_flags(address: int) -> list[str]:
    """VmFlags of the mapping that holds `address`, from /proc/self/smaps."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(part, 16) for part in block.split()[0].split("-"))
        if start <= address < end:
            return re.search(r"VmFlags:(.*)", block).group(1).split()
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pool_is_zeroed_writable_and_outlives_its_mapping_object():
    pool = huge_page_zeros((3, 2, HUGE_PAGE // 4 + 8))
    assert pool.shape == (3, 2, HUGE_PAGE // 4 + 8) and pool.dtype == torch.uint8
    assert pool.data_ptr() % HUGE_PAGE == 0
    assert int(pool.sum()) == 0
    gc.collect()  # the mmap object lives on in the tensor alone
    pool[2, 1, -1] = 7
    pool.view(torch.float32)[0, 0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert int(pool[2, 1, -1]) == 7 and pool.view(torch.float32)[0, 0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_the_pool_asks_for_huge_pages_where_linux_has_them():
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        pytest.skip("transparent huge pages are off here")
    pool = huge_page_zeros((4, HUGE_PAGE))
    assert "hg" in mapping_flags(pool.data_ptr())  # madvise(MADV_HUGEPAGE) took


def test_a_small_pool_is_plain_zeros():
    pool = huge_page_zeros((2, 3, 5))
    assert pool.shape == (2, 3, 5) and int(pool.sum()) == 0
