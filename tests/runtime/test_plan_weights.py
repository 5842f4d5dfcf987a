"""`tandem plan`'s weight bytes per format (model dtype, int8, int4), from the config alone: equal to the bytes
of the real model loaded and quantized (runtime.layers.quantized.weight_bytes), and to a hand count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.layers.quantized import quantize_linears, weight_bytes
from runtime.loader import build_model
from runtime.weight_bytes import model_weight_bytes

FIXTURES = Path(__file__).parents[2] / "docs" / "configs"


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *args], capture_output=True, text=True)


# Dense attention, MoE (StackedLinear experts, a router kept), tied embeddings without experts, Mamba-2 alone.
@pytest.mark.parametrize("name", ["llama", "granitemoehybrid", "granitemoehybrid-dense-nope", "mamba2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_equal_the_loaded_quantized_model(tiny_checkpoint, name, dtype):
    directory, _ = tiny_checkpoint(name)
    config = EngineConfig(model=str(directory), dtype=dtype)
    planned = model_weight_bytes(config)
    for scheme in (None, "int8", "int4"):
        model = build_model(config, torch.device("cpu"))
        if scheme:
            assert quantize_linears(model, scheme) > 0
        assert planned[scheme] == weight_bytes(model), (name, dtype, scheme)
    assert planned["int4"] < planned["int8"] < planned[None]


# Llama 3.2 1B in bfloat16, by hand. Per layer the linears hold 2048x2048 (q, o), 512x2048 (k, v), 8192x2048
# (gate, up), 2048x8192 (down): 60,817,408 weights in 23,552 rows; 16 layers: 973,078,528 in 376,832 rows.
# The rest: embedding 128,256 x 2048 (tied: once) + 33 norms x 2048, x 2 B, + rotary inv_freq 32 x 4 B.
REST = (128_256 * 2048 + 33 * 2048) * 2 + 32 * 4
LINEARS, ROWS = 973_078_528, 376_832
# int4: a scale per 128 inputs: (q, k, v, o, gate, up rows) x 16 groups + down's 2048 rows x 64, per layer.
INT4_GROUPS = 16 * ((2048 + 512 + 512 + 2048 + 8192 + 8192) * 16 + 2048 * 64)
LLAMA_1B = {"bfloat16": REST + LINEARS * 2, "int8": REST + LINEARS + ROWS * 4,
            "int4": REST + LINEARS // 2 + INT4_GROUPS * 4}


def test_plan_prints_each_formats_bytes_and_with_the_pool():
    fixture = str(FIXTURES / "meta-llama__Llama-3.2-1B")
    report = plan(fixture, "--dtype", "bfloat16", "--quantization", "int4", "--kv-cache-memory", "1GiB",
                  "--max-model-len", "4096", "--json")
    assert report.returncode == 0, report.stderr
    weights = json.loads(report.stdout)["weight_bytes"]
    assert weights["bytes"] == LLAMA_1B and weights["quantization"] == "int4"
    assert weights["with_pool_bytes"] == {name: size + 2**30 for name, size in LLAMA_1B.items()}
    text = plan(fixture, "--dtype", "bfloat16", "--quantization", "int4").stdout
    assert f"  * int4       {LLAMA_1B['int4']:,} B (994.13 MiB)" in text
    assert f"    int8       {LLAMA_1B['int8']:,} B" in text
    # Only --quantization asks for them (building a large MoE, even on the meta device, takes a minute).
    pooled = plan(fixture, "--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--max-model-len", "4096").stdout
    assert "weights" not in pooled
