"""Weight layouts other than the one save_pretrained writes load into the same model."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The page pool holds attention blocks"


def copy_of(tmp_path, tiny_checkpoint, name):
    target = tmp_path / name
    shutil.copytree(tiny_checkpoint(name)[0], target)
    return target


def rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    tensors = change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def tokens(directory):
    return LLM(directory, dtype="float32").generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def nemotron(tmp_path, tiny_checkpoint):
    return copy_of(tmp_path, tiny_checkpoint, "nemotron_h")


def test_nemotron_h_loads_transformers_in_memory_names_and_skips_mtp_layers(nemotron):
    expected = tokens(nemotron)

    def respell(tensors):
        tensors = {name.replace("backbone.", "model.", 1): t for name, t in tensors.items()}
        tensors["mtp.layers.0.norm.weight"] = torch.ones(64)
        return tensors

    rewrite(nemotron, respell)
    assert tokens(nemotron) == expected
