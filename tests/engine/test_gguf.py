"""GGUF files as models: tiny files written as llama.cpp's convert_hf_to_gguf.py writes them (tests/gguf_files.py),
run in float32 against transformers on the weights gguf.quants.dequantize reads from the same file."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import default_types, encode_q4_k, encode_q6_k, q4_k_m, read_back, write_gguf
from tiny_models import hf_greedy_logprobs
from transformers import AutoTokenizer

from runtime import LLM, SamplingParams
from runtime.gguf.blocks import decode
from runtime.gguf.config import raw_config
from runtime.kernels.quant_linear import dequantize as dequantize_ours
from runtime.layers.quantized import QuantLinear

PROMPTS = ["The", "A hybrid model mixes attention",
           "The page pool holds attention blocks and Mamba states of equal size. The scheduler batches"]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
LOGPROB_ATOL = 1e-4
# K-quant rows are whole blocks of 256 values: every linear's input is 256 wide.
# Four times as wide as the tiny models: half the initializer range keeps their activations (and float32's
# rounding in them) at the tiny models' scale; at 0.3 one logprob differs by 1.1e-4 (Bamba), 1.2e-4 (Granite 4.0-H) and 2e-4 (Llama,
# whose native int4 kernel sums in another order than torch's GEMM: each within 2e-6 of float64 on a layer).
WIDE = {"llama": dict(hidden_size=256, intermediate_size=256, initializer_range=0.15),
        "bamba": dict(hidden_size=256, intermediate_size=256, mamba_n_heads=16, mamba_d_head=32,
                      initializer_range=0.15),
        "granitemoehybrid-dense-nope": dict(hidden_size=256, shared_intermediate_size=256, mamba_n_heads=16,
                                                    mamba_d_head=32, initializer_range=0.15)}
SCALE_OFFSET = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every field, with finite random float16 scales (random bytes may spell inf or NaN)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSET[qtype]:
        scales = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K])
def test_each_block_type_maps_onto_our_format_as_gguf_dequantizes_it(qtype):
    raw = random_blocks(qtype, rows=5, blocks_per_row=3 if qtype in (T.Q8_0, T.Q4_0) else 2)
    weight = decode(raw, qtype)
    ours = dequantize_ours(weight.qweight, weight.scales, weight.group_size, weight.in_features, weight.offsets)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    assert ours.shape == theirs.shape
    assert weight.qweight.dtype == (torch.uint8 if qtype in (T.Q4_0, T.Q4_K) else torch.int8)
    if qtype == T.Q4_K:  # q * scale + (8 * scale - dmin * m) against nibble * scale - dmin * m: one rounding apart
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("encode, qtype, levels", [(encode_q4_k, T.Q4_K, 15), (encode_q6_k, T.Q6_K, 63)])
def test_the_test_side_k_quant_encoders_write_blocks_gguf_reads_back(encode, qtype, levels):
    w = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(encode(w), qtype)
    assert np.abs(back - w).max() < 2 * (w.max() - w.min()) / levels


def oracle_model(hf, state):
    reference = copy.deepcopy(hf)
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:
        reference.tie_weights()
    return reference


def assert_matches(llm, reference, label):
    for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        completion = output.outputs[0]
        expected, logprobs = hf_greedy_logprobs(reference, output.prompt_token_ids, NEW_TOKENS)
        assert completion.token_ids == expected, label
        for step, top in enumerate(completion.logprobs):
            ids = sorted(top)
            got = torch.tensor([top[t].logprob for t in ids])
            torch.testing.assert_close(got, logprobs[step][ids], atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m: f"{label} step {step}: {m}")


CASES = [("llama", "F32"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_K_M"),
         ("granitemoehybrid-dense-nope", "F32"), ("granitemoehybrid-dense-nope", "Q8_0"),
         ("granitemoehybrid-dense-nope", "Q4_0"), ("granitemoehybrid-dense-nope", "Q4_K_M"),
         ("bamba", "Q8_0"), ("bamba", "Q4_K_M")]
FILE_TYPES = {"F32": (default_types(T.F32), gguf.LlamaFileType.ALL_F32),
              "BF16": (default_types(T.BF16), gguf.LlamaFileType.MOSTLY_BF16),
              "Q8_0": (default_types(T.Q8_0), gguf.LlamaFileType.MOSTLY_Q8_0),
              "Q4_0": (default_types(T.Q4_0), gguf.LlamaFileType.MOSTLY_Q4_0),
              "Q4_K_M": (q4_k_m, gguf.LlamaFileType.MOSTLY_Q4_K_M)}


@pytest.fixture(scope="module")
def gguf_model(tiny_checkpoint, tmp_path_factory):
    """gguf_model(name, file type) -> (path of the .gguf, the HF model on the weights it stands for)."""
    built = {}

    def make(name, kind):
        if (name, kind) not in built:
            directory, hf = tiny_checkpoint(name, **(WIDE[name] if kind == "Q4_K_M" else {}))
            path = tmp_path_factory.mktemp("gguf") / f"{name}-{kind}.gguf"
            types, file_type = FILE_TYPES[kind]
            built[name, kind] = path, oracle_model(hf, write_gguf(directory, path, types, file_type))
        return built[name, kind]
    return make


@pytest.mark.parametrize("name, kind", CASES)
def test_gguf_tokens_and_logprobs_match_transformers_on_the_dequantized_weights(name, kind, gguf_model):
    path, reference = gguf_model(name, kind)
    llm = LLM(str(path), dtype="float32")
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a decode batch size is captured the second time it runs
    assert_matches(llm, reference, f"{name} {kind}")
    assert_matches(LLM(str(path), dtype="float32", enforce_eager=True), reference, f"{name} {kind} eager")
    linears = [m for n, m in llm.engine.runner.model.named_modules() if ".layers." in n and isinstance(m, QuantLinear)]
    if kind in ("F32", "BF16"):
        assert not linears
    else:  # every decoder linear stays quantized (Q8_0 falls back to F32 where a row is not whole blocks)
        assert linears and all(m.scheme.startswith("gguf-") for m in linears)
        kinds = {m.scheme for m in linears}
        assert kinds == ({"gguf-q4_k", "gguf-q6_k"} if kind == "Q4_K_M" else {f"gguf-{kind.lower()}"})


def test_the_oracle_tells_the_formats_apart(gguf_model):
    """Q4_0's weights move the logprobs by far more than the 1e-4 the parity test allows."""
    path, _ = gguf_model("llama", "Q4_0")
    _, f32_reference = gguf_model("llama", "F32")
    llm = LLM(str(path), dtype="float32")
    with pytest.raises(AssertionError):
        assert_matches(llm, f32_reference, "Q4_0 against F32")


