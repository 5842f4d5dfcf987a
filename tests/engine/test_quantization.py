"""On-the-fly weight-only quantization (`quantization="int8" | "int4"`): HF transformers is the oracle, running
the same checkpoint with its decoder linears replaced by this test's own quantize-then-dequantize (plain
torch, written here from the scheme's statement, not the engine's code). Greedy tokens equal, logprobs within
1e-4 in float32, with captured decode steps (the default) and without (enforce_eager)."""

import copy
import subprocess
import sys

import pytest
import torch
from tiny_models import hf_greedy_logprobs
from torch import nn
from transformers import AutoTokenizer

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.kernels import cpu_native
from runtime.layers.linear import PanelEmbedding
from runtime.layers.quantized import QuantLinear, QuantStackedLinear, weight_bytes

PROMPTS = [
    "The",
    "A hybrid model mixes attention",
    "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches",
]
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
LOGPROB_ATOL = 1e-4
MOE = {"granitemoehybrid"}


def fake_quantize(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The float32 weight a symmetric int8 (per output row, max|w| / 127) or int4 (per row and group of 128
    inputs, the last group partial, max|w| / 7) quantization stands for."""
    levels, group = (127, weight.shape[1]) if scheme == "int8" else (7, 128)
    out = torch.empty_like(weight, dtype=torch.float32)
    for start in range(0, weight.shape[1], group):
        block = weight[:, start:start + group].float()
        scale = block.abs().amax(dim=1, keepdim=True) / levels
        out[:, start:start + group] = torch.round(block / scale).clamp(-levels, levels) * scale
    return out


def dequantized_hf(hf, scheme: str):
    """A copy of the HF model whose decoder linears (under `layers`, routers aside) and MoE experts (stacked
    (experts, out, in) parameters) hold fake_quantize'd weights."""
    reference = copy.deepcopy(hf)
    replaced = 0
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in name and "router" not in name:
                module.weight.copy_(fake_quantize(module.weight, scheme))
                replaced += 1
            elif name.endswith(".experts") and not isinstance(module, nn.ModuleList):
                for stacked in module.parameters(recurse=False):
                    for expert in stacked:
                        expert.copy_(fake_quantize(expert, scheme))
                    replaced += 1
    assert replaced
    return reference


def assert_matches(llm, reference, label):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        expected_tokens, logprobs = hf_greedy_logprobs(reference, output.prompt_token_ids, NEW_TOKENS)
        assert completion.token_ids == expected_tokens, label
        for step, top in enumerate(completion.logprobs):
            ids = sorted(top)
            got = torch.tensor([top[t].logprob for t in ids])
            torch.testing.assert_close(got, logprobs[step][ids], atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m: f"{label} step {step}: {m}")
    return outputs


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "bamba", "granitemoehybrid-dense-nope", "granitemoehybrid"])
def test_quantized_tokens_and_logprobs_match_transformers_on_dequantized_weights(name, scheme, tiny_checkpoint):
    directory, hf = tiny_checkpoint(name)
    reference = dequantized_hf(hf, scheme)
    captured = LLM(directory, dtype="float32", quantization=scheme)
    eager = LLM(directory, dtype="float32", quantization=scheme, enforce_eager=True)
    for llm, label in ((captured, "captured"), (eager, "eager")):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a decode batch size is captured the second time it runs
        assert_matches(llm, reference, f"{name} {scheme} {label}")
    # MoE routing reads each expert's token count into Python: such a model's decode steps run eagerly,
    # quantized or not.
    if cpu_native.available() and name not in MOE:
        graphs = captured.engine.runner.graphs
        assert graphs is not None and not graphs.disabled and graphs.graphs, "no decode step was captured"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_chunked_prefill_and_prefix_caching_keep_working_quantized(scheme, tiny_checkpoint):
    """Prompts split over steps of 21 tokens (chunks of under and over the kernel's 16 rows), and a second
    pass that resumes from cached prefixes: the same tokens and logprobs as HF on the dequantized weights."""
    directory, hf = tiny_checkpoint("bamba")
    reference = dequantized_hf(hf, scheme)
    llm = LLM(directory, dtype="float32", quantization=scheme, max_num_batched_tokens=21,
              enable_prefix_caching=True)
    assert_matches(llm, reference, f"{scheme} chunked")
    again = assert_matches(llm, reference, f"{scheme} from the prefix cache")
    assert again[-1].num_cached_tokens > 0


