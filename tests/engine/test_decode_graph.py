"""Captured decode steps (runtime/decode_graph.py): a replay gives the eager step's logits bit for bit, and a step
a replay could not repeat runs eagerly instead.

The parity tests (test_parity.py, against HF) run with capture on, as every engine does by default; here
the engine with capture is checked against itself with `enforce_eager`, to the last bit, on batches that
shrink as requests finish (a graph per batch size), sequences that cross attention pages, and bfloat16.
"""

import pytest
import torch

from runtime import LLM, SamplingParams, decode_graph
from runtime.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="decode steps are captured over native kernels")

# Three requests that finish at different steps: the decode batch runs at 3, then 2, then 1 sequences.
PROMPT_LENGTHS = (3, 21, 40)
NEW_TOKENS = (9, 14, 30)


def logprobs(output) -> list[dict[int, float]]:
    return [{token: lp.logprob for token, lp in step.items()} for step in output.outputs[0].logprobs]


def generate(directory, enforce_eager: bool, **options):
    llm = LLM(str(directory), max_num_seqs=len(PROMPT_LENGTHS), enforce_eager=enforce_eager, **options)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in PROMPT_LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in NEW_TOKENS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = [(out.outputs[0].token_ids, logprobs(out))
              for out in outputs]
    return result, llm.engine.runner.graphs


@pytest.mark.parametrize("name, dtype", [
    ("llama", torch.float32),
    ("bamba", torch.float32),
    ("bamba", torch.bfloat16),
    ("falcon_h1", torch.float32),
    ("zamba2", torch.float32),
])
def test_replayed_decodes_equal_eager_ones(tiny_checkpoint, name, dtype):
    directory, _ = tiny_checkpoint(name, dtype=dtype)
    # Pages of 16 tokens: the longest sequence (70 tokens) crosses four of them while replaying.
    eager, none = generate(directory, enforce_eager=True, block_size=16 if name == "llama" else None)
    replayed, graphs = generate(directory, enforce_eager=False, block_size=16 if name == "llama" else None)
    assert none is None
    assert not graphs.disabled and sorted(graphs.graphs) == [1, 2, 3]
    assert replayed == eager


