"""Rank 0's model runner for a tensor-parallel engine: the engine sees one ModelRunner.

Each step's plan (runtime.runner.StepPlan, plain Python) goes to every rank first; then every rank,
this one included, builds the same inputs and runs its shard. The LM head's logits are gathered on
every rank; rank 0 alone samples, and the next plan carries the tokens it chose.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from runtime.config import EngineConfig
from runtime.distributed import pipeline
from runtime.distributed.env import local_rank
from runtime.distributed.group import Group, backend_for, current, ensure_group
from runtime.distributed.group import shutdown as shutdown_group
from runtime.distributed.sharding import check_sharding
from runtime.dtypes import DTYPES
from runtime.loader import default_dtype
from runtime.quant import parallel as quant_parallel
from runtime.runner import ModelRunner, PromptLogits, StepPlan, plan_step, split_logits
from runtime.scheduler import Batch
from runtime.sequence import Sequence

# How long a failed step waits to see a worker exit before it reports "a rank" unnamed (a killed stage's
# connection reset arrives first, sometimes, and the process is reaped a moment later).
LOST_RANK_WAIT_S = 2.0

logger = logging.getLogger("tandem")


def config_options(config: EngineConfig) -> dict[str, Any]:
    """The keywords that rebuild `config` in another process."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def load_local(group: Group, options: dict[str, Any], rank: int) -> tuple[ModelRunner | None, list[str | None]]:
    """This rank's shard of the model (every rank calls it for the same options), and each rank's error;
    no runner if any rank failed."""
    if group.backend == "nccl":
        options = {**options, "device": f"cuda:{rank}"}
    runner, error = None, None
    try:
        config = EngineConfig(**options)
        pipeline.enter(config)  # every rank (creating the stages' groups is collective)
        runner = ModelRunner(config)
    except Exception as err:  # reported to rank 0, which raises it
        logger.debug("rank %d could not load the model", rank, exc_info=True)
        error = f"{type(err).__name__}: {err}"
    errors = group.gather(error)
    if any(errors):
        return None, errors
    # Ranks may measure different free memory: the smallest pool is the one every rank can hold.
    num_pages = min(group.gather(runner.num_pages))
    if runner.num_pages != num_pages:
        runner.resize_pool(num_pages)
    return runner, errors


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a sharding or a split into stages that cannot work: the model built on the meta device (no
    memory), sharded, and its layers planned into stages."""
    if config.tensor_parallel_size > 1:
        module_name, _, class_name = config.declaration.implementation.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        with default_dtype(DTYPES[config.model_dtype]), torch.device("meta"):
            model = cls(config.dims)
        if config.checkpoint_quantization is not None or config.quantization is not None:
            quant_parallel.check_sharding(config, model)  # its quantized linears cut as they will be
        else:
            check_sharding(model, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:
        pipeline.stage_plan(config)


def serve_torchrun_rank(config: EngineConfig) -> int:
    """A rank other than 0 of a command under torchrun: execute rank 0's steps until it stops (then exit)."""
    check_tensor_parallel(config)
    ensure_group(config.world_size, config.device)
    raise AssertionError("only rank 0 of a torchrun group leads it")


@dataclass
class InFlight:
    """A pipeline step submitted and not yet collected: its plan and whose logits it brings."""

    plan: StepPlan
    sample_seqs: list[Sequence]
    prompt_seqs: list[Sequence]


