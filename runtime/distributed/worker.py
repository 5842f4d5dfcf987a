"""What ranks 1..N-1 run: load the model shards rank 0 asks for, then execute every step it sends."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist

from runtime.distributed.group import START_TIMEOUT, Group, watch_parent

logger = logging.getLogger("tandem")


def worker_main(rank: int, world_size: int, backend: str, init_method: str, parent_pid: int, ready: Any) -> None:
    """A spawned worker: join the group, serve rank 0 until it says stop (or goes away)."""
    watch_parent(parent_pid)
    ready.send(True)
    ready.close()
    # Ctrl-C in a terminal reaches every process of the group: rank 0 alone decides how the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=START_TIMEOUT)
    try:
        serve_forever(Group(world_size, backend, []), rank)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def serve_forever(group: Group, local_rank: int) -> None:
    from runtime.distributed.runner import load_local

    runners: dict[int, Any] = {}
    while True:
        kind, *args = group.receive()
        if kind == "stop":
            return
        if kind == "load":
            engine_id, options = args
            runner, _ = load_local(group, options, local_rank)
            if runner is not None:
                runners[engine_id] = runner
        elif kind == "execute":
            engine_id, plan = args
            runners[engine_id].execute_plan(plan)
        elif kind == "copy":
            engine_id, copies = args
            runners[engine_id].copy_pages(copies)
        elif kind == "describe":
            from runtime.distributed.pipeline import describe

            group.gather(describe(runners[args[0]]))
        elif kind == "lora_add":  # pipeline stages: each checks its own layers' part of the adapter
            engine_id, request = args
            group.gather(lora_error(runners[engine_id], request))
        elif kind == "unload":
            runners.pop(args[0], None)
        else:
            raise AssertionError(f"unknown message {kind!r}")


def lora_error(runner: Any, request: Any) -> str | None:
    """Read and check `request`'s adapter on this rank: its error message, or None."""
    try:
        runner.lora.add(request)
    except ValueError as err:
        return str(err)
    return None
