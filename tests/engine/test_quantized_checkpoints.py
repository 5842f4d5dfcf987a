"""Checkpoints published quantized (`quantization_config` in config.json): FP8 block-wise (`quant_method: fp8`,
`weight_scale_inv`), compressed-tensors FP8 (`float-quantized`, per channel and per tensor) and W4A16
(`pack-quantized`, grouped, symmetric and with zero points). Each test quantizes a tiny random HF checkpoint
itself, from the format's statement (not the engine's code), writes config.json's quantization_config as the FP8
releases and llm-compressor write it, and runs HF transformers on the weights its own reference dequantizes:
float32 greedy tokens equal, logprobs within 1e-4 of HF's in float64."""

import copy
import functools
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file
from tiny_models import CONFIGS, DELTANET_CONFIGS, build_deltanet_model, hf_greedy_logprobs
from torch import nn
from transformers import AutoTokenizer

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.layers.quantized import QuantLinear

PROMPTS = ["The", "A hybrid model mixes attention",
           "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches"]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
LOGPROB_ATOL = 1e-4
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# Linears that route tokens to experts: releases leave them unquantized.
ROUTERS = ("router", "mlp.gate", "shared_expert_gate")


# --- The formats, written from their statements -----------------------------------------------------------

def fp8_blocks(w, block):
    """DeepSeek / Qwen FP8: one float32 scale per (rows x cols) block, scale = max|w| / 448, q = w / scale in
    e4m3; `weight_scale_inv` is the multiplier that dequantizes. Returns (q, scale_inv, dequantized)."""
    (n, k), (bn, bk) = w.shape, block
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    deq, q = torch.empty(n, k), torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale[i, j] = part.abs().max() / FP8_MAX
            qq = (part / scale[i, j]).to(torch.float8_e4m3fn)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qq
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qq.float() * scale[i, j]
    return {"weight": q, "weight_scale_inv": scale}, deq


