"""`tandem plan --speculative-config`: what each proposer holds besides the model, from config.json alone.

MTP: the head's weights and the K/V its attention keeps per token, equal to the head the engine loads (its
parameters, and what its cache grows by per position), with the layer count and the dedicated embedding
read from Qwen3.5's config keys; no prompt-lookup keys. A draft model: its weights, equal to the draft model
the engine builds. Both in the text and the JSON of the command.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_deltanet_model

from runtime import LLM
from runtime.cli import main
from runtime.config import EngineConfig
from runtime.layers.quantized import weight_bytes
from runtime.loader import build_model
from runtime.plan import build_report, format_report
from runtime.spec_decode.draft import draft_engine_config

QWEN3_NEXT_80B = "docs/configs/Qwen__Qwen3-Next-80B-A3B-Thinking"
MTP = {"method": "mtp", "num_speculative_tokens": 2}
ATTENTION_LAYER = {"qwen3_next": 1, "qwen3_5": 1}  # tests/tiny_models.py: an attention layer of each


def write_mtp_head(directory, attention_layer: int, num_layers: int = 1, dedicated: bool = False,
                   configured: bool = False) -> None:
    """`mtp.*` tensors of `num_layers` decoder layers (copies of the model's attention layer, its MLP or experts
    included), random fc and norms, and with `dedicated` an embedding of the head's own; with `configured`,
    Qwen3.5's config keys name both."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(0)
    embedding = tensors["model.embed_tokens.weight"]
    hidden = embedding.shape[1]
    source = f"model.layers.{attention_layer}."
    for index in range(num_layers):
        for name, tensor in list(tensors.items()):
            if name.startswith(source):
                tensors[f"mtp.layers.{index}.{name[len(source):]}"] = tensor.clone()
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.3 * torch.randn(hidden, generator=generator)
    if dedicated:
        tensors["mtp.embed_tokens.weight"] = embedding.clone()
    save_file(tensors, path, metadata={"format": "pt"})
    if configured:
        config = json.loads((directory / "config.json").read_text())
        config.update(mtp_num_hidden_layers=num_layers, mtp_use_dedicated_embeddings=dedicated)
        (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name, num_layers, dedicated, configured", [
    ("qwen3_next", 1, False, False),  # experts in the head's layer; no config key: one layer assumed
    ("qwen3_5", 2, True, True),  # a dense MLP, two layers and an embedding of its own, named by the config
])
def test_mtp_plan_equals_the_head_the_engine_loads(tmp_path, tokenizer_dir, name, num_layers, dedicated, configured):
    build_deltanet_model(name, tmp_path, tokenizer_dir)
    write_mtp_head(tmp_path, ATTENTION_LAYER[name], num_layers, dedicated, configured)
    config = EngineConfig(str(tmp_path), dtype="float32", max_model_len=64, speculative_config=MTP)
    report = build_report(config, None, None)["speculative"]
    assert "prompt_lookup_min" not in report and "draft" not in report
    head = report["mtp"]
    assert (head["num_layers"], head["dedicated_embedding"]) == (num_layers, dedicated)
    assert head["num_layers_from"] == ("config" if configured else "assumed")

    speculator = LLM(tmp_path, dtype="float32", max_model_len=64, speculative_config=MTP).engine.speculator
    assert head["weight_bytes"] == weight_bytes(speculator.head)
    from runtime.models.qwen3_next.mtp import HeadKV

    kv, positions = HeadKV(), 5
    hidden = torch.randn(positions, config.dims.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        speculator._run(torch.arange(3, 3 + positions), hidden, torch.arange(positions), kv, 0)
    assert head["kv_bytes_per_token"] * positions == kv.k[:positions].nbytes + kv.v[:positions].nbytes
    assert head["kv_bytes_per_sequence"] == 64 * head["kv_bytes_per_token"]

    printed = format_report(build_report(config, None, None))
    assert "n-grams" not in printed
    assert f"weights {head['weight_bytes']:,} B" in printed
    assert f"{head['kv_bytes_per_token']:,} B per token" in printed


def test_mtp_plan_of_qwen3_next_80b(capsys):
    """From the published config: one layer of 16 query heads (gated: q_proj 2 x 16 x 256) and 2 KV heads of
    256 over a hidden size of 2048, 512 experts of 512 and a shared expert of 512 with its gate, fc from 4096."""
    attention = 2048 * 8192 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 256
    experts = 512 * 3 * 2048 * 512 + 512 * 2048  # the experts and the router
    shared = 3 * 2048 * 512 + 2048  # the shared expert and its gate
    rest = 2 * 2048 + 4096 * 2048 + 3 * 2048  # the layer's two norms, fc, the head's three norms
    weights = 2 * (attention + experts + shared + rest)  # bfloat16
    per_token = 2 * 2 * 256 * 2  # K and V, 2 heads x 256, bfloat16
    args = ["plan", QWEN3_NEXT_80B, "--speculative-config", json.dumps(MTP), "--kv-cache-memory", "8GiB",
            "--max-model-len", "4096"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    head = report["speculative"]["mtp"]
    assert "prompt_lookup_min" not in report["speculative"]
    assert head["weight_bytes"] == weights
    assert head["kv_bytes_per_token"] == per_token
    assert head["kv_bytes_per_sequence"] == 4096 * per_token
    sequences = min(report["fit"]["max_num_sequences"], 256)  # and max_num_seqs, 256 by default
    assert head["kv_bytes"] == sequences * 4096 * per_token
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "mtp head     1 decoder layer (assumed: config.json names none" in printed
    assert f"weights {weights:,} B (3.07 GiB) in bfloat16, besides the model's" in printed
    assert "head K/V     its own, outside the page pool: 2 KV heads x 256, bfloat16: 2,048 B per token" in printed
    assert f"the {sequences} sequences that fit and run at once: {sequences * 4096 * per_token:,} B" in printed
    assert "n-grams" not in printed


def test_mtp_plan_of_an_architecture_without_heads_exits_2(capsys):
    args = ["plan", "docs/configs/meta-llama__Llama-3.2-1B", "--speculative-config", json.dumps(MTP)]
    assert main(args) == 2
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and "LlamaForCausalLM has none" in stderr[0]


def test_draft_plan_weights_equal_the_draft_model_the_engine_builds(tiny_checkpoint):
    """As the model's own weight bytes (test_plan_weights.py): the modules as built and loaded, before a CPU
    runner adds its packed copies of the linears."""
    target, draft = tiny_checkpoint("bamba")[0], tiny_checkpoint("llama")[0]
    spec = {"model": str(draft), "num_speculative_tokens": 2}
    config = EngineConfig(str(target), dtype="float32", max_model_len=64, speculative_config=spec)
    report = build_report(config, None, None)
    assert "prompt_lookup_min" not in report["speculative"] and "mtp" not in report["speculative"]
    planned = report["speculative"]["draft"]["weight_bytes"]
    assert planned == weight_bytes(build_model(draft_engine_config(config), torch.device("cpu")))
    assert f"  draft        weights {planned:,} B" in format_report(report)
