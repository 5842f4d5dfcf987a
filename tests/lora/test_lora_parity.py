"""LoRA adapters made with `peft` give HF transformers + peft's float32 greedy tokens and logprobs, on every engine
architecture; many adapters share one batch, and more adapters than slots swap through them.

Three adapters per architecture: every adaptable linear at rank 4; every linear at rank 8 with rsLoRA; every
other linear at rank 2 with lora_B biases. The third leaves linears alone that the others adapt, so a slot
that held another adapter must be cleared when it is reused.
"""

import pytest
import torch
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from tiny_models import hf_greedy_logprobs

from runtime import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 8
TOP = 5
LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
PROMPT = [5, 17, 99, 42, 7, 8, 120, 33, 64]
ADAPTERS = [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=8, use_rslora=True), dict(r=2, lora_alpha=4, lora_bias=True)]


# Each case proves its architecture's LoRA cell (docs/models/supported_models.md).
MODELS = [
    pytest.param("llama", marks=pytest.mark.proves("LlamaForCausalLM", "LoRA")),
    pytest.param("granite", marks=pytest.mark.proves("GraniteForCausalLM", "LoRA")),
    pytest.param("mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "LoRA")),
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "LoRA")),
    pytest.param("granitemoehybrid", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "LoRA")),
    pytest.param("jamba", marks=pytest.mark.proves("JambaForCausalLM", "LoRA")),
    pytest.param("mamba", marks=pytest.mark.proves("MambaForCausalLM", "LoRA")),
    pytest.param("falcon_h1", marks=pytest.mark.proves("FalconH1ForCausalLM", "LoRA")),
    pytest.param("nemotron_h", marks=pytest.mark.proves("NemotronHForCausalLM", "LoRA")),
    pytest.param("zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "LoRA")),
    pytest.param("lfm2", marks=pytest.mark.proves("Lfm2ForCausalLM", "LoRA")),
    pytest.param("lfm2_moe", marks=pytest.mark.proves("Lfm2MoeForCausalLM", "LoRA")),
    pytest.param("falcon_mamba", marks=pytest.mark.proves("FalconMambaForCausalLM", "LoRA")),
    pytest.param("qwen3_next", marks=pytest.mark.proves("Qwen3NextForCausalLM", "LoRA")),
    pytest.param("qwen3_5", marks=pytest.mark.proves("Qwen3_5ForCausalLM", "LoRA")),
    pytest.param("qwen3_5_moe", marks=pytest.mark.proves("Qwen3_5MoeForCausalLM", "LoRA")),
    pytest.param("olmo_hybrid", marks=pytest.mark.proves("OlmoHybridForCausalLM", "LoRA")),
]


@pytest.fixture(scope="module", params=MODELS)
def case(request, tmp_path_factory, tokenizer_dir):
    """(checkpoint directory, [LoRARequest] * 3, HF's (tokens, logprobs) for the base model then each adapter)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    hf = build_checkpoint(name, directory, tokenizer_dir)
    names = linear_names(hf)
    requests, references = [], [hf_greedy_logprobs(hf, PROMPT, NEW_TOKENS)]
    for i, options in enumerate(ADAPTERS):
        chosen = names[::2] if i == 2 else names
        path = tmp_path_factory.mktemp(f"{name}-adapter{i}")
        peft_model = make_adapter(hf, path, seed=i, target_modules=targets(chosen), **options)
        references.append(hf_greedy_logprobs(peft_model, PROMPT, NEW_TOKENS))
        assert references[-1][0] != references[0][0], f"{name}: adapter {i} must change the tokens"
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return directory, requests, references


def assert_matches(output, reference, label):
    tokens, logprobs = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens, label
    for step, top in enumerate(completion.logprobs):
        ids = sorted(top)
        got = torch.tensor([top[t].logprob for t in ids])
        torch.testing.assert_close(got, logprobs[step][ids], atol=LOGPROB_ATOL, rtol=0,
                                   msg=lambda m: f"{label}, step {step}: {m}")


def generate(llm, loras):
    return llm.generate([{"prompt_token_ids": PROMPT}] * len(loras), GREEDY, use_tqdm=False, lora_request=loras)


def test_one_batch_of_the_base_model_and_three_adapters_matches_peft(case):
    directory, requests, references = case
    llm = LLM(directory, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    outputs = generate(llm, [None, *requests])
    for i, (output, reference) in enumerate(zip(outputs, references)):
        assert_matches(output, reference, f"request {i} ({'base' if i == 0 else requests[i - 1].lora_name})")
    # Alone, each request gets what it got in the mixed batch.
    solo = generate(llm, [requests[1]])[0]
    assert solo.outputs[0].token_ids == outputs[2].outputs[0].token_ids


def test_more_adapters_than_slots_swap_and_keep_their_tokens(case):
    directory, requests, references = case
    llm = LLM(directory, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=1)
    order = [0, 1, 2, 1, 0, None, 2]
    outputs = generate(llm, [requests[i] if i is not None else None for i in order])
    for i, output in zip(order, outputs):
        assert output.outputs[0].token_ids == references[0 if i is None else i + 1][0], f"adapter {i}"
    assert llm.engine.runner.lora.num_loads >= 4  # three adapters through two slots, one of them loaded again