def fp8_channel(w, per_tensor=False):
    """compressed-tensors float-quantized: scale (N, 1) per output channel (or (1,) per tensor) = max|w| / 448."""
    amax = w.float().abs().max().reshape(1) if per_tensor else w.float().abs().amax(dim=1, keepdim=True)
    scale = amax / FP8_MAX
    q = (w.float() / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def int4_groups(w, group, symmetric):
    """compressed-tensors pack-quantized int4 (signed, [-8, 7]): symmetric scale = max|w| / 7.5, q = round(w / s);
    asymmetric scale = (max - min) / 15 over a range holding 0, zero point z = -8 - round(min / s),
    q = round(w / s) + z; w = (q - z) * s. Values packed 8 to an int32 along K, zero points along N."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if symmetric:
        scale = g.abs().amax(dim=2) / 7.5
        zero = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = (hi - lo) / 15
        zero = (-8 - torch.round(lo / scale)).clamp(-8, 7)
    q = (torch.round(g / scale[:, :, None]) + zero[:, :, None]).clamp(-8, 7)
    deq = ((q - zero[:, :, None]) * scale[:, :, None]).view(n, k)
    tensors = {"weight_packed": pack_to_int32(q.view(n, k).to(torch.int8), 4),
               "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), 4, packed_dim=0)
    return tensors, deq


def ct_config(weights, ignore, fmt, activations=None):
    """quantization_config as llm-compressor writes it."""
    args = dict(actorder=None, block_structure=None, dynamic=False, group_size=None, observer="minmax",
                observer_kwargs={}, strategy="channel", symmetric=True, type="int", num_bits=8)
    return {"config_groups": {"group_0": {"input_activations": activations, "output_activations": None,
                                          "targets": ["Linear"], "weights": dict(args, **weights), "format": fmt}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


FP8_DYNAMIC_ACTS = dict(actorder=None, block_structure=None, dynamic=True, group_size=None, num_bits=8,
                        observer=None, observer_kwargs={}, strategy="token", symmetric=True, type="float")
FORMATS = {
    "fp8-block": (lambda w: fp8_blocks(w, (128, 128)),
                  lambda ignore: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ignore}),
    "fp8-block-32": (lambda w: fp8_blocks(w, (32, 32)),
                     lambda ignore: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [32, 32]}),
    "ct-fp8-channel": (fp8_channel, lambda ignore: ct_config(
        dict(type="float", strategy="channel"), ignore, "float-quantized", FP8_DYNAMIC_ACTS)),
    "ct-fp8-tensor": (lambda w: fp8_channel(w, per_tensor=True), lambda ignore: ct_config(
        dict(type="float", strategy="tensor"), ignore, "float-quantized")),
    "w4a16": (lambda w: int4_groups(w, 16, True), lambda ignore: ct_config(
        dict(num_bits=4, strategy="group", group_size=16), ignore, "pack-quantized")),
    "w4a16-asym": (lambda w: int4_groups(w, 16, False), lambda ignore: ct_config(
        dict(num_bits=4, strategy="group", group_size=16, symmetric=False), ignore, "pack-quantized")),
}


def quantized_copy(source, destination, hf, fmt, dtype=torch.float32):
    """Write `source`'s checkpoint into `destination` with the decoder linears quantized in `fmt`; return HF's
    model holding the dequantized weights (cast to `dtype` where the checkpoint is)."""
    quantize, config_of = FORMATS[fmt]
    shutil.copytree(source, destination)
    (shard,) = destination.glob("*.safetensors")
    tensors = load_file(shard)
    reference = copy.deepcopy(hf)
    linears = {name: m for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
    # The routers as recipes name them (HF's are not all nn.Linear; ours are), then every linear left as it is.
    quantized, ignore = [], ["lm_head", "re:.*router.*", "re:.*mlp[.]gate$", "re:.*shared_expert_gate$"]
    for name, module in linears.items():
        saved = name if name + ".weight" in tensors else "backbone." + name.removeprefix("model.")  # Nemotron-H's
        key = saved + ".weight"
        if ".layers." not in name or any(r in name for r in ROUTERS) or key not in tensors:
            if name != "lm_head":
                ignore.append(saved)
            continue
        parts, deq = quantize(tensors.pop(key).float())
        tensors.update({f"{saved}.{suffix}": t for suffix, t in parts.items()})
        with torch.no_grad():
            module.weight.copy_(deq.to(module.weight.dtype))
        quantized.append(name)
    assert quantized
    # HF holds some families' experts as stacked tensors, not linears (saved per expert or stacked): they stay
    # unquantized here.
    ignore += ["re:.*[.]experts[.].*"] if any(".experts." in key and key.endswith(".weight") for key in tensors) else []
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((destination / "config.json").read_text())
    config["quantization_config"] = config_of(ignore)
    (destination / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory, tiny_checkpoint, tokenizer_dir):
    """quantized_checkpoint(name, fmt[, dtype, **config overrides]) -> (directory, HF model on the dequantized
    weights)."""
    built = {}

    def make(name, fmt, dtype=torch.float32, **overrides):
        key = (name, fmt, dtype, tuple(sorted(overrides.items())))
        if key not in built:
            if name.startswith("qwen3"):
                source = tmp_path_factory.mktemp(name)
                hf = build_deltanet_model(name, source, tokenizer_dir, dtype=dtype, **overrides)
            else:
                source, hf = tiny_checkpoint(name, **({} if dtype == torch.float32 else {"dtype": dtype}), **overrides)
            directory = tmp_path_factory.mktemp(f"{name}-{fmt}") / "model"
            built[key] = directory, quantized_copy(source, directory, hf, fmt, dtype)
        return built[key]

    return make


@functools.cache  # a model hashes by identity; the cache keeps it, so its id is not reused
def float64_reference(reference):
    """The reference in float64 (its experts in eager loops: the grouped GEMMs take no float64), made once: the
    value that the engine's and HF's float32 both approximate. On qwen3_5_moe's 52-token prompt HF's float32
    logprobs stray from it by up to 1.5e-4, the engine's by 2.1e-5 (a prefill in our GEMM's summation order,
    not torch's)."""
    wide = copy.deepcopy(reference).double()
    wide.set_experts_implementation("eager")
    return wide


def assert_matches(llm, reference, label, prompts=PROMPTS):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        expected_tokens, logprobs = hf_greedy_logprobs(float64_reference(reference), output.prompt_token_ids,
                                                       NEW_TOKENS)
        assert completion.token_ids == expected_tokens, label
        for step, top in enumerate(completion.logprobs):
            ids = sorted(top)
            got = torch.tensor([top[t].logprob for t in ids])
            torch.testing.assert_close(got, logprobs[step][ids], atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m: f"{label} step {step}: {m}")
    return outputs


CASES = [("qwen3_next", "fp8-block"), ("qwen3_5", "fp8-block-32"), ("qwen3_5_moe", "fp8-block"),
         *[(name, fmt) for name in ("llama", "granite", "bamba", "granitemoehybrid", "granitemoehybrid-dense-nope",
                                    "nemotron_h", "falcon_h1") for fmt in ("ct-fp8-channel", "w4a16")],
         ("llama", "ct-fp8-tensor"), ("bamba", "w4a16-asym"), ("falcon_h1", "w4a16-asym"),
         ("granitemoehybrid", "w4a16-asym")]


@pytest.mark.parametrize("name,fmt", CASES)
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(name, fmt, quantized_checkpoint):
    directory, reference = quantized_checkpoint(name, fmt)
    llm = LLM(directory, dtype="float32")
    quantized = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.qweight.dtype != torch.float32 for m in quantized)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a decode batch size is captured the second time it runs
    assert_matches(llm, reference, f"{name} {fmt}")