def test_preemption_keeps_working_quantized(tiny_checkpoint):
    """A pool that holds the prompts' prefills only: decoding preempts sequences, which are recomputed."""
    directory, hf = tiny_checkpoint("bamba")
    reference = dequantized_hf(hf, "int8")
    ids = AutoTokenizer.from_pretrained(directory).encode(PROMPTS[2])
    prompts = [{"prompt_token_ids": ids[:n]} for n in (30, 40, 44)]
    layout = EngineConfig(str(directory), dtype="float32").cache
    num_pages = sum(layout.pages_per_sequence(len(p["prompt_token_ids"])) for p in prompts)
    llm = LLM(directory, dtype="float32", quantization="int8", max_model_len=64, num_pages=num_pages)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert any(output.num_preemptions for output in outputs), "no sequence was preempted"
    for output in outputs:
        expected, _ = hf_greedy_logprobs(reference, output.prompt_token_ids, NEW_TOKENS)
        assert output.outputs[0].token_ids == expected


def test_the_unquantized_model_differs_from_the_dequantized_reference(tiny_checkpoint):
    """The oracle above tells the schemes apart: int4's weights change the logprobs by far more than 1e-4."""
    directory, hf = tiny_checkpoint("llama")
    ids = [5, 6, 7, 8]
    _, exact = hf_greedy_logprobs(hf, ids, 4)
    _, int4 = hf_greedy_logprobs(dequantized_hf(hf, "int4"), ids, 4)
    assert (exact - int4).abs().max() > 100 * LOGPROB_ATOL


def test_which_linears_are_quantized(tiny_checkpoint):
    directory, _ = tiny_checkpoint("granitemoehybrid")
    model = LLM(directory, dtype="float32", quantization="int4").engine.runner.model
    quantized = {name for name, module in model.named_modules() if isinstance(module, (QuantLinear, QuantStackedLinear))}
    assert "model.layers.1.self_attn.q_proj" in quantized and "model.layers.0.mamba.in_proj" in quantized
    assert "model.layers.0.mamba.out_proj" in quantized and "model.layers.0.shared_mlp.input_linear" in quantized
    assert {"model.layers.0.block_sparse_moe.input_linear", "model.layers.0.block_sparse_moe.output_linear"} <= quantized
    assert not any("router" in name or "lm_head" in name or "embed" in name for name in quantized)
    embedding = model.model.embed_tokens  # read from the tied LM head's panels where they run
    assert (embedding.weight_dtype if isinstance(embedding, PanelEmbedding) else embedding.weight.dtype) == torch.float32
    assert model.model.layers[0].mamba.conv1d.weight.dtype == torch.float32


