"""The spawned workers of a tensor-parallel group stop with it, even where torch.distributed was torn down first."""

import time

import torch.distributed as dist

from runtime.distributed import group


def test_a_group_left_by_someone_else_still_stops_its_workers():
    # A worker never asked to stop waited in its receive until the 300 s timeout, holding the suite's exit up.
    workers = group.ensure_group(2, "cpu").processes
    assert workers and all(process.is_alive() for process in workers)
    dist.destroy_process_group()
    started = time.monotonic()
    group.shutdown()
    assert not any(process.is_alive() for process in workers)
    assert time.monotonic() - started < 10  # terminated, not waited for
    assert group.current() is None
