"""A quantized run's memory (issue 33): quantizing on the fly never holds the float model beside the quantized one.
Each linear is quantized as soon as the checkpoint has filled it and its float weights are handed back; the
checkpoint is read with file reads, not through a memory map whose pages would count in the process's memory.
Measured in a fresh process on a ~130M-parameter bfloat16 checkpoint (260 MB): its peak grows by less than 0.9
of the file's size while it loads and runs int8 or int4 (before: the float weights, the mapped file and the
quantized ones, 2-3.3x)."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from tiny_models import VOCAB_SIZE

CHILD = """
import sys
import runtime
from runtime import LLM, SamplingParams
import psutil


def high_water():  # not getrusage's ru_maxrss: that one keeps the forking parent's size across exec
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


before = psutil.Process().memory_info().rss
llm = LLM(sys.argv[1], dtype="bfloat16", quantization=sys.argv[2], max_model_len=128, max_num_seqs=1)
llm.generate(["The page pool"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(high_water() - before)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp("llama-100m")
    config = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_load_never_holds_the_float_model(checkpoint, scheme):
    file_bytes = (checkpoint / "model.safetensors").stat().st_size
    result = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), scheme], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    grown = int(result.stdout.split()[-1])
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"
    assert grown < 0.9 * file_bytes, f"peak grew by {grown / 2**20:.0f} MiB for a {file_bytes / 2**20:.0f} MiB file"
