"""GGUF files of the recurrent and hybrid families (mamba, mamba2, nemotron_h_moe, falcon-h1, lfm2, qwen3next), written
as llama.cpp's
converter writes them (tests/gguf_family_files.py), run in float32 against transformers on the checkpoint the file
stands for (its tensors dequantized by gguf.quants.dequantize, the converter's changes undone)."""

from __future__ import annotations

import gguf
import pytest
from gguf import GGMLQuantizationType as T
from gguf_family_files import oracle_checkpoint, write_family_gguf
from gguf_files import q4_k_m
from test_gguf import GREEDY, PROMPTS, assert_matches
from tiny_models import CONFIGS, DELTANET_CONFIGS, FAMILY_CONFIGS, build_deltanet_model, build_family_model, build_model
from transformers import AutoModelForCausalLM

from runtime import LLM
from runtime.gguf.config import raw_config
from runtime.layers.quantized import QuantLinear

# Every linear's input 256 wide for the K-quants (Mamba-2: 16 heads of 32 = twice the width); half the
# initializer range keeps the activations at the tiny models' scale (see test_gguf.py's WIDE).
WIDE = {"mamba2": dict(hidden_size=256, num_heads=16, head_dim=32, initializer_range=0.15)}
# llama.cpp's converter maps no dense-MLP block of Qwen3-Next (mlp_only_layers): published ones have none.
OVERRIDES = {"qwen3_next": dict(mlp_only_layers=[])}
CASES = [("mamba", "F32"), ("mamba", "Q8_0"), ("qwen3_next", "F32"), ("qwen3_next", "Q8_0"), ("qwen3_next", "Q4_0"),
         ("mamba2", "F32"), ("mamba2", "Q8_0"), ("mamba2", "Q4_0"), ("mamba2", "Q4_K_M"),
         ("nemotron_h", "F32"), ("nemotron_h", "Q8_0"),
         ("falcon_h1", "F32"), ("falcon_h1", "Q8_0"), ("falcon_h1_rms_norm", "Q8_0"),
         ("lfm2", "F32"), ("lfm2", "Q8_0")]
GGUF_ARCH = {"mamba": "mamba", "qwen3_next": "qwen3next", "mamba2": "mamba2", "nemotron_h": "nemotron_h_moe", "falcon_h1": "falcon-h1",
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
            build = build_model if name in CONFIGS else build_family_model if name in FAMILY_CONFIGS else \
                build_deltanet_model
            overrides = {**OVERRIDES.get(name, {}), **(WIDE.get(name, {}) if kind == "Q4_K_M" else {})}
            build(name, root / "hf", tokenizer_dir, **overrides)
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
    if kind == "F32":
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


def tiny_architecture(name: str) -> str:
    return (CONFIGS.get(name) or FAMILY_CONFIGS.get(name) or DELTANET_CONFIGS[name])[1]
