"""Pipeline parallelism with LoRA: each stage wraps, reads and checks only its own layers' linears of an
adapter (every stage checks it when a request brings it; the plan's adapters pick the same slots on every
stage), and greedy tokens at PP=2 equal PP=1 and HF transformers + peft, base and adapter requests in one
batch."""

import pytest
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from tiny_models import hf_greedy

from runtime import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 99, 42, 7, 8], list(range(30, 70))]
CASES = [("llama", dict(attention_bias=True, mlp_bias=True), dict(bias="lora_only")), ("nemotron_h", {}, {})]


def run(directory, pp, loras):
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=pp, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, GREEDY, use_tqdm=False,
                               lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, overrides, options", CASES, ids=[case[0] for case in CASES])
def test_pp2_with_an_adapter_equals_pp1_and_peft(name, overrides, options, tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp(name)
    hf = build_checkpoint(name, directory, tokenizer_dir, **overrides)
    path = tmp_path_factory.mktemp(f"{name}-adapter")
    peft = make_adapter(hf, path, seed=3, r=8, lora_alpha=8, target_modules=targets(linear_names(hf)), **options)
    lora = LoRARequest("adapter", 1, str(path))
    loras = [lora, lora, None, None]
    pp1 = run(directory, 1, loras)
    assert pp1 == [hf_greedy(peft, p, NEW_TOKENS) for p in PROMPTS] + [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert run(directory, 2, loras) == pp1


def test_a_bad_adapter_on_a_later_stage_is_refused_before_queueing(tmp_path_factory, tokenizer_dir):
    """An adapter whose last layer's linear has the wrong rank: only stage 1 holds that layer, and the request
    is refused when added (ValueError naming the module), the engine running on."""
    directory = tmp_path_factory.mktemp("llama-bad")
    hf = build_checkpoint("llama", directory, tokenizer_dir)
    path = tmp_path_factory.mktemp("llama-bad-adapter")
    last = [n for n in linear_names(hf) if ".layers.1." in n][:1]
    make_adapter(hf, path, seed=3, r=16, lora_alpha=8, target_modules=last)
    llm = LLM(directory, dtype="float32", pipeline_parallel_size=2, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="rank 16 is more than max_lora_rank=8"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("bad", 2, str(path)))
        after = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
        assert len(after.outputs[0].token_ids) == NEW_TOKENS
    finally:
        llm.engine.shutdown()
