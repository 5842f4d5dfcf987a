"""LoRA with the engine's other features: prefix caching keys on the adapter, captured decode steps replay with
adapters (swapped in and out of their slots between replays), and every sampled token stays the eager one."""

import pytest
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets

from runtime import LLM, LoRARequest, SamplingParams
from runtime.kernels import cpu_native

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 5 + 110))  # more than two of the prefix cache's blocks (16 tokens; 48 for the tiny Bamba)


@pytest.fixture(scope="module", params=["llama", "bamba"])
def case(request, tmp_path_factory, tokenizer_dir):
    """(checkpoint, two adapters) of a pure-attention and a hybrid model (whose cache holds state snapshots)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(request.param, directory, tokenizer_dir)
    loras = []
    for i in range(2):
        path = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(hf, path, seed=10 + i, r=4, lora_alpha=8, target_modules=targets(linear_names(hf)))
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return directory, loras


def run(llm, loras, prompt=PROMPT, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(loras), params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def test_two_adapters_never_share_cached_blocks_or_snapshots(case):
    directory, (first, second) = case
    expected = {lora: run(LLM(directory, dtype="float32", enable_lora=True), [lora])[0][0]
                for lora in (None, first, second)}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3, "the adapters must change the tokens"
    llm = LLM(directory, dtype="float32", enable_lora=True, enable_prefix_caching=True)
    tokens, cached = run(llm, [first])
    assert tokens[0] == expected[first] and cached == [0]
    for lora in (second, None):  # the same prompt, cached under the first adapter only
        tokens, cached = run(llm, [lora])
        assert tokens[0] == expected[lora] and cached == [0], lora
    for _ in range(2):  # a hybrid's cache keeps a prefix's states the second time it sees it
        for lora in (first, second, None):
            tokens, cached = run(llm, [lora])
            assert tokens[0] == expected[lora], lora
    assert cached[0] > 0  # each found its own blocks


@pytest.mark.skipif(not cpu_native.available(), reason="decode steps are captured over native kernels")
def test_captured_decode_steps_with_adapters_equal_eager_ones(case):
    directory, (first, second) = case
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # One slot for two adapters: each batch swaps the slot's contents under the captured graph.
    batches = [[first, None], [second, None], [first, None], [second, first]]
    results = {}
    for eager in (True, False):
        llm = LLM(directory, dtype="float32", enable_lora=True, max_loras=1, enforce_eager=eager)
        results[eager] = [run(llm, batch, PROMPT[:7], params)[0] for batch in batches]
        graphs = llm.engine.runner.graphs
    assert results[False] == results[True]
    assert ("lora", 2) in graphs.graphs and not graphs.disabled
