"""GGUF files of the recurrent and hybrid families (mamba, mamba2, nemotron_h_moe, falcon-h1, lfm2, qwen3next), written
as llama.cpp's
converter writes them (tests/gguf_family_files.py), run in float32 against transformers on the checkpoint the file
stands for (its tensors dequantized by gguf.quants.dequantize, the converter's changes undone)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_family_files import oracle_checkpoint, write_family_gguf
from gguf_files import q4_k_m
from test_gguf import CONVERTER_SHIM, GREEDY, LLAMA_CPP, PROMPTS, assert_matches, llm_error
from tiny_models import CONFIGS, DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model, build_model
from transformers import AutoModelForCausalLM

from runtime import LLM
from runtime.gguf.config import raw_config
from runtime.layers.quantized import QuantLinear

# Every linear's input 256 wide for the K-quants (Mamba-2: 16 heads of 32 = twice the width); half the
# initializer range keeps the activations at the tiny models' scale (see test_gguf.py's WIDE).
WIDE = {"mamba2": dict(hidden_size=256, num_heads=16, head_dim=32, initializer_range=0.15)}
# llama.cpp's converter maps no dense-MLP block of Qwen3-Next (mlp_only_layers): published ones have none.
# nemotron_h_dense: Nemotron-H without experts, whose config.json lacks num_experts_per_tok (as Nemotron-H 8B's
# does), which the converter writes as architecture nemotron_h rather than nemotron_h_moe.
# Its Gated DeltaNet at initializer range 0.3 drifted from transformers' float32 logprobs by up to 1.9e-4 on an
# AVX-512 EPYC (the torch references without native kernels by 1.04e-4), under 1e-4 on an AMX Xeon: 0.2 here.
OVERRIDES = {"qwen3_next": dict(mlp_only_layers=[], initializer_range=0.2),
             "nemotron_h_dense": dict(layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"])}
CASES = [("mamba", "F32"), ("mamba", "Q8_0"), ("jamba", "F32"), ("jamba", "Q8_0"),
         ("qwen3_next", "F32"), ("qwen3_next", "Q8_0"), ("qwen3_next", "Q4_0"),
         ("mamba2", "F32"), ("mamba2", "Q8_0"), ("mamba2", "Q4_0"), ("mamba2", "Q4_K_M"),
         ("nemotron_h", "F32"), ("nemotron_h", "BF16"), ("nemotron_h", "Q8_0"), ("nemotron_h_dense", "Q8_0"),
         ("falcon_h1", "F32"), ("falcon_h1", "Q8_0"), ("falcon_h1_rms_norm", "Q8_0"),
         ("lfm2", "F32"), ("lfm2", "Q8_0")]
GGUF_ARCH = {"mamba": "mamba", "jamba": "jamba", "qwen3_next": "qwen3next", "mamba2": "mamba2",
             "nemotron_h": "nemotron_h_moe", "nemotron_h_dense": "nemotron_h", "falcon_h1": "falcon-h1",
             "falcon_h1_rms_norm": "falcon-h1", "lfm2": "lfm2"}


def whole_file(qtype: T):
    """llama-quantize's choice for a whole-file type: 2-D and 3-D (experts) weights in `qtype` where their rows are
    whole blocks; norms, convs, routers and SSM parameters F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def pick(name: str, shape: tuple[int, ...]) -> T:
        keep = ("norm", "conv", "ffn_gate_inp", "ssm_a", "ssm_d", "exp_probs_b")
        if len(shape) < 2 or any(part in name for part in keep) or shape[-1] % block:
            return T.F32
        return qtype
    return pick


FILE_TYPES = {"F32": (whole_file(T.F32), gguf.LlamaFileType.ALL_F32),
              "BF16": (whole_file(T.BF16), gguf.LlamaFileType.MOSTLY_BF16),
              "Q8_0": (whole_file(T.Q8_0), gguf.LlamaFileType.MOSTLY_Q8_0),
              "Q4_0": (whole_file(T.Q4_0), gguf.LlamaFileType.MOSTLY_Q4_0),
              "Q4_K_M": (q4_k_m, gguf.LlamaFileType.MOSTLY_Q4_K_M)}