def test_every_declared_checkpoint_format_is_proven_here():
    """A declaration lists fp8 or compressed-tensors exactly where a parity case above runs it."""
    from runtime.models import resolve
    proven = {}
    for name, fmt in CASES:
        architecture = {**CONFIGS, **DELTANET_CONFIGS}[name][1]
        proven.setdefault(architecture, set()).add("fp8" if fmt.startswith("fp8") else "compressed-tensors")
    for architecture, formats in proven.items():
        declared = set(resolve(architecture).quantizations) & {"fp8", "compressed-tensors"}
        assert declared == formats, architecture
    from matrix.collect import declarations
    for decl in declarations():
        if {"fp8", "compressed-tensors"} & set(decl.quantizations):
            assert decl.architecture in proven, decl.architecture


# --- bfloat16: within the bounds of the bfloat16 parity tests (test_parity.py) ------------------------------

def last_token_logits(llm, ids):
    """The logits of each prompt's last token, from one batched prefill step, in prompt order."""
    engine = llm.engine
    for prompt in ids:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    seqs, logits = engine.runner.execute(engine.scheduler.schedule())
    assert [seq.prompt_token_ids for seq in seqs] == ids
    return logits


@pytest.mark.parametrize("name,fmt", [("bamba", "ct-fp8-channel"), ("bamba", "w4a16-asym"),
                                      ("qwen3_5", "fp8-block")])
def test_bfloat16_quantized_checkpoint_stays_close_to_float32(name, fmt, quantized_checkpoint):
    """A bfloat16 checkpoint quantized (initializer range 1/sqrt(hidden), as test_parity's bfloat16 test): the
    engine's bfloat16 run loses no more than 0.1 of the logits' range and no more than twice HF's own bfloat16
    forward of the dequantized weights, against the engine's float32 run of the same file."""
    directory, reference = quantized_checkpoint(name, fmt, torch.bfloat16)
    full = LLM(directory, dtype="float32")
    ids = [full.get_tokenizer().encode(p) for p in PROMPTS]
    expected = last_token_logits(full, ids)
    got = last_token_logits(LLM(directory, dtype="bfloat16"), ids)
    from tiny_models import hf_last_logits
    hf_rows = torch.stack([hf_last_logits(reference, p) for p in ids])
    hf_error, error = (hf_rows - expected).abs().max(), (got - expected).abs().max()
    assert error < 0.1 * expected.abs().max() and error <= 2 * hf_error, (error, hf_error)
    kept = hf_rows.argmax(-1) == expected.argmax(-1)
    assert torch.equal(got.argmax(-1)[kept], expected.argmax(-1)[kept])


# --- The engine's features keep working on a loaded quantized checkpoint ----------------------------------

def test_chunked_prefill_and_prefix_caching_on_a_quantized_checkpoint(quantized_checkpoint):
    """Steps of 21 tokens, then a second pass resuming from cached prefixes: HF's tokens and logprobs."""
    directory, reference = quantized_checkpoint("bamba", "w4a16-asym")
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=21, enable_prefix_caching=True)
    assert_matches(llm, reference, "chunked")
    again = assert_matches(llm, reference, "from the prefix cache")
    assert again[-1].num_cached_tokens > 0


