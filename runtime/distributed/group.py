"""The process group: started here with worker processes (torch.multiprocessing, spawn), or joined under torchrun.

One group per process, kept until exit (or `shutdown`), so that every tensor-parallel engine built in
the process reuses it. Rank 0 is the caller: it schedules, and sends each step to the other ranks
as a message on a gloo group (the CPU side, also under NCCL); the workers only execute.

Workers never outlive rank 0: a normal exit, an error, Ctrl-C or SIGTERM of rank 0 stops them
(`shutdown` runs at exit), and a worker whose parent dies exits by itself (PR_SET_PDEATHSIG on
Linux, and a thread that watches its parent id everywhere).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.distributed.env import under_torchrun
from runtime.options import spell

logger = logging.getLogger("tandem")

START_TIMEOUT = timedelta(seconds=300)
CONTROL_TAG = 1  # rank 0's messages, apart from a pipeline stage's hidden states (tag 0) on the same pair
STOP_TIMEOUT = 10.0  # seconds workers get to leave on their own before they are terminated


def backend_for(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Group:
    """Rank 0's handle on the group: send messages to the workers, and stop them."""

    def __init__(self, world_size: int, backend: str, processes: list[Any]):
        self.world_size, self.backend, self.processes = world_size, backend, processes
        self.control = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.busy = False  # inside a message's collectives: a stop message then could not pair up
        self._ids = 0
        self._posted: list[Any] = []  # (work, tensor) of messages still on their way (see `post`)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def send(self, message: tuple) -> None:
        self.post(message)
        self.flush()

    def post(self, message: tuple) -> None:
        """Send `message` to every worker without waiting for them to take it. Point to point, one send per
        worker: a collective (gloo's broadcast) returns only once every rank joined it, and a later pipeline
        stage busy with an earlier micro-batch would hold back the message from the stages before it."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.long)
        self._posted = [(w, t) for w, t in self._posted if not w.is_completed()]
        for rank in range(1, self.world_size):
            for tensor in (size, data):  # the work keeps its tensor; so does this list, to be sure
                self._posted.append((dist.isend(tensor, rank, group=self.control, tag=CONTROL_TAG), tensor))

    def flush(self) -> None:
        """Wait until every worker took every posted message."""
        posted, self._posted = self._posted, []
        for work, _ in posted:
            work.wait()

    def receive(self) -> Any:
        """A worker's next message from rank 0 (`post`)."""
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, 0, group=self.control, tag=CONTROL_TAG)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, 0, group=self.control, tag=CONTROL_TAG)
        return pickle.loads(data.numpy().tobytes())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (rank 0's first)."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.control)
        return values

    def shutdown(self) -> None:
        """Stop the workers (asked first, then terminated, then killed) and leave the group."""
        # With the group already left (torch.distributed destroyed by someone else), the workers cannot be asked;
        # they are still ours to stop: one left waiting held the interpreter's exit up until its receive timed out.
        running = dist.is_initialized()
        asked = False
        if running and not self.busy:
            try:
                self.send(("stop",))
                asked = True
            except Exception:  # a worker already gone: terminate the rest below
                pass
        deadline = time.monotonic() + (STOP_TIMEOUT if asked else 0.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        if running:
            try:
                dist.destroy_process_group()
            except Exception:
                pass


_group: Group | None = None


def current() -> Group | None:
    return _group


def ensure_group(world_size: int, device: str) -> Group:
    """The group of `world_size` ranks this process leads, started (or joined, under torchrun) on first use.

    Under torchrun, a rank other than 0 runs the worker loop here and exits when rank 0 stops it.
    """
    global _group
    if _group is not None and _group.world_size == world_size:
        return _group
    if _group is not None:
        shutdown()
    backend = backend_for(device)
    if under_torchrun():
        _group = _join(world_size, backend)
    else:
        _group = _spawn(world_size, backend)
    atexit.register(shutdown)
    return _group


def shutdown() -> None:
    global _group
    if _group is not None:
        group, _group = _group, None
        group.shutdown()
        from runtime.distributed.pipeline import forget_groups

        forget_groups()


def _spawn(world_size: int, backend: str) -> Group:
    from runtime.distributed.worker import worker_main

    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"{spell('tensor_parallel_size', world_size)} needs {world_size} GPUs (one per rank) but this "
            f"machine has {torch.cuda.device_count()}; use at most {torch.cuda.device_count()}, run under torchrun "
            f"across machines, or pass {spell('device', 'cpu')}"
        )

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    processes = []
    try:
        for rank in range(1, world_size):
            ready, ready_in_worker = context.Pipe(duplex=False)
            process = context.Process(target=worker_main, name=f"tandem-tp-rank{rank}", daemon=True,
                                      args=(rank, world_size, backend, init_method, os.getpid(), ready_in_worker))
            process.start()
            processes.append(process)
            _wait_started(process, rank, ready)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=world_size,
                                timeout=START_TIMEOUT)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    logger.info("tensor parallel: %d ranks over %s (workers %s)", world_size, backend,
                ", ".join(str(p.pid) for p in processes))
    return Group(world_size, backend, processes)


def _wait_started(process: Any, rank: int, ready: Any) -> None:
    """Wait until the worker runs our code; one that dies first (a script without a main guard) is named."""
    while not ready.poll(0.1):
        if not process.is_alive():
            raise ValueError(
                f"tensor-parallel worker rank {rank} exited with code {process.exitcode} before it started; "
                "workers are started with multiprocessing's spawn, which imports the main module again: "
                "guard a script's entry point with `if __name__ == '__main__':`"
            )
    ready.close()


def _join(world_size: int, backend: str) -> Group:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"torchrun started {env_world} processes but the engine needs {world_size} "
                         f"({spell('tensor_parallel_size')} x {spell('pipeline_parallel_size')}); pass "
                         f"--nproc-per-node (times --nnodes) = {world_size}, or sizes whose product is {env_world}")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=START_TIMEOUT)
    group = Group(world_size, backend, [])
    if rank != 0:
        from runtime.distributed.worker import serve_forever

        serve_forever(group, local_rank)
        dist.destroy_process_group()
        sys.exit(0)
    return group


def watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as the process that started it is gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()