def test_an_unknown_scheme_names_the_accepted_ones(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8, compressed-tensors .*got 'int3'"):
        LLM(directory, quantization="int3")


def test_the_cli_refuses_an_unknown_scheme_in_one_line(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    result = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(directory), "--prompt", "Hi",
                             "--quantization", "int3"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "invalid choice: 'int3' (choose from 'int8', 'int4', 'fp8', 'compressed-tensors')" in result.stderr
    assert "Traceback" not in result.stderr


def test_quantized_models_hold_fewer_bytes(tiny_checkpoint):
    """weight_bytes reads every tensor of a built engine's model, oneDNN's packed (opaque) weights included."""
    directory, _ = tiny_checkpoint("llama")
    sizes = {q: weight_bytes(LLM(directory, dtype="float32", quantization=q).engine.runner.model)
             for q in (None, "int8", "int4")}
    assert sizes[None] > sizes["int8"] > sizes["int4"] > 0


def last_logits(llm: LLM, ids: list[list[int]]) -> torch.Tensor:
    """The last-token logits of one batched step (a prefill) of these prompts."""
    for prompt in ids:
        llm.engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    seqs, logits = llm.engine.runner.execute(llm.engine.scheduler.schedule())
    return logits


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "bamba", "granitemoehybrid"])
def test_a_bfloat16_model_quantized_stays_close_to_float32(name, scheme, tiny_checkpoint):
    """A bfloat16 model's quantized prefill runs on AMX tiles where the CPU has them (quant_linear.amx_runs): the
    last-token logits of a batched prefill lose no more than 0.1 of their range and no more than twice HF's own
    bfloat16 forward of the dequantized weights loses, against the engine's float32 run (test_parity's bounds)."""
    from tiny_models import hf_last_logits

    # A bfloat16 checkpoint: both engines quantize the same values (a float32 file would be quantized from its
    # float32 weights by one and from their bfloat16 rounding by the other, and int4 levels flip between them).
    directory, hf = tiny_checkpoint(name, initializer_range=0.125, dtype=torch.bfloat16)
    full = LLM(directory, dtype="float32", quantization=scheme)
    ids = [full.get_tokenizer().encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 16  # past the decode kernels' rows: the prefill path
    expected = last_logits(full, ids)
    got = last_logits(LLM(directory, dtype="bfloat16", quantization=scheme), ids)
    reference = dequantized_hf(hf, scheme)
    hf_rows = torch.stack([hf_last_logits(reference, p) for p in ids])
    hf_error, error = (hf_rows - expected).abs().max(), (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max() and error <= 2 * hf_error, (error, hf_error)
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept])


@pytest.mark.parametrize("name", ["llama", "bamba", "granitemoehybrid"])
def test_a_bfloat16_int4_decode_on_integer_activations_stays_close_to_float32(name, tiny_checkpoint, monkeypatch):
    """Batches of up to X16_MAX_ROWS rows of a bfloat16 int4 model run on integer activations where the CPU has no
    AVX-512 BF16 (quant_linear.x16_runs): the last-token logits of a short batch lose no more than 0.1 of their range,
    and no more than twice HF's own bfloat16 forward of the dequantized weights loses, against the engine's float32
    run, as the weight-only kernels' do (here 0.04-0.05 against HF's 0.03-0.04 and the weight-only kernels'
    0.03-0.04, logits of range 2-4), with the same greedy tokens; they differ from the weight-only kernels' where
    they run."""
    from tiny_models import hf_last_logits

    from runtime.kernels import quant_linear as quant_module

    directory, hf = tiny_checkpoint(name, initializer_range=0.125, dtype=torch.bfloat16)
    full = LLM(directory, dtype="float32", quantization="int4")
    ids = [full.get_tokenizer().encode(p) for p in ("The", "A hybrid model mixes")]
    assert sum(map(len, ids)) <= quant_module.X16_MAX_ROWS  # the whole batch is one decode-sized linear

    expected = last_logits(full, ids)
    got = last_logits(LLM(directory, dtype="bfloat16", quantization="int4"), ids)
    hf_rows = torch.stack([hf_last_logits(dequantized_hf(hf, "int4"), p) for p in ids])
    hf_error, error = (hf_rows - expected).abs().max(), (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max() and error <= 2 * hf_error, (error, hf_error)
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept])
    monkeypatch.setattr(quant_module, "X16_MAX_ROWS", 0)
    weight_only = last_logits(LLM(directory, dtype="bfloat16", quantization="int4"), ids)
    assert torch.equal(got, weight_only) == quant_module.bfloat16_native()