def test_preemption_on_a_quantized_checkpoint(quantized_checkpoint):
    """A pool that holds the prompts' prefills only: decoding preempts sequences, which are recomputed."""
    directory, reference = quantized_checkpoint("bamba", "ct-fp8-channel")
    ids = AutoTokenizer.from_pretrained(directory).encode(PROMPTS[2])
    prompts = [{"prompt_token_ids": ids[:n]} for n in (30, 40, 44)]
    layout = EngineConfig(str(directory), dtype="float32").cache
    num_pages = sum(layout.pages_per_sequence(len(p["prompt_token_ids"])) for p in prompts)
    llm = LLM(directory, dtype="float32", max_model_len=64, num_pages=num_pages)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert any(output.num_preemptions for output in outputs), "no sequence was preempted"
    for output in outputs:
        assert output.outputs[0].token_ids == hf_greedy_logprobs(reference, output.prompt_token_ids, NEW_TOKENS)[0]


def test_decode_steps_are_captured_on_a_quantized_checkpoint(quantized_checkpoint):
    """The asymmetric int4 and FP8 weights run torch's reference inside a captured decode step: the graph is
    captured, kept, and replays HF's tokens (the enforce_eager run gives the same)."""
    from runtime.kernels import cpu_native
    if not cpu_native.available():
        pytest.skip("captured decode steps need the native CPU library")
    for fmt in ("w4a16-asym", "ct-fp8-channel"):
        directory, reference = quantized_checkpoint("llama", fmt)
        llm = LLM(directory, dtype="float32")
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_matches(llm, reference, f"{fmt} captured")
        graphs = llm.engine.runner.graphs
        assert graphs is not None and not graphs.disabled and graphs.graphs, "no decode step was captured"
        assert_matches(LLM(directory, dtype="float32", enforce_eager=True), reference, f"{fmt} eager")


def test_weights_stay_quantized_and_what_stays_unquantized_follows_the_file(quantized_checkpoint):
    directory, _ = quantized_checkpoint("granitemoehybrid", "w4a16")
    model = LLM(directory, dtype="float32").engine.runner.model
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert {"model.layers.0.mamba.in_proj", "model.layers.0.mamba.out_proj", "model.layers.1.self_attn.q_proj",
            "model.layers.0.shared_mlp.input_linear"} <= quantized
    assert not any("router" in name or "lm_head" in name or "embed" in name for name in quantized)
    params = dict(model.named_parameters())
    for name in ("model.layers.0.mamba.A_log", "model.layers.0.mamba.conv1d.weight", "model.embed_tokens.weight",
                 "model.layers.0.mamba.D", "model.layers.0.mamba.dt_bias"):
        assert params[name].dtype == torch.float32, name
    assert all(m.qweight.dtype == torch.uint8 and m.offsets is None for n, m in model.named_modules() if n in quantized)


# --- Bad input: one line naming the tensor or the setting, and what is supported ----------------------------

