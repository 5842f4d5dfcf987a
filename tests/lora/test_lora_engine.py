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


@pytest.mark.parametrize("name", ["llama", "bamba"])
def test_a_bfloat16_model_reads_bfloat16_slots_and_stays_as_close_as_peft_does(name, tmp_path, tokenizer_dir):
    """A bfloat16 model's slots are bfloat16 (PEFT loads an adapter in the model's dtype; half the bytes a step
    reads), and its adapted logits lose no more to bfloat16 than transformers + peft's own bfloat16 forward."""
    import copy

    import torch

    # At a trained model's weight scale: the tiny models' 0.3 amplifies bfloat16's rounding chaotically.
    hf = build_checkpoint(name, tmp_path / "model", tokenizer_dir, initializer_range=0.125)
    peft = make_adapter(hf, tmp_path / "adapter", seed=3, r=8, lora_alpha=16, target_modules=targets(linear_names(hf)))
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = [[5, 17, 99, 42, 7, 8], list(range(30, 70))]

    def logprobs(dtype):
        llm = LLM(tmp_path / "model", dtype=dtype, enable_lora=True)
        pools = {layer.lora_a.dtype for layer in llm.engine.runner.lora.layers.values()}
        assert pools == {torch.bfloat16 if dtype == "bfloat16" else torch.float32}
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                               lora_request=lora)
        return [out.outputs[0].logprobs[0] for out in outputs]

    exact, got = logprobs("float32"), logprobs("bfloat16")
    peft_bf16 = copy.deepcopy(peft).to(torch.bfloat16)
    with torch.no_grad():
        for prompt, want, have in zip(prompts, exact, got):
            theirs = torch.log_softmax(peft_bf16(torch.tensor([prompt])).logits[0, -1].float(), -1)
            common = [t for t in want if t in have]
            assert len(common) >= 10, (name, len(common))  # the same top tokens, mostly
            error = max(abs(have[t].logprob - want[t].logprob) for t in common)
            peft_error = max(abs(theirs[t].item() - want[t].logprob) for t in common)
            assert error <= 2 * peft_error + 1e-3, (name, error, peft_error)