class TensorParallelRunner:
    """Rank 0's runner of a group: tensor parallelism, pipeline parallelism or both (the stages run each
    step in turn; rank 0, the first stage's first rank, receives the logits)."""

    def __init__(self, config: EngineConfig):
        tp = config.world_size
        check_tensor_parallel(config)  # before any process starts
        self.group = ensure_group(tp, config.device)
        self.engine_id = self.group.next_id()
        options = config_options(config)
        self.group.send(("load", self.engine_id, options))
        local, errors = load_local(self.group, options, local_rank())
        if local is None:
            raise ValueError("loading the model failed on " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors)
                                                                         if e))
        self.local = local
        self.in_flight: deque[InFlight] = deque()  # pipeline steps submitted, not yet collected
        logger.info("parallel: rank 0 of %d (tensor %d x pipeline %d), %s", tp, config.tensor_parallel_size,
                    config.pipeline_parallel_size, backend_for(config.device))

    def __getattr__(self, name: str) -> Any:
        # device, num_pages, model, layout, kernel_backend, ...: rank 0's, the same shapes as every rank's.
        if "local" not in self.__dict__:
            raise AttributeError(f"{name}: this tensor-parallel runner is shut down")
        return getattr(self.__dict__["local"], name)

    def execute(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor]:
        seqs, logits, _ = self.run(batch)
        return seqs, logits

    def run(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor, list[PromptLogits]]:
        if self.stage_model is not None:
            return self.collect(self.submit(batch))
        local = self.local
        plan, sample_seqs, prompt_seqs = plan_step(batch, local.layout.num_attention_groups,
                                                   local.layout.num_state_groups)
        with self._watched():
            self.group.send(("execute", self.engine_id, plan))
            logits = local.execute_plan(plan)
        return split_logits(logits, plan, sample_seqs, prompt_seqs)

    def submit(self, batch: Batch) -> InFlight:
        """Pipeline parallelism: start a step (every rank gets its plan, rank 0 runs the first stage and passes
        the hidden states on) and return without waiting for its logits; `collect` them, in order."""
        local = self.local
        plan, sample_seqs, prompt_seqs = plan_step(batch, local.layout.num_attention_groups,
                                                   local.layout.num_state_groups)
        plan.greedy_ids = pipeline.greedy_ids_suffice(plan, sample_seqs)
        with self._watched():
            self.group.post(("execute", self.engine_id, plan))
            with torch.inference_mode():
                pipeline.start_stage(local, plan)
        flight = InFlight(plan, sample_seqs, prompt_seqs)
        self.in_flight.append(flight)
        return flight

    def collect(self, flight: InFlight) -> tuple[list[Sequence], torch.Tensor, list[PromptLogits]]:
        """The logits of `flight`, the oldest step in flight, from the last stage."""
        assert self.in_flight and self.in_flight[0] is flight, "micro-batches are collected in the order submitted"
        with self._watched():
            logits = pipeline.receive_logits(self.local, flight.plan)
        self.in_flight.popleft()
        return split_logits(logits, flight.plan, flight.sample_seqs, flight.prompt_seqs)

    @contextmanager
    def _watched(self) -> Iterator[None]:
        self.group.busy = True
        try:
            yield
        except Exception as err:
            self._lost(err)
            raise
        self.group.busy = False

    def _lost(self, err: Exception) -> None:
        """A step failed in the group's messages: if a rank is gone, stop the rest and say which one."""
        group_error = isinstance(err, dist.DistError) or any(w in str(err) for w in ("gloo", "NCCL"))
        dead = self._dead(LOST_RANK_WAIT_S if group_error else 0.0)
        if not dead and not group_error:
            return
        if current() is self.group:
            shutdown_group()  # the others are stopped (asked, terminated, killed); nothing is left running
        tp = self.local.config.tensor_parallel_size
        named = ", ".join(f"rank {r} (stage {r // tp}, pid {pid}, exit code {code})" for r, pid, code in dead)
        raise RuntimeError(f"the parallel group lost {named or 'a rank'} during a step ({err}); the engine "
                           "stopped and its processes with it: start it again") from err

    def _dead(self, wait_s: float) -> list[tuple[int, int, int | None]]:
        """(rank, pid, exit code) of the workers that are gone, waiting up to `wait_s` for one to be: a peer's
        connection reset can reach this rank before the killed process is reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(rank, p.pid, p.exitcode) for rank, p in enumerate(self.group.processes, 1) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    @property
    def lora(self) -> Any:
        local = self.__dict__["local"]
        return StagesLoRA(self) if local.lora is not None and local.stage_model is not None else local.lora

    def describe(self) -> list[dict[str, Any]]:
        """What each rank holds (runtime.distributed.pipeline.describe), in rank order."""
        self.group.send(("describe", self.engine_id))
        return self.group.gather(pipeline.describe(self.local))

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        # Posted, not waited for: a stage still busy with a step in flight copies after it, as rank 0 does.
        with self._watched():
            self.group.post(("copy", self.engine_id, copies))
        self.local.copy_pages(copies)

    def shutdown(self) -> None:
        """Free the workers' shards of this engine's model (the group stays, for the next engine)."""
        if current() is self.group and "local" in self.__dict__:
            while self.in_flight:  # their logits are on their way to rank 0: taken, so none is left behind
                self.collect(self.in_flight[0])
            self.group.send(("unload", self.engine_id))
            del self.__dict__["local"]


class StagesLoRA:
    """Rank 0's LoRA manager under pipeline parallelism: each stage holds its own layers' part of an adapter, so
    every rank reads and checks it before a request with it is queued (a bad one is refused then, not mid-step)."""

    def __init__(self, runner: TensorParallelRunner):
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner.local.lora, name)

    def add(self, request: Any) -> None:
        from runtime.distributed.worker import lora_error

        runner = self.runner
        runner.group.send(("lora_add", runner.engine_id, request))
        errors = runner.group.gather(lora_error(runner.local, request))
        first = next((e for e in errors if e), None)
        if first is not None:
            raise ValueError(first)
