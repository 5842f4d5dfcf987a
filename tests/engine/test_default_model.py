"""The model that ships with Tandem: transformers loads it too, and it continues text from the docs."""

import subprocess
import sys

import pytest
import torch
import transformers
from tiny_models import hf_greedy_logprobs

from runtime import LLM, SamplingParams
from runtime.llm import DEFAULT_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_it_is_a_small_hybrid_in_hf_format():
    config = transformers.AutoConfig.from_pretrained(DEFAULT_MODEL)
    assert config.architectures == ["BambaForCausalLM"] and config.attn_layer_indices
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) < 8 * 1024**2


@pytest.mark.proves("BambaForCausalLM", "engine")
def test_transformers_loads_it_and_agrees(llm):
    """Greedy tokens alone say little about a model this overfit; every step's logprobs must agree too."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    prompts = ["Tandem is", "The scheduler", "Every model class declares"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = hf_greedy_logprobs(hf, tokenizer.encode(prompt), 24)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for step, top in enumerate(completion.logprobs):
            ids = sorted(top)
            assert set(logprobs[step].topk(5).indices.tolist()) <= set(ids)
            got = torch.tensor([top[t].logprob for t in ids])
            torch.testing.assert_close(got, logprobs[step, ids], atol=1e-4, rtol=0)


def test_it_writes_recognizable_text(llm):
    text = llm.generate(["Tandem is"], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert "runtime" in text and "Mamba" in text


def test_generate_without_a_model_argument():
    result = subprocess.run([sys.executable, "-m", "runtime", "generate", "Tandem is", "--max-tokens", "12"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Tandem is") and "runtime" in result.stdout
