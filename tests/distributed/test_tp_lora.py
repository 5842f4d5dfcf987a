"""Tensor parallelism with LoRA, on every engine architecture: each rank holds its part of every adapter, cut
like the base weight it adapts (column-parallel B rows and biases, row-parallel A columns, a bias after a
partial sum on rank 0 alone), and greedy tokens and logprobs at TP=2 equal HF transformers + peft, for base and
adapter requests in one batch.

The adapter targets every linear PEFT adapts on the family (lora_helpers.linear_names, the targets of the
parity tests) with random, nonzero A and B. One TP=2 engine per architecture, compared with HF + peft directly:
tests/lora/test_lora_parity.py shows TP=1 equal to HF + peft on every architecture, so TP=2 equal to HF + peft
is TP=2 equal to TP=1 too, without a TP=1 engine here.
"""

import pytest
import torch
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from tiny_models import hf_greedy_logprobs

from runtime import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 8
TOP = 3
# Logprobs too, not tokens alone: a part of an adapter lost on one rank can leave the argmax where it was.
LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
PROMPTS = [[5, 17, 99, 42, 7, 8], list(range(30, 70))]
LORA_ONLY = dict(bias="lora_only")  # PEFT trains the targets' base biases: a replaced bias per rank
LORA_BIAS = dict(lora_bias=True)  # a bias on lora_B: cut like the base layer's output features

# (tiny model, config overrides, PEFT options): every architecture of tests/lora/test_lora_parity.py, with base
# biases where a family has them (replaced under bias="lora_only"), lora_B biases and rsLoRA elsewhere.
CASES = [
    ("llama", dict(attention_bias=True, mlp_bias=True), LORA_ONLY),
    ("granite", dict(num_key_value_heads=1), dict(LORA_BIAS, use_rslora=True)),  # one KV head on both ranks
    ("mamba2", dict(n_groups=1, use_bias=True), LORA_ONLY),  # one group: in_proj's B and C rows on both ranks
    ("bamba", dict(mamba_proj_bias=True), dict(LORA_ONLY, **LORA_BIAS)),
    ("granitemoehybrid", {}, LORA_BIAS),  # the shared MLP's packed input_linear, cut by parts
    ("jamba", dict(mamba_proj_bias=True), LORA_ONLY),
    ("mamba", {}, LORA_BIAS),  # x_proj reduces inside the mixer: its lora_B bias is whole on every rank
    ("falcon_h1", dict(projectors_bias=True, mlp_bias=True), LORA_ONLY),
    # fc2_latent_proj projects the experts' partial sums: its biases are added on rank 0 alone.
    ("nemotron_h", dict(use_bias=True, mlp_bias=True, moe_latent_size=32), dict(LORA_ONLY, **LORA_BIAS)),
    ("zamba2", {}, LORA_BIAS),  # the shared block's low-rank q/k/v adapters
    ("lfm2", {}, LORA_BIAS),
    ("lfm2_moe", {}, dict(LORA_BIAS, use_rslora=True)),
    ("falcon_mamba", {}, LORA_ONLY),
    ("qwen3_next", {}, LORA_BIAS),  # fused in_proj_qkvz and in_proj_ba, cut by key heads
    ("qwen3_5", {}, {}),
    ("qwen3_5_moe", {}, LORA_BIAS),
    ("olmo_hybrid", {}, dict(LORA_BIAS, use_rslora=True)),
]


def run(directory, tp, loras):
    llm = LLM(directory, dtype="float32", tensor_parallel_size=tp, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, GREEDY, use_tqdm=False,
                               lora_request=loras)
        return [o.outputs[0] for o in outputs]
    finally:
        llm.engine.shutdown()


def assert_matches(completion, reference, label):
    tokens, logprobs = reference
    assert completion.token_ids == tokens, label
    for step, top in enumerate(completion.logprobs):
        ids = sorted(top)
        got = torch.tensor([top[t].logprob for t in ids])
        torch.testing.assert_close(got, logprobs[step][ids], atol=LOGPROB_ATOL, rtol=0,
                                   msg=lambda m: f"{label}, step {step}: {m}")


@pytest.mark.parametrize("name, overrides, options", CASES, ids=[case[0] for case in CASES])
def test_tp2_with_an_adapter_equals_peft(name, overrides, options, tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp(name)
    hf = build_checkpoint(name, directory, tokenizer_dir, **overrides)
    path = tmp_path_factory.mktemp(f"{name}-adapter")
    peft = make_adapter(hf, path, seed=3, r=8, lora_alpha=8, target_modules=targets(linear_names(hf)), **options)
    adapted = [hf_greedy_logprobs(peft, p, NEW_TOKENS) for p in PROMPTS]
    base = [hf_greedy_logprobs(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert [r[0] for r in adapted] != [r[0] for r in base], f"{name}: the adapter must change the tokens"
    lora = LoRARequest("adapter", 1, str(path))
    completions = run(directory, 2, [lora, lora, None, None])
    for i, (completion, reference) in enumerate(zip(completions, adapted + base)):
        assert_matches(completion, reference, f"{name}, {'adapter' if i < 2 else 'base'} request {i}")