@pytest.mark.parametrize("name, reason", [
    ("granitemoehybrid", "aten.bincount"),  # MoE routing: tokens per expert
    ("mamba", "aten.index.Tensor"),  # the Mamba-1 reference keeps the real slots by a boolean mask
])
def test_a_step_a_replay_cannot_repeat_runs_eagerly(tiny_checkpoint, caplog, name, reason):
    directory, _ = tiny_checkpoint(name)
    eager, _ = generate(directory, enforce_eager=True)
    with caplog.at_level("INFO", logger="tandem"):
        result, graphs = generate(directory, enforce_eager=False)
    assert graphs.disabled and not graphs.graphs
    assert any("decode steps run eagerly" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    # The step that was being captured when the op showed up finished eagerly: nothing ran twice.
    assert result == eager


def test_graphs_are_kept_for_the_latest_batch_sizes(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(decode_graph, "MAX_GRAPHS", 2)
    directory, _ = tiny_checkpoint("bamba")
    eager, _ = generate(directory, enforce_eager=True)
    replayed, graphs = generate(directory, enforce_eager=False)
    assert list(graphs.graphs) == [2, 1]
    assert replayed == eager


def record(step, marked, *inputs):
    """Capture step(*inputs) with `marked` as the step's inputs; returns (program, failure, result)."""
    program, held = [], []
    recorder = decode_graph._Recorder(program, held, marked)
    with recorder, recorder.watching_python():
        result = step(*inputs)
    return program, recorder.failure, result


def test_ops_on_the_step_replay_and_ops_on_weights_do_not():
    x, weight = torch.randn(4, 8), torch.randn(8).to(torch.bfloat16)

    def step(x, weight):
        scale = -torch.exp(weight.float())  # the weights alone: computed once
        out = torch.empty(4, 8)
        out.copy_(x * scale)  # reads the step's x: replayed
        return out.view(2, 16) + 1.0, x.to(torch.bfloat16)  # a view costs nothing; the add and the cast replay

    program, failure, (result, cast) = record(step, [x], x, weight)
    assert failure is None
    assert len(program) == 4  # mul, copy_, add, the cast: not float, exp or neg
    x.copy_(torch.randn(4, 8))
    for replay in program:
        replay()
    torch.testing.assert_close(result, (x * -torch.exp(weight.float())).view(2, 16) + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(cast, x.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("read", [
    lambda x: x.tolist(),
    lambda x: x.numpy(),
    lambda x: int(x[0]),
    lambda x: x.nonzero(),
    lambda x: x[x > 0],
    lambda x: torch.tensor([1.0]) + x,
])
def test_a_step_value_read_into_python_fails_the_capture(read):
    x = torch.randn(4)
    _, failure, _ = record(read, [x], x)
    assert failure is not None
    _, failure, _ = record(read, [], x)  # the same read of a weight is harmless
    assert failure is None or "Python data" in failure


def test_a_batch_size_seen_once_is_not_captured(tiny_checkpoint):
    directory, _ = tiny_checkpoint("bamba")
    llm = LLM(str(directory), max_num_seqs=1)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    # One decode step of one sequence: capturing it would cost more than the step.
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    graphs = llm.engine.runner.graphs
    assert graphs.seen == {1} and not graphs.graphs
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert list(graphs.graphs) == [1]


def run_requests(llm, requests: list[tuple[int, int]]) -> tuple[list, set[int]]:
    """Run (prompt length, new tokens) requests to their end, prompts of distinct tokens; returns each one's tokens
    and logprobs, and the state pages its sequences held while running."""
    engine, outputs, pages = llm.engine, {}, set()
    ids = [engine.add_request({"prompt_token_ids": list(range(7 * i + 5, 7 * i + 5 + n))},
                              SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=3))
           for i, (n, new) in enumerate(requests)]
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
        pages.update(page for seq in engine.scheduler.running for page in seq.state_pages)
    return [(outputs[i].outputs[0].token_ids, logprobs(outputs[i])) for i in ids], pages


@pytest.mark.parametrize("name", ["bamba", "mamba2"])
def test_a_graph_replays_for_other_sequences_in_other_state_pages(tiny_checkpoint, name):
    # A graph is captured for two sequences; two others, whose states live in other pages, replay it later.
    # A replay that kept the captured page ids would read and write the first pair's states.
    directory, _ = tiny_checkpoint(name)
    # The two 1-token requests, admitted first, take the pages the first pair freed.
    first, second = [(9, 8), (20, 8)], [(4, 1), (6, 1), (30, 10), (13, 10)]
    results = []
    for enforce_eager in (True, False):
        llm = LLM(str(directory), dtype="float32", max_num_seqs=4, enforce_eager=enforce_eager)
        outputs, first_pages = run_requests(llm, first)
        graphs = llm.engine.runner.graphs
        assert enforce_eager or sorted(graphs.graphs) == [2]
        second_outputs, second_pages = run_requests(llm, second)
        assert first_pages and not first_pages & second_pages
        results.append((outputs, second_outputs))
    assert results[1] == results[0]


def test_graphs_recorded_against_another_pool_are_dropped(tiny_checkpoint):
    """A graph replays the page pool it was recorded against: a runner given a new pool records new graphs
    (replaying the old ones would decode from the old pool's pages)."""
    from runtime.cache.pool import allocate_pool, bind_pool

    directory, _ = tiny_checkpoint("bamba")
    llm = LLM(str(directory), max_num_seqs=len(PROMPT_LENGTHS))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in PROMPT_LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in NEW_TOKENS]

    def tokens():
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    before = tokens()
    runner = llm.engine.runner
    recorded = list(runner.graphs.graphs.values())  # held, so that no new graph can reuse an id
    assert recorded and all(graph.pool is runner.pool for graph in runner.graphs.graphs.values())
    runner.pool = allocate_pool(runner.layout, runner.num_pages, runner.device)
    bind_pool(runner.model, runner.pool, runner.layout)

    assert tokens() == before
    assert runner.graphs.graphs and all(graph.pool is runner.pool for graph in runner.graphs.graphs.values())
    assert not any(graph is old for graph in runner.graphs.graphs.values() for old in recorded)