@pytest.fixture(scope="module")
def family_gguf(tokenizer_dir, tmp_path_factory):
    """family_gguf(name, file type) -> (path of the .gguf, HF transformers on the checkpoint it stands for)."""
    built = {}

    def make(name, kind):
        if (name, kind) not in built:
            root = tmp_path_factory.mktemp(f"{name}-{kind}")
            build_tiny(name, root / "hf", tokenizer_dir, **(WIDE.get(name, {}) if kind == "Q4_K_M" else {}))
            types, file_type = FILE_TYPES[kind]
            write_family_gguf(root / "hf", root / "m.gguf", types, file_type)
            oracle = oracle_checkpoint(root / "m.gguf", root / "hf", root / "oracle")
            built[name, kind] = root / "m.gguf", AutoModelForCausalLM.from_pretrained(oracle).float().eval()
        return built[name, kind]
    return make


@pytest.mark.parametrize("name, kind", CASES)
def test_family_gguf_tokens_and_logprobs_match_transformers(name, kind, family_gguf):
    path, reference = family_gguf(name, kind)
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == GGUF_ARCH[name]
    llm = LLM(str(path), dtype="float32")
    assert_matches(llm, reference, f"{name} {kind}")
    linears = [m for n, m in llm.engine.runner.model.named_modules() if ".layers." in n and isinstance(m, QuantLinear)]
    if kind in ("F32", "BF16"):
        assert not linears
    else:
        assert linears and {m.scheme for m in linears} <= {"gguf-q4_k", "gguf-q6_k", f"gguf-{kind.lower()}"}


def test_falcon_h1_multipliers_live_in_the_weights(family_gguf):
    """The converter multiplied Falcon-H1's muP multipliers into the weights: the config keeps them at 1, and the
    tiny checkpoint's own (non-1) multipliers would change the tokens."""
    path, _ = family_gguf("falcon_h1", "F32")
    config = raw_config(path)
    assert config["embedding_multiplier"] == config["key_multiplier"] == 1.0
    assert config["ssm_multipliers"] == [1.0] * 5 and config["mamba_d_ssm"] == 96


def test_a_decode_batch_runs_the_file_as_eager_does(family_gguf):
    """Captured decode steps (the default) and eager mode give the same tokens on a quantized hybrid file."""
    path, reference = family_gguf("nemotron_h", "Q8_0")
    llm = LLM(str(path), dtype="float32")
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a decode batch size is captured the second time it runs
    assert_matches(llm, reference, "nemotron_h Q8_0 captured")
    assert_matches(LLM(str(path), dtype="float32", enforce_eager=True), reference, "nemotron_h Q8_0 eager")


def tiny_name(name: str) -> str:
    return "nemotron_h" if name == "nemotron_h_dense" else name


def tiny_architecture(name: str) -> str:
    name = tiny_name(name)
    return (CONFIGS.get(name) or FAMILY_CONFIGS.get(name) or DELTANET_CONFIGS[name])[1]


def build_tiny(name: str, directory, tokenizer_dir, **overrides) -> None:
    tiny = tiny_name(name)
    build = build_model if tiny in CONFIGS else build_family_model if tiny in FAMILY_CONFIGS else build_deltanet_model
    build(tiny, directory, tokenizer_dir, **{**OVERRIDES.get(name, {}), **overrides})
    if name == "nemotron_h_dense":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                           if k != "num_experts_per_tok"}))


def test_a_falcon_mamba_file_is_refused_with_the_reason(tokenizer_dir, tmp_path):
    """llama.cpp runs Falcon-Mamba's B/C/dt norms with the layers' epsilon, which the file cannot tell apart from
    the model's own mixer_rms_eps: one line saying so, from LLM and from the CLI."""
    build_family_model("falcon_mamba", tmp_path / "hf", tokenizer_dir)
    write_family_gguf(tmp_path / "hf", tmp_path / "m.gguf", *FILE_TYPES["Q8_0"])
    message = llm_error(tmp_path / "m.gguf")  # test_gguf.py checks that such a ValueError is exit 2 from the CLI
    assert "mamba.ssm.dt_b_c_rms is set (Falcon-Mamba), which Tandem does not load from GGUF" in message


def test_a_qwen3next_file_whose_key_heads_disagree_with_its_tensors_names_one(family_gguf, tmp_path):
    """The Gated DeltaNet's key-head count disagrees with the tensors: one line naming a tensor, nothing loaded."""
    path, _ = family_gguf("qwen3_next", "F32")
    # The tensors have 2 key heads.
    rewritten(path, tmp_path / "m.gguf", "qwen3next", {"qwen3next.ssm.group_count": (1, gguf.GGUFValueType.UINT32)}, {})
    message = llm_error(tmp_path / "m.gguf")
    assert "tensor blk.0." in message and "the metadata makes it" in message and "inconsistent" in message