def edited(quantized_checkpoint, tmp_path, name, fmt, config=None, tensors=None):
    """A copy of a quantized checkpoint with config.json's quantization_config and tensors edited."""
    directory = tmp_path / "model"
    shutil.copytree(quantized_checkpoint(name, fmt)[0], directory)
    raw = json.loads((directory / "config.json").read_text())
    if config is not None:
        config(raw["quantization_config"])
        (directory / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(directory / "model.safetensors")
        tensors(state)
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def w8a8(qc):
    qc["config_groups"]["group_0"]["input_activations"] = dict(FP8_DYNAMIC_ACTS, type="int")  # W8A8, dynamic


def group_of(size):
    def edit(qc):
        qc["config_groups"]["group_0"]["weights"]["group_size"] = size
    return edit


CONFIG_ERRORS = [
    (lambda qc: qc.update(quant_method="awq"), "quant_method 'awq' is not supported; supported: quant_method fp8"),
    (w8a8, "quantizes activations (int8, dynamic), which is not supported"),
    (lambda qc: qc.update(format="nvfp4-pack-quantized") or qc["config_groups"]["group_0"].update(format=None),
     "compressed-tensors format 'nvfp4-pack-quantized' (config group 'group_0') is not supported"),
    (lambda qc: qc.update(kv_cache_scheme=dict(num_bits=8, type="float")), "a quantized KV cache"),
]


@pytest.mark.parametrize("edit,message", CONFIG_ERRORS)
def test_an_unsupported_quantization_config_is_refused_before_loading(edit, message, quantized_checkpoint, tmp_path):
    directory = edited(quantized_checkpoint, tmp_path, "llama", "w4a16", config=edit)
    with pytest.raises(ValueError, match="quantization_config") as err:
        EngineConfig(str(directory))  # refused with the config: no weight is read
    assert message in str(err.value) and "\n" not in str(err.value)


def shape_of(value):
    def edit(state):
        state["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor(value)
    return edit


TENSOR_ERRORS = [
    (dict(config=group_of(128)), "model.layers.0.self_attn.q_proj: group_size 128 does not divide its 64 inputs; "
                                 "supported: group sizes that divide the layer's input size"),
    (dict(tensors=shape_of([64, 97])), "model.layers.0.mlp.down_proj.weight_shape: the checkpoint has shape (64, 97) "
                                       "but the model's layer needs (64, 96)"),
    (dict(tensors=lambda s: s.update({"model.layers.1.self_attn.q_proj.weight_scale":
                                      s["model.layers.1.self_attn.q_proj.weight_scale"][:, :2].contiguous()})),
     "model.layers.1.self_attn.q_proj.weight_scale: the checkpoint has shape (64, 2) but one scale per output and "
     "16 inputs needs (64, 4)"),
    (dict(tensors=lambda s: s.pop("model.layers.1.self_attn.o_proj.weight_packed")),
     "model.layers.1.self_attn.o_proj.weight_packed is missing from the checkpoint"),
]


@pytest.mark.parametrize("edit,message", TENSOR_ERRORS)
def test_a_checkpoint_that_disagrees_with_its_quantization_config_names_the_tensor(edit, message,
                                                                                   quantized_checkpoint, tmp_path):
    directory = edited(quantized_checkpoint, tmp_path, "llama", "w4a16", **edit)
    with pytest.raises(ValueError) as err:
        LLM(directory, dtype="float32")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_fp8_block_scale_of_the_wrong_shape_names_the_tensor(quantized_checkpoint, tmp_path):
    name = "model.layers.0.linear_attn.out_proj.weight_scale_inv"
    directory = edited(quantized_checkpoint, tmp_path, "qwen3_5", "fp8-block-32",
                       tensors=lambda s: s.update({name: s[name][:1].contiguous()}))
    with pytest.raises(ValueError, match=f"{name}: the checkpoint has shape .1, 1. but 32x32 blocks needs .2, 1."):
        LLM(directory, dtype="float32")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "runtime", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("edit,message", [(dict(config=lambda qc: qc.update(quant_method="awq")),
                                           "quant_method 'awq' is not supported"),
                                          TENSOR_ERRORS[0]])
def test_the_cli_exits_2_with_one_line(edit, message, quantized_checkpoint, tmp_path):
    directory = edited(quantized_checkpoint, tmp_path, "llama", "w4a16", **edit)
    result = cli("generate", str(directory), "The", "--max-tokens", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


# --- quantization= names the checkpoint's format, as vLLM lets it ---------------------------------------------

def test_quantization_option_matches_the_checkpoint(quantized_checkpoint, tiny_checkpoint):
    fp8, _ = quantized_checkpoint("qwen3_5", "fp8-block-32")
    ct, _ = quantized_checkpoint("llama", "w4a16")
    assert EngineConfig(str(fp8), quantization="fp8").checkpoint_quantization.method == "fp8"
    assert EngineConfig(str(ct), quantization="compressed-tensors").checkpoint_quantization.method == \
        "compressed-tensors"
    with pytest.raises(ValueError, match="quantization='compressed-tensors' does not match the checkpoint, whose "
                                         "quantization_config says fp8; pass quantization='fp8' or drop the option"):
        EngineConfig(str(fp8), quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization='int8': this checkpoint is already quantized"):
        EngineConfig(str(ct), quantization="int8")
    with pytest.raises(ValueError, match="quantization='fp8' names a checkpoint format, but config.json has no "
                                         "quantization_config"):
        EngineConfig(str(tiny_checkpoint("llama")[0]), quantization="fp8")
    # Tensor and pipeline parallelism run quantized checkpoints: tests/distributed/test_tp_quant.py.
    assert EngineConfig(str(ct), tensor_parallel_size=2, pipeline_parallel_size=2).tensor_parallel_size == 2


def test_the_cli_spells_the_mismatch_as_flags(quantized_checkpoint):
    directory, _ = quantized_checkpoint("llama", "ct-fp8-channel")
    result = cli("generate", str(directory), "The", "--quantization", "int4")
    assert result.returncode == 2 and "--quantization int4: this checkpoint is already quantized" in result.stderr
    result = cli("plan", str(directory))
    assert result.returncode == 0 and "compressed-tensors float-quantized checkpoint" in result.stdout, result.stderr
