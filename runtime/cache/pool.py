"""The one page pool: a single allocation, and each layer's strided views into it.

The pool is `(num_pages, group_size, page_bytes)` bytes. Page id p holds one layer page
for each of the `group_size` layers of the group that owns p; layer j of a group reads
slab j. An attention page is K and V for `block_size` tokens; a state page is a
sequence's conv state then SSM state, then padding up to the attention page size.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

from runtime.cache.layout import CacheLayout
from runtime.cache.protocol import KVCacheLayer, StateCacheLayer
from runtime.cache.spec import AttentionSpec, MambaSpec
from runtime.dtypes import DTYPES
from runtime.hf_config import ConfigError

logger = logging.getLogger("tandem")

CPU_CACHE_BYTES = 4 * 1024**3  # vLLM's default CPU KV-cache space
GPU_MEMORY_UTILIZATION = 0.9


def default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - (1 - GPU_MEMORY_UTILIZATION) * total)
    return CPU_CACHE_BYTES


HUGE_PAGE = 2 * 1024**2


def allocate_pool(layout: CacheLayout, num_pages: int, device: torch.device) -> torch.Tensor:
    # Zeroed: attention kernels may read (and mask) stale bytes of a partly filled page,
    # and a NaN there would survive a zero softmax weight.
    shape = (num_pages, layout.group_size, layout.page_size_bytes)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=torch.uint8, device=device)
    return huge_page_zeros(shape)


def huge_page_zeros(shape: tuple[int, ...]) -> torch.Tensor:
    """Zeroed CPU bytes on 2 MiB pages where Linux grants them (transparent huge pages, asked for by
    madvise): a decode step reads each sequence's keys, values and states from pages scattered over the
    pool, and on 4 KiB pages most of those reads also missed the TLB. A private anonymous mapping is
    zero-filled, and the tensor keeps it alive."""
    size = math.prod(shape)
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=torch.uint8)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The mapping is 4 KiB-aligned; the pool starts at its first 2 MiB boundary.
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, size - size % HUGE_PAGE)
    except OSError:  # no transparent huge pages here: 4 KiB pages, as torch.zeros gives
        pass
    return torch.frombuffer(region, dtype=torch.uint8, count=size, offset=start).view(shape)


def attention_views(pool: torch.Tensor, slab: int, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer: (num_pages, block_size, num_kv_heads, head_size) each."""
    pages = pool[:, slab].view(DTYPES[spec.dtype])
    kv = pages.view(pool.shape[0], 2, spec.block_size, spec.num_kv_heads, spec.head_size)
    return kv[:, 0], kv[:, 1]


def state_views(pool: torch.Tensor, slab: int, spec: MambaSpec) -> list[torch.Tensor]:
    """One layer's state tensors, each (num_pages, *shape), at their offsets in the page."""
    views = []
    for shape, dtype, offset, nbytes in zip(spec.shapes, spec.dtypes, spec.state_offsets(), spec.state_bytes):
        raw = pool[:, slab, offset : offset + nbytes]
        views.append(raw.view(DTYPES[dtype]).view(pool.shape[0], *shape))
    return views


def _check(owner: str, what: str, module_value, spec_value) -> None:
    if tuple(module_value) != tuple(spec_value):
        raise ConfigError(
            f"{owner}: the module caches {what} {tuple(module_value)}, but the resolved config says "
            f"{tuple(spec_value)}; the declaration and the implementation disagree"
        )


def bind_pool(model: torch.nn.Module, pool: torch.Tensor, layout: CacheLayout) -> None:
    """Give each cache-bearing layer its group and its views, checking them against the resolved specs."""
    attention = sorted((m for m in model.modules() if isinstance(m, KVCacheLayer)), key=lambda m: m.layer_idx)
    states = sorted((m for m in model.modules() if isinstance(m, StateCacheLayer)), key=lambda m: m.layer_idx)
    name = type(model).__name__
    _check(name, "attention in layers", [m.layer_idx for m in attention], layout.attention_layers)
    _check(name, "state in layers", [m.layer_idx for m in states], layout.state_layers)
    for j, module in enumerate(attention):
        group, slab = divmod(j, layout.group_size)
        spec = layout.attention
        _check(f"{name} layer {module.layer_idx}", "KV heads x head size",
               module.kv_shape(), (spec.num_kv_heads, spec.head_size))
        module.bind(group, *attention_views(pool, slab, spec))
    for j, module in enumerate(states):
        group, slab = divmod(j, layout.group_size)
        shapes = module.state_shapes()
        for k, (shape, spec_shape) in enumerate(zip(shapes, layout.mamba.shapes)):
            _check(f"{name} layer {module.layer_idx}", f"state {k}", shape, spec_shape)
        module.bind(group, *state_views(pool, slab, layout.mamba))
