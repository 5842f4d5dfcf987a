"""Weight layouts other than the one save_pretrained writes load into the same model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy

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


def hf_tokens(directory, hf):
    ids = LLM(directory, dtype="float32").get_tokenizer().encode(PROMPT)
    return hf_greedy(hf, ids, GREEDY.max_tokens)


def to_mamba_ssm_format(directory, config):
    """What mamba_ssm's save_pretrained writes: its own config.json and a pytorch_model.bin."""
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    tensors = {name.replace("backbone.embeddings.", "backbone.embedding."): t for name, t in tensors.items()}
    if config["tie_embeddings"]:
        tensors["lm_head.weight"] = tensors["backbone.embedding.weight"]
    torch.save(tensors, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def test_a_mamba2_checkpoint_in_mamba_ssm_format_generates_hf_tokens(tmp_path, tiny_checkpoint):
    directory = copy_of(tmp_path, tiny_checkpoint, "mamba2")
    to_mamba_ssm_format(directory, {
        "d_model": 64, "d_intermediate": 0, "n_layer": 2, "vocab_size": 320, "rms_norm": True,
        "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": False,
        "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2, "chunk_size": 16},
        "attn_layer_idx": [], "attn_cfg": {},
    })
    assert tokens(directory) == hf_tokens(directory, tiny_checkpoint("mamba2")[1])


def test_a_mamba1_checkpoint_in_mamba_ssm_format_generates_hf_tokens(tmp_path, tiny_checkpoint):
    directory = copy_of(tmp_path, tiny_checkpoint, "mamba")
    to_mamba_ssm_format(directory, {
        "d_model": 64, "n_layer": 2, "vocab_size": 320, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True,
        "ssm_cfg": {"d_state": 16, "dt_rank": 8},
    })
    assert tokens(directory) == hf_tokens(directory, tiny_checkpoint("mamba")[1])


# transformers 4.48 renamed Zyphra's keys; checkpoints published before then still carry the old ones.
PRE_4_48_ZAMBA2_KEYS = {
    "mamba_d_state": "state_size",
    "mamba_d_conv": "conv_dimension",
    "mamba_expand": "expansion_factor",
    "intermediate_size": "ffn_hidden_size",
    "adapter_rank": "lora_rank",
    "use_shared_attention_adapter": "use_shared_attention_lora",
}


def test_a_pre_4_48_zamba2_checkpoint_generates_hf_tokens(zamba2, tiny_checkpoint):
    config = json.loads((zamba2 / "config.json").read_text())
    legacy = {PRE_4_48_ZAMBA2_KEYS.get(key, key): value for key, value in config.items()}
    legacy["mamba_headdim"] = config["mamba_expand"] * config["hidden_size"] // legacy.pop("n_mamba_heads")
    letters = {"mamba": "m", "linear_attention": "m", "hybrid": "g"}
    legacy["layers_block_type"] = [letters[t] for t in config["layers_block_type"]]
    for derived in ("hybrid_layer_ids", "attention_hidden_size", "attention_head_dim"):
        legacy.pop(derived, None)
    (zamba2 / "config.json").write_text(json.dumps(legacy))
    assert tokens(zamba2) == hf_tokens(zamba2, tiny_checkpoint("zamba2")[1])
