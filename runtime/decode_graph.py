"""Captured decode steps on a CPU: a step of B decodes recorded once, then replayed without the model's Python.

At one sequence a decode step's kernels take about 11 ms on the bench's hybrid (bfloat16), and the Python
around them (module calls, the native kernels' wrappers, the torch ops between them) another 6-9 ms: 20-40 us
for each of ~150 launches. vLLM's GPU path removes the same cost with CUDA graphs; this is their CPU
counterpart. While a decode step of B sequences runs the first time, every torch op is recorded with its
tensors into one ordered program; the native kernels are torch operators (`tandem::...`, cpu_native.py) and
are recorded as any other op. Later steps of B decodes write their token ids, positions, page ids and lengths
into the same input tensors and replay the program: the ops that depend on the step, on the same tensors,
nothing else. A graph belongs to the page pool it was recorded against: a runner with another pool drops it.
A speculative verify step is decode rows too (runtime/waves.py): it is captured by its rows per sequence,
with the pages that keep its states among the inputs and its logits gathered in sampling order.

Which torch ops replay follows from the data: the step's inputs and the page pool are marked; an op that
reads marked memory, or allocates, marks its outputs. A marked op replays; a view costs nothing; an op on
the weights alone (a float32 copy of a bfloat16 vector, -exp(A_log)) ran once at capture and its result is
kept. An op that reads a marked tensor's values into Python (`.item()`, a data-dependent shape) cannot be
replayed: the capture is dropped (the step it ran is still correct) and that engine stays eager.

A capture costs 3-6 replays (the dispatch mode sees every op), so a batch size is captured the second time
it runs, never for a size seen once. Every intermediate a graph touched stays allocated while the graph
lives (19 MB at 32 sequences of the bench's hybrid in bfloat16, 28 MB in float32), so graphs are kept for the
most recent MAX_GRAPHS batch sizes. `enforce_eager` (as vLLM's) turns them off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter, OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from runtime.context import ForwardContext, forward_context
from runtime.kernels.metadata import AttentionMetadata
from runtime.waves import decode_waves

logger = logging.getLogger("tandem")

MAX_GRAPHS = 8
# Ops that allocate without defining their contents: the output is the step's memory, never replayed.
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default,
                torch.ops.aten.new_empty_strided.default}
# A tensor made from Python data inside the forward may hold a per-step value the replay would not see.
_FROM_PYTHON = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class NotCapturable(Exception):
    """The step ran an op a replay cannot repeat."""


class DecodeGraph:
    """One captured step of decode rows: `counts` rows per sequence, 1 for a decode and 1 + k for a verify of k
    drafts (runtime/waves.py), with the input tensors it reads."""

    def __init__(self, runner: Any, counts: tuple[int, ...], lora: bool = False):
        self.counts = counts
        num_seqs, rows = len(counts), sum(counts)
        waves = decode_waves(list(counts))
        layout, device = runner.layout, runner.device
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        # Block tables as wide as the longest sequence's, so that their stride (which the kernels read) holds.
        max_len = runner.config.derived_max_model_len
        self.width = -(-max_len // layout.block_size) if layout.block_size else 0
        self.block_tables = tuple(torch.zeros(rows, self.width, dtype=torch.int32, device=device)
                                  for _ in range(layout.num_attention_groups))
        self.slot_mappings = tuple(torch.zeros(rows, **long) for _ in range(layout.num_attention_groups))
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.state_pages = tuple(torch.zeros(num_seqs, **long) for _ in range(layout.num_state_groups))
        verify = rows > num_seqs
        self.wave_pages = tuple(torch.zeros(len(waves) + 1, num_seqs, **long)
                                for _ in range(layout.num_state_groups)) if verify else ()
        # A verify's logits go to sampling sequence by sequence, each sequence's rows in order.
        self.logits_order = torch.arange(rows, **long) if verify else None
        attention = None
        if layout.block_size:
            starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
            attention = AttentionMetadata(rows, starts, self.seq_lens, max_query_len=1, max_seq_len=max_len)
        # A step with LoRA adapters reads each row's slot; the slots' contents change in place as adapters swap.
        self.lora_indices = torch.zeros(rows, **long) if lora else None
        self.lora = runner.lora if lora else None
        self.context = ForwardContext(rows, 0, attention, self.block_tables, self.slot_mappings, None,
                                      self.state_pages, tuple(p[num_seqs:] for p in self.state_pages),
                                      lora_indices=self.lora_indices, decode_waves=tuple(waves) if verify else (),
                                      wave_state_pages=self.wave_pages)
        self.program: list[Callable[[], None]] = []
        self.logits: torch.Tensor | None = None
        self.pool: torch.Tensor | None = None  # the page pool the program reads and writes
        self._held: list[torch.Tensor] = []  # every tensor the program reads or writes, kept allocated

    def fits(self, plan: Any) -> bool:
        return all(len(table) <= self.width for tables in plan.block_tables for table in tables)

    def fill(self, plan: Any, block_size: int) -> None:
        """Write the step's inputs where the program reads them."""
        self.input_ids.copy_(torch.tensor(plan.input_ids))
        self.positions.copy_(torch.tensor(plan.positions))
        if block_size:
            self.seq_lens.copy_(torch.tensor([p + 1 for p in plan.positions]))
            row_seqs = plan.row_sequences()
            for table, slots, tables in zip(self.block_tables, self.slot_mappings, plan.block_tables):
                rows = [tables[s] + [0] * (self.width - len(tables[s])) for s in row_seqs]
                table.copy_(torch.tensor(rows, dtype=torch.int32))
                slots.copy_(torch.tensor([tables[s][p // block_size] * block_size + p % block_size
                                          for s, p in zip(row_seqs, plan.positions)]))
        for pages, group in zip(self.state_pages, plan.state_pages):
            pages.copy_(torch.tensor(group))
        for pages, group in zip(self.wave_pages, plan.wave_state_pages):
            pages.copy_(torch.tensor(group))
        if self.logits_order is not None:
            self.logits_order.copy_(torch.tensor(plan.logits_indices))
        if self.lora is not None:
            row_loras = [plan.loras[s] for s in plan.row_sequences()]
            self.lora_indices.copy_(self.lora.indices(row_loras, [1] * len(row_loras), self.lora_indices.device))

    def capture(self, model: torch.nn.Module, pool: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """Run the step (filled first) while recording it; returns its logits, and why a replay could not
        repeat it (None when it can: the graph is ready). The step itself is right either way."""
        marked = [self.input_ids, self.positions, *self.block_tables, *self.slot_mappings, self.seq_lens,
                  *self.state_pages, *self.wave_pages, pool,
                  *([self.lora_indices] if self.lora is not None else []),
                  *([self.logits_order] if self.logits_order is not None else [])]
        recorder = _Recorder(self.program, self._held, marked)
        with forward_context(self.context), recorder, recorder.watching_python():
            hidden = model(self.input_ids, self.positions)
            if self.logits_order is not None:
                hidden = hidden.index_select(0, self.logits_order)
            logits = model.compute_logits(hidden)
        if recorder.failure is not None:
            self.program.clear()
            self._held.clear()
        else:
            self.logits, self.pool = logits, pool
        return logits, recorder.failure

    def replay(self) -> torch.Tensor:
        for step in self.program:
            step()
        return self.logits


class DecodeGraphs:
    """The runner's captured steps of decode rows (decodes, and verifies of drafts), by their rows per sequence;
    None from `run` where a step must run eagerly."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.graphs: OrderedDict[Any, DecodeGraph] = OrderedDict()
        self.seen: set[Any] = set()  # shapes run eagerly once
        self.disabled: set[bool] = set()  # verify (True) and decode (False) steps that failed to capture
        self.replays: Counter = Counter()  # steps replayed, by graph

    def run(self, plan: Any) -> torch.Tensor | None:
        # A graph returns every row's logits: a step that samples fewer (a chunk cut one token before the
        # sequence's end) runs eagerly.
        decode_only = (plan.num_decodes == len(plan.counts) and not plan.prompt_rows
                       and len(plan.logits_indices) == len(plan.input_ids))
        verify = len(plan.input_ids) > len(plan.counts)
        if verify in self.disabled or not decode_only:
            return None
        if any(graph.pool is not self.runner.pool for graph in self.graphs.values()):
            self.graphs.clear()  # recorded against a pool the runner no longer has
        counts = tuple(plan.counts)
        shape = counts if verify else len(counts)  # a decode step's batch size; a verify's rows per sequence
        key = ("lora", shape) if plan.loras else shape  # a step with adapters is a graph of its own
        graph = self.graphs.get(key)
        if graph is not None and not graph.fits(plan):
            return None
        block_size = self.runner.layout.block_size
        if graph is not None:
            self.graphs.move_to_end(key)
            graph.fill(plan, block_size)
            self.replays[key] += 1
            return graph.replay()
        if key not in self.seen:
            self.seen.add(key)
            return None
        graph = DecodeGraph(self.runner, counts, lora=bool(plan.loras))
        if not graph.fits(plan):
            return None
        graph.fill(plan, block_size)
        logits, failure = graph.capture(self.runner.model, self.runner.pool)
        if failure is not None:
            logger.info("%s steps run eagerly: %s", "verify" if verify else "decode", failure)
            self.disabled.add(verify)
            return logits
        self.graphs[key] = graph
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return logits


class _Recorder(TorchDispatchMode):
    """Appends to `program` a replay of every torch op that depends on the step (see the module's docstring)."""

    def __init__(self, program: list, held: list, marked: list[torch.Tensor]):
        super().__init__()
        self.program, self.held = program, held
        self.marked = {_storage(t) for t in marked}
        self.failure: str | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo (145
        # MiB resident) for a recording that never runs under torch.compile.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.failure is None:
            try:
                self._record(func, args, kwargs, result)
            except NotCapturable as reason:
                self.failure = str(reason)
        return result

    @contextlib.contextmanager
    def watching_python(self) -> Iterator[None]:
        """Fail the capture where Python reads a step's values by a path no op is dispatched for (`.tolist()`,
        `.numpy()`): a decision taken on them (MoE routing, split sizes) would be frozen into the replay."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def watched(name: str):
            def read(tensor: torch.Tensor, *args, **kwargs):
                if self.failure is None and _storage(tensor) in self.marked:
                    self.failure = f"Tensor.{name}() reads a step's values into Python"
                return originals[name](tensor, *args, **kwargs)
            return read

        for name in originals:
            setattr(torch.Tensor, name, watched(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def _record(self, func, args, kwargs, result) -> None:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs, _ = tree_flatten(result)
        reads_marked = any(_storage(t) in self.marked for t in inputs)
        if func in _FROM_PYTHON:
            raise NotCapturable(f"{func} makes a tensor from Python data inside the forward")
        if reads_marked and _depends_on_values(func, inputs):
            raise NotCapturable(f"{func} gives a result whose shape or Python value depends on a step's values")
        if any(not isinstance(o, torch.Tensor) for o in outputs if o is not None):
            if reads_marked:
                raise NotCapturable(f"{func} reads a step's values into Python")
            return
        outputs = [o for o in outputs if o is not None]
        self.held += outputs
        if func in _ALLOCATIONS:
            self.marked.update(_storage(o) for o in outputs)
            return
        in_storages = {_storage(t) for t in inputs}
        aliases = [_storage(o) in in_storages for o in outputs]
        mutates = func._schema.is_mutable
        if all(aliases) and not mutates:
            return  # a view: it reads whatever its base holds when a later op runs
        if any(aliases) and not all(aliases):
            raise NotCapturable(f"{func} returns both new tensors and views")
        factory = not inputs
        if not (reads_marked or mutates or factory):
            return  # a function of the weights alone: its result, kept, holds for every step
        self.held += inputs
        if mutates or all(aliases):
            self.marked.update(_storage(t) for t in _written(func, args, kwargs) or inputs)
            self.program.append(_Replay(func, args, kwargs, ()))
        else:
            self.marked.update(_storage(o) for o in outputs)
            self.program.append(_replay_into(func, args, kwargs, outputs))


class _Replay:
    """One recorded torch op: run again on the same tensors, its new outputs copied into the recorded ones."""

    def __init__(self, func, args, kwargs, outputs: tuple[torch.Tensor, ...]):
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs

    def __call__(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.outputs:
            for recorded, fresh in zip(self.outputs, tree_flatten(result)[0]):
                recorded.copy_(fresh)


# Ops that copy their one input (converted): replayed as a copy into the recorded output, one pass.
_COPIES = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default,
           torch.ops.aten.contiguous.default}


def _replay_into(func, args, kwargs, outputs: list[torch.Tensor]) -> Callable[[], None]:
    """The cheapest replay that writes `outputs` in place: a copy, the op's `out=` form, else the op and a copy.
    Each is checked at capture by running it once: it must give the outputs the op gave (it writes them again)."""
    if func in _COPIES and len(outputs) == 1 and outputs[0].shape == args[0].shape:
        replay = functools.partial(outputs[0].copy_, args[0])
    else:
        out_form = getattr(func.overloadpacket, "out", None)
        if len(outputs) != 1 or out_form is None:
            return _Replay(func, args, kwargs, tuple(outputs))
        replay = functools.partial(out_form, *args, **kwargs, out=outputs[0])
    expected = outputs[0].clone()
    try:
        replay()
    except (RuntimeError, TypeError):
        outputs[0].copy_(expected)
        return _Replay(func, args, kwargs, tuple(outputs))
    if not torch.equal(outputs[0], expected):
        outputs[0].copy_(expected)
        return _Replay(func, args, kwargs, tuple(outputs))
    return replay


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place: the arguments its schema marks `(a!)` (the native kernels' outputs,
    an in-place op's self, an out= argument)."""
    schema = func._schema.arguments
    given = [*zip(schema, args), *((arg, kwargs[arg.name]) for arg in schema if arg.name in kwargs)]
    return [value for arg, value in given
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor)]


def _depends_on_values(func, inputs: list[torch.Tensor]) -> bool:
    """Whether an op's output shape, or its Python result, follows its inputs' values (nonzero, bincount,
    unique, .item()); indexing is tagged so for boolean masks alone."""
    if func is torch.ops.aten.index.Tensor:
        return any(t.dtype in (torch.bool, torch.uint8) for t in inputs[1:])
    return torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags


def _storage(t: torch.Tensor) -> int:
    if t.layout != torch.strided:  # an opaque tensor (oneDNN's packed weights) has no storage to share
        return id(t)
    return t.untyped_storage().data_ptr()
