"""Bad input to `tandem plan`: one line on stderr that names the problem, and exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[2] / "docs" / "configs"
BAMBA = FIXTURES / "ibm-ai-platform__Bamba-9B" / "config.json"


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *args], capture_output=True, text=True)


def write_config(tmp_path: Path, text: str) -> Path:
    (tmp_path / "config.json").write_text(text)
    return tmp_path


def bamba_with(tmp_path: Path, **changes) -> Path:
    raw = json.loads(BAMBA.read_text())
    raw.update(changes)
    return write_config(tmp_path, json.dumps(raw))


def assert_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_file(tmp_path):
    assert_error(plan(str(tmp_path / "nowhere")), "no config.json", "nowhere")


def test_malformed_json(tmp_path):
    broken = write_config(tmp_path, '{"architectures": ["BambaForCausalLM"],')
    assert_error(plan(str(broken)), "not valid JSON", "line 1")


def test_not_an_object(tmp_path):
    assert_error(plan(str(write_config(tmp_path, "[1, 2]"))), "JSON object")


def test_unknown_architecture(tmp_path):
    result = plan(str(write_config(tmp_path, '{"architectures": ["GPT2LMHeadModel"]}')))
    assert_error(result, "unknown architecture 'GPT2LMHeadModel'", "BambaForCausalLM", "LlamaForCausalLM")


def test_missing_architectures(tmp_path):
    assert_error(plan(str(write_config(tmp_path, '{"hidden_size": 64}'))), "architectures")


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"mamba_d_head": 32}, "does not equal the Mamba inner size"),
        ({"attn_layer_indices": [9, 40]}, "attn_layer_indices names layers [40]"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"mamba_n_groups": 3}, "Mamba groups do not divide 128 heads"),
    ],
)
def test_inconsistent_config(tmp_path, changes, fragment):
    assert_error(plan(str(bamba_with(tmp_path, **changes))), fragment)


def test_nemotron_pattern_with_unknown_layer(tmp_path):
    raw = json.loads((FIXTURES / "nvidia__Nemotron-H-8B-Base-8K" / "config.json").read_text())
    raw["hybrid_override_pattern"] = "M-X*"
    assert_error(plan(str(write_config(tmp_path, json.dumps(raw)))), "unknown characters ['X']")


def test_block_size_too_small():
    result = plan(str(BAMBA), "--dtype", "bfloat16", "--block-size", "512")
    assert_error(result, "--block-size 512 is invalid", "smallest valid value is 528")


def test_block_size_unaligned():
    assert_error(plan(str(BAMBA), "--dtype", "bfloat16", "--block-size", "530"), "multiple of 16", "528")


def test_block_size_unaligned_with_prefix_caching():
    result = plan(str(BAMBA), "--dtype", "bfloat16", "--enable-prefix-caching", "--block-size", "528")
    assert_error(result, "multiple of 256", "smallest valid value is 768")


def test_attention_only_block_must_be_aligned():
    assert_error(plan(str(FIXTURES / "meta-llama__Llama-3.2-1B"), "--block-size", "20"), "multiple of 16")


def test_tp_that_does_not_divide_heads():
    assert_error(plan(str(BAMBA), "--tp", "3"), "not divisible by --tensor-parallel-size 3", "128")


def test_tp_that_does_not_divide_groups():
    nemotron = FIXTURES / "nvidia__Nemotron-H-8B-Base-8K"
    assert_error(plan(str(nemotron), "--tp", "16"), "n_groups=8", "not divisible by --tensor-parallel-size 16")


def test_unknown_dtype():
    assert_error(plan(str(BAMBA), "--dtype", "int3"), "unknown dtype 'int3'")


def test_memory_needs_max_model_len():
    assert_error(plan(str(BAMBA), "--memory", "8GiB"), "--kv-cache-memory and --max-model-len go together")


def test_mamba_ssm_hybrid_config_is_refused(tmp_path):
    raw = json.loads((FIXTURES / "state-spaces__mamba2-130m" / "config.json").read_text())
    raw["attn_layer_idx"] = [3]
    assert_error(plan(str(write_config(tmp_path, json.dumps(raw)))), "mamba_ssm hybrid config")


def test_bad_memory_size():
    result = plan(str(BAMBA), "--memory", "lots", "--max-model-len", "10")
    assert result.returncode == 2 and "invalid size 'lots'" in result.stderr