def test_a_bf16_file_runs_in_bfloat16_and_a_quantized_one_in_float32(gguf_model):
    assert LLM(str(gguf_model("llama", "BF16")[0])).engine.config.model_dtype == "bfloat16"
    assert LLM(str(gguf_model("llama", "Q8_0")[0])).engine.config.model_dtype == "float32"


def test_the_tokenizer_comes_from_the_file(gguf_model, tiny_checkpoint):
    path, _ = gguf_model("granitemoehybrid-dense-nope", "Q8_0")
    directory, _ = tiny_checkpoint("granitemoehybrid-dense-nope")
    ours = LLM(str(path)).get_tokenizer()
    theirs = AutoTokenizer.from_pretrained(directory)
    for prompt in PROMPTS:
        assert ours.encode(prompt) == theirs.encode(prompt)
        assert ours.decode(theirs.encode(prompt)) == prompt
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_a_directory_holding_one_gguf_file_is_a_model(gguf_model, tmp_path):
    path, reference = gguf_model("llama", "Q8_0")
    (tmp_path / path.name).write_bytes(path.read_bytes())
    assert_matches(LLM(str(tmp_path), dtype="float32"), reference, "directory")


# Bad input: one line naming the tensor or key and what is supported; ValueError from LLM, exit 2 from the CLI.

def cli_error(path) -> str:
    result = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(path), "Hi"],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def llm_error(path) -> str:
    with pytest.raises(ValueError) as err:
        LLM(str(path))
    return str(err.value)


