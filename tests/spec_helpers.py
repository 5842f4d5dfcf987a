"""Shared by the speculative decoding tests (n-gram, draft model, MTP): stepping an engine while watching what
each step holds, the comparison of outputs with a reference, the counters' check that drafts were both accepted
and rejected, and the checkpoints they build: a perturbed copy of a model (a draft model) and `mtp.*` heads
written into a Qwen3-Next/Qwen3.5 one."""

import json
import shutil

import torch
from safetensors.torch import load_file, save_file


def run_watching_steps(llm, prompts, params):
    """Generate step by step; return the outputs and whether a step mixed a verify, a plain decode and a
    prefill chunk. Proposing ahead of the engine shows what its step will hold: every method's proposals are
    a pure function of the tokens (an MTP head's of its cache, whose entries for the drafts are dropped again)."""
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    done, mixed = {}, False
    while engine.has_unfinished():
        running = engine.scheduler.running
        engine.speculator.propose(running)
        drafted = any(s.spec_token_ids for s in running)
        plain = any(not s.spec_token_ids and s.num_computed_tokens >= len(s.prompt_token_ids) for s in running)
        prefill = any(s.num_computed_tokens < len(s.prompt_token_ids) for s in running) or engine.scheduler.waiting
        mixed |= drafted and plain and bool(prefill)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids], mixed


def assert_same_outputs(outputs, reference):
    """Each request's tokens equal the reference's, and its logprobs (the same top tokens) within 1e-4."""
    for got, want in zip(outputs, reference):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def assert_drafts_accepted_and_rejected(llm):
    counters = llm.engine.speculator.counters
    assert counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


def perturbed_copy(source, destination, scale=0.05):
    """`source` with every weight tensor moved by `scale` of its standard deviation (seeded)."""
    shutil.copytree(source, destination)
    generator = torch.Generator().manual_seed(0)
    for path in destination.glob("*.safetensors"):
        weights = load_file(path)
        for name, w in weights.items():
            if w.is_floating_point() and w.numel() > 1:
                weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=generator, dtype=w.dtype)
        save_file(weights, path, metadata={"format": "pt"})
    return destination


def add_mtp_head(directory, attention_layer: int, scale: float = 0.05, seed: int = 0, echo: float = 0.0):
    """Write `mtp.*` into the checkpoint: the head described at the top of tests/spec_decode/test_spec_mtp.py."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    if echo:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.embed_tokens.weight"] *= echo
    generator = torch.Generator().manual_seed(seed)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    source = f"model.layers.{attention_layer}."
    for name, tensor in list(tensors.items()):
        if name.startswith(source):
            copy = tensor.clone()
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                copy *= scale
            tensors["mtp.layers.0." + name[len(source):]] = copy
    tensors["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    tensors["mtp.pre_fc_norm_embedding.weight"] = 0.3 * torch.randn(hidden, generator=generator)
    tensors["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    tensors["mtp.norm.weight"] = torch.zeros(hidden)
    save_file(tensors, path, metadata={"format": "pt"})


# name -> an attention layer of the tiny model (tests/tiny_models.py), whose MLP matches the head's, and
# the echo: embeddings scaled by it and the LM head set to them, so that the target repeats its last token
# some of the time (a draft holds) and not at other times (it is rejected).
ATTENTION_LAYER = {"qwen3_next": (1, 12.0), "qwen3_5": (1, 20.0), "qwen3_5_moe": (3, 12.0)}


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8_blocks(directory, block: int = 32) -> list[str]:
    """Rewrite the checkpoint as Qwen3-Next's FP8 release is written (`quant_method: fp8`, e4m3 weights with a
    float32 `weight_scale_inv` per block x block, scale = max|w| / 448): every 2-D weight of the decoder layers
    and of the MTP head's (`mtp.fc` and `mtp.layers.*`), routers and gates excepted. Returns the names
    quantized."""
    path = directory / "model.safetensors"
    tensors, quantized = load_file(path), []
    for name in sorted(tensors):
        w = tensors[name]
        linear = name.endswith(".weight") and w.dim() == 2 and (".layers." in name or name.startswith("mtp.fc"))
        if not linear or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "norm.weight")):
            continue
        n, k = w.shape
        padded = torch.zeros(-(-n // block) * block, -(-k // block) * block)
        padded[:n, :k] = w.float()
        tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
        scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:n, :k].contiguous()
        tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scale
        quantized.append(name)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [block, block]}
    (directory / "config.json").write_text(json.dumps(config))
    return quantized
