"""Tensor parallelism with LoRA: each rank holds its part of every adapter, cut like the base weight it adapts
(column-parallel B rows and biases, row-parallel A columns, a replaced bias after a partial sum on rank 0 alone),
and greedy tokens at TP=2 equal TP=1 and HF transformers + peft, for base and adapter requests in one batch."""

import pytest
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from tiny_models import hf_greedy

from runtime import LLM, LoRARequest, SamplingParams
from runtime.distributed import group

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 99, 42, 7, 8], list(range(30, 70))]

# Attention with biases (PEFT's bias="lora_only" replaces them), Mamba-2 hybrids, Mamba-1 (x_proj reduces inside
# its mixer), Gated DeltaNet's fused projections and LFM2's short convolutions.
CASES = [("llama", dict(attention_bias=True, mlp_bias=True), dict(bias="lora_only")),
         ("bamba", dict(mamba_proj_bias=True), dict(bias="lora_only", lora_bias=True)),
         ("nemotron_h", {}, {}), ("mamba", {}, {}), ("qwen3_5", {}, {}), ("lfm2", {}, dict(lora_bias=True))]


@pytest.fixture(scope="module", autouse=True)
def tp_group():
    yield
    group.shutdown()


def run(directory, tp, loras):
    llm = LLM(directory, dtype="float32", tensor_parallel_size=tp, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, GREEDY, use_tqdm=False,
                               lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, overrides, options", CASES, ids=[case[0] for case in CASES])
def test_tp2_with_an_adapter_equals_tp1_and_peft(name, overrides, options, tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp(name)
    hf = build_checkpoint(name, directory, tokenizer_dir, **overrides)
    path = tmp_path_factory.mktemp(f"{name}-adapter")
    peft = make_adapter(hf, path, seed=3, r=8, lora_alpha=8, target_modules=targets(linear_names(hf)), **options)
    lora = LoRARequest("adapter", 1, str(path))
    loras = [lora, lora, None, None]
    tp1 = run(directory, 1, loras)
    assert tp1 == [hf_greedy(peft, p, NEW_TOKENS) for p in PROMPTS] + [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert run(directory, 2, loras) == tp1