def test_a_tensor_type_tandem_cannot_run_is_named_with_the_supported_ones(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    types = default_types(T.Q8_0)
    write_gguf(directory, tmp_path / "m.gguf", lambda n, s: T.Q5_0 if n == "blk.1.ffn_up.weight" else types(n, s))
    for message in (llm_error(tmp_path / "m.gguf"), cli_error(tmp_path / "m.gguf")):
        assert "tensor blk.1.ffn_up.weight is Q5_0, which Tandem cannot run" in message
        assert "supported GGUF tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K" in message


def test_an_architecture_without_a_mapping_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    for message in (llm_error(tmp_path / "m.gguf"), cli_error(tmp_path / "m.gguf")):
        assert "GGUF architecture 'gpt2' is not supported; Tandem loads GGUF files of llama, granitehybrid" in message


def test_shapes_that_disagree_with_the_metadata_name_the_tensor(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    wrong = tmp_path / "checkpoint"
    shutil.copytree(directory, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))  # the tensors have 96
    write_gguf(wrong, tmp_path / "m.gguf", default_types(T.Q8_0))
    for message in (llm_error(tmp_path / "m.gguf"), cli_error(tmp_path / "m.gguf")):
        assert "tensor blk.0.ffn_down.weight has shape (64, 96)" in message
        assert "the metadata makes it (64, 128)" in message


def test_a_truncated_file_is_refused_before_anything_loads(gguf_model, tmp_path):
    path, _ = gguf_model("llama", "Q8_0")
    data = path.read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[:len(data) * 2 // 3])
    for message in (llm_error(tmp_path / "m.gguf"), cli_error(tmp_path / "m.gguf")):
        assert "m.gguf is not a readable GGUF file" in message and "truncated" in message


def test_two_gguf_files_in_a_directory_ask_for_one(gguf_model, tmp_path):
    path, _ = gguf_model("llama", "Q8_0")
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(path.read_bytes())
    assert "holds 2 GGUF files (a.gguf, b.gguf); pass the path of the one to run" in cli_error(tmp_path)


def test_the_cli_generates_from_a_gguf_file(gguf_model, tiny_checkpoint):
    path, _ = gguf_model("granitemoehybrid-dense-nope", "Q4_0")
    result = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(path), "The page",
                             "--max-tokens", "4", "--temperature", "0"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    expected = LLM(str(path)).generate(["The page"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert expected[0].outputs[0].text in result.stdout


# llama.cpp's own converter, where its source is at hand (LLAMA_CPP_DIR: the llama.cpp directory holding
# convert_hf_to_gguf.py, e.g. the one vendored in the llama-cpp-python 0.3.36 sdist): it pins the layout that
# gguf_files.py imitates. The shim gives it what the tiny checkpoints lack: no sentencepiece model, and a BPE
# pre-tokenizer whose hash it does not know (named "gpt-2", as gguf_files.py names it).
CONVERTER_SHIM = """
import runpy, sys
from pathlib import Path
root = Path(sys.argv.pop(1))
sys.path.insert(0, str(root)); sys.path.insert(1, str(root / "gguf-py"))
from conversion import base
def no_sentencepiece(self): raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = str(root / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""
LLAMA_CPP = os.environ.get("LLAMA_CPP_DIR")


def convert(directory, out, outtype):
    result = subprocess.run([sys.executable, "-c", CONVERTER_SHIM, LLAMA_CPP, str(directory), "--outtype", outtype,
                             "--outfile", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def layout(path):
    return {(t.name, tuple(int(n) for n in t.shape), T(t.tensor_type).name) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.skipif(not LLAMA_CPP, reason="set LLAMA_CPP_DIR to llama.cpp's source to run its converter")
@pytest.mark.parametrize("name", ["llama", "granitemoehybrid-dense-nope", "bamba"])
def test_llama_cpps_converter_writes_the_layout_the_tests_write_and_runs(name, tiny_checkpoint, tmp_path):
    directory, hf = tiny_checkpoint(name)
    source = tmp_path / "checkpoint"
    shutil.copytree(directory, source)
    config = json.loads((source / "config.json").read_text())
    if "layer_types" in config:  # as published Granite 4.0 configs spell them, which is what the converter reads
        config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]
        (source / "config.json").write_text(json.dumps(config))
    convert(source, tmp_path / "f32.gguf", "f32")
    write_gguf(directory, tmp_path / "ours.gguf", default_types(T.F32))
    assert layout(tmp_path / "f32.gguf") == layout(tmp_path / "ours.gguf")
    assert raw_config(tmp_path / "f32.gguf") == raw_config(tmp_path / "ours.gguf")
    assert_matches(LLM(str(tmp_path / "f32.gguf"), dtype="float32"), hf, f"{name} converted to F32")
    convert(source, tmp_path / "q8_0.gguf", "q8_0")
    reference = oracle_model(hf, read_back(tmp_path / "q8_0.gguf", config))
    assert_matches(LLM(str(tmp_path / "q8_0.gguf"), dtype="float32"), reference, f"{name} converted to Q8_0")


def test_every_architecture_declaring_gguf_is_proven_here():
    """A declaration lists "gguf" exactly where a parity case (above, or test_gguf_families.py's) runs a GGUF file
    of it."""
    from matrix.collect import declarations
    from test_gguf_families import CASES as FAMILY_CASES
    from test_gguf_families import tiny_architecture

    from runtime.models import resolve

    tiny = {"llama": "llama", "granitemoehybrid-dense-nope": "granitemoehybrid", "bamba": "bamba"}
    proven = {resolve_name(tiny[name]) for name, _ in CASES} | {tiny_architecture(name) for name, _ in FAMILY_CASES}
    declared = {decl.architecture for decl in declarations() if "gguf" in decl.quantizations}
    assert declared == proven
    assert all("gguf" in resolve(architecture).quantizations for architecture in proven)


def resolve_name(name: str) -> str:
    from tiny_models import CONFIGS

    return CONFIGS[name][1]
