"""HF transformers is the oracle: our greedy tokens and logits equal its own, on tiny random models.

Prompts of different lengths run batched together; the longest is longer than the Mamba
chunk (16) and than one attention block, so prefill crosses chunk and page boundaries.
"""

import copy

import pytest
import torch
from tiny_models import hf_greedy, hf_last_logits

from runtime import LLM, SamplingParams

PROMPTS = [
    "The",
    "A hybrid model mixes attention",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches",
    "Every model class declares what it supports and what it caches. Chunked prefill processes a long "
    "prompt over several steps, and the quick brown fox jumps over the lazy dog again and again and again.",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Each case proves that its architecture runs on the engine (the V1 column; see docs/contributing.md).
MODELS = [
    pytest.param("llama", marks=pytest.mark.proves("LlamaForCausalLM", "engine")),
    pytest.param("granite", marks=pytest.mark.proves("GraniteForCausalLM", "engine")),
    pytest.param("mamba2", marks=pytest.mark.proves("Mamba2ForCausalLM", "engine")),
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "engine")),
    pytest.param("granitemoehybrid", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "engine")),
    pytest.param("granitemoehybrid-dense-nope", marks=pytest.mark.proves("GraniteMoeHybridForCausalLM", "engine")),
    pytest.param("jamba", marks=pytest.mark.proves("JambaForCausalLM", "engine")),
    pytest.param("mamba", marks=pytest.mark.proves("MambaForCausalLM", "engine")),
    pytest.param("falcon_h1", marks=pytest.mark.proves("FalconH1ForCausalLM", "engine")),
    pytest.param("falcon_h1_rms_norm", marks=pytest.mark.proves("FalconH1ForCausalLM", "engine")),
    pytest.param("nemotron_h", marks=pytest.mark.proves("NemotronHForCausalLM", "engine")),
    pytest.param("zamba2", marks=pytest.mark.proves("Zamba2ForCausalLM", "engine")),
]


def prompt_ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tiny_checkpoint):
    directory, hf = tiny_checkpoint(request.param)
    return request.param, directory, hf


def test_greedy_tokens_match_transformers(model):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    assert max(map(len, ids)) > 48, "the longest prompt must cross a chunk and an attention block"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(ids, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), name
        assert output.outputs[0].finish_reason == "length"


def test_last_token_logits_match_transformers(model):
    name, directory, hf = model
    llm = LLM(directory, dtype="float32")
    ids = prompt_ids(llm)
    for prompt, row in zip(ids, last_token_logits(llm, ids)):
        torch.testing.assert_close(row, hf_last_logits(hf, prompt), atol=1e-4, rtol=0)


# At initializer_range 0.3 the tiny models amplify rounding chaotically (HF's own bfloat16 moves
# their logits by up to a third of their range and flips MoE routing); at 1/sqrt(hidden_size),
# the scale of a trained model's weights, bfloat16 stays as close as it does on real models.
BF16_INITIALIZER_RANGE = 0.125


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs_and_stays_close_to_float32(name, tiny_checkpoint):
    directory, hf = tiny_checkpoint(name, initializer_range=BF16_INITIALIZER_RANGE)
    reference = LLM(directory, dtype="float32")
    ids = prompt_ids(reference)
    expected = last_token_logits(reference, ids)
    got = last_token_logits(LLM(directory, dtype="bfloat16"), ids)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    hf_rows = torch.stack([hf_last_logits(hf_bf16, p) for p in ids])
    hf_error = (hf_rows - expected).abs().max()
    error = (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max(), name
    # Our bfloat16 path loses no more than HF's own bfloat16 forward does (up to a factor 2).
    assert error <= 2 * hf_error, (name, error, hf_error)
    # The same next token, wherever HF's own bfloat16 keeps it (elsewhere the top two are a near-tie).
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept]), name


def last_token_logits(llm, ids):
    """The logits of each prompt's last token, from one batched prefill step, in prompt order."""
    engine = llm.engine
    for prompt in ids:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    seqs, logits = engine.runner.execute(engine.scheduler.schedule())
    assert [seq.prompt_token_ids for seq in seqs] == ids
    return logits
