"""Weight layouts other than the one save_pretrained writes load into the same model."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.loader import CheckpointError

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


@pytest.fixture
def zamba2(tmp_path, tiny_checkpoint):
    return copy_of(tmp_path, tiny_checkpoint, "zamba2")


def test_zamba2_loads_a_shared_block_repeated_under_every_hybrid_layer(zamba2):
    expected = tokens(zamba2)

    def repeat(tensors):
        # Hybrid layers 1 and 4 apply block 0, layer 3 applies block 1; save_pretrained wrote 1 and 3 only.
        block0 = {n: t for n, t in tensors.items() if n.startswith("model.layers.1.shared_transformer.")}
        tensors.update({n.replace("layers.1.", "layers.4.", 1): t.clone() for n, t in block0.items()})
        return tensors

    rewrite(zamba2, repeat)
    assert tokens(zamba2) == expected


def test_zamba2_without_its_shared_block_names_the_missing_tensors(zamba2):
    rewrite(zamba2, lambda t: {n: v for n, v in t.items() if ".layers.3.shared_transformer." not in n})
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model.layers.3.shared_transformer"):
        LLM(zamba2)