def rewritten(path, out, arch, fields: dict, renamed: dict) -> None:
    """`path`'s file written again at `out`, with `fields` in place of its own and the tensors `renamed` maps (old
    name -> new name) added a second time under the new name."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, arch)
    for key, item in reader.fields.items():
        if key.startswith((f"{arch}.", "tokenizer.ggml.")) or key == "general.file_type":
            if key not in fields:
                copy_field(writer, key, item)
    for key, (value, kind) in fields.items():
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    for tensor in reader.tensors:
        if tensor.name in renamed:
            writer.add_tensor(renamed[tensor.name], np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def test_qwen3next_multi_token_prediction_blocks_are_skipped(family_gguf, tmp_path):
    """A Qwen3-Next file converted with its MTP head holds one more block (nextn_predict_layers = 1) after the
    decoder's: the engine runs the decoder alone, as transformers does."""
    path, reference = family_gguf("qwen3_next", "Q8_0")
    u32 = gguf.GGUFValueType.UINT32
    extra = {t.name: t.name.replace("blk.1.", "blk.4.", 1) for t in gguf.GGUFReader(path).tensors
             if t.name.startswith("blk.1.")}
    rewritten(path, tmp_path / "m.gguf", "qwen3next",
              {"qwen3next.block_count": (5, u32), "qwen3next.nextn_predict_layers": (1, u32)}, extra)
    assert raw_config(tmp_path / "m.gguf")["num_hidden_layers"] == 4
    assert_matches(LLM(str(tmp_path / "m.gguf"), dtype="float32"), reference, "qwen3_next with an MTP block")


def copy_field(writer, key, item):
    value, kind = item.contents(), item.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, value)
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(key, value)
    else:
        writer.add_key_value(key, value, kind)


# llama.cpp's own converter, where its source is at hand (LLAMA_CPP_DIR, as test_gguf.py's converter test): the
# layout gguf_family_files.py writes is the converter's, tensor for tensor, and the converter's files run.
FAMILY_SHIM = CONVERTER_SHIM.replace("sys.argv[0] = str", """from conversion import jamba
jamba.JambaModel.set_vocab = lambda self: self._set_vocab_gpt2()  # no Llama tokenizer in the tiny checkpoints
sys.argv[0] = str""")


def family_layout(path):
    reader = gguf.GGUFReader(path)
    skip = ("GGUF.", "general.", "tokenizer.")
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(skip)}
    return fields, {t.name: np.asarray(t.data).tobytes() for t in reader.tensors}


@pytest.mark.skipif(not LLAMA_CPP, reason="set LLAMA_CPP_DIR to llama.cpp's source to run its converter")
# Not nemotron_h_dense: the converter reads the config through transformers, whose NemotronHConfig (5.x) always
# has num_experts_per_tok, so it writes nemotron_h_moe whatever config.json says.
@pytest.mark.parametrize("name", ["mamba", "mamba2", "nemotron_h", "falcon_h1", "lfm2", "qwen3_next", "jamba"])
def test_llama_cpps_converter_writes_what_the_tests_write_and_runs(name, tokenizer_dir, tmp_path):
    build_tiny(name, tmp_path / "hf", tokenizer_dir)
    source = tmp_path / "source"
    shutil.copytree(tmp_path / "hf", source)
    config = json.loads((source / "config.json").read_text())
    if name == "falcon_h1":  # published Falcon-H1 configs carry head_dim, which the converter reads
        (source / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    extra = ["--no-mtp"] if name == "qwen3_next" else []  # the tiny checkpoint has no MTP head
    for outtype in ("f32", "q8_0"):
        command = [sys.executable, "-c", FAMILY_SHIM, LLAMA_CPP, str(source), "--outtype", outtype,
                   "--outfile", str(tmp_path / f"{outtype}.gguf"), *extra]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
    write_family_gguf(tmp_path / "hf", tmp_path / "ours.gguf", *FILE_TYPES["F32"])
    theirs, ours = family_layout(tmp_path / "f32.gguf"), family_layout(tmp_path / "ours.gguf")
    assert theirs[0] == ours[0] and theirs[1].keys() == ours[1].keys()
    assert all(theirs[1][n] == ours[1][n] for n in ours[1])
    for outtype in ("f32", "q8_0"):
        oracle = oracle_checkpoint(tmp_path / f"{outtype}.gguf", tmp_path / "hf", tmp_path / f"oracle-{outtype}")
        reference = AutoModelForCausalLM.from_pretrained(oracle).float().eval()
        assert_matches(LLM(str(tmp_path / f"{outtype}.gguf"), dtype="float32"), reference, f"{name} {outtype}")
