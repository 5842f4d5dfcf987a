"""Checkpoints load from HF's layout (single file or sharded), and bad ones fail with named tensors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.loader import CheckpointError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def checkpoint(tmp_path, tiny_checkpoint):
    source, _ = tiny_checkpoint("bamba")
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint, tiny_checkpoint):
    expected = LLM(checkpoint, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for filename, shard in halves.items():
        save_file({n: tensors[n] for n in shard}, checkpoint / filename, metadata={"format": "pt"})
    (checkpoint / "model.safetensors").unlink()
    weight_map = {n: f for f, shard in halves.items() for n in shard}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = LLM(checkpoint, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    assert sharded[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_missing_shard(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        LLM(checkpoint)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights in .*: expected \*.safetensors \(or pytorch_model.bin\)"):
        LLM(checkpoint)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(checkpoint)


def test_pytorch_model_bin_loads_like_safetensors(checkpoint):
    expected = LLM(checkpoint, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    torch.save(load_file(checkpoint / "model.safetensors"), checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()
    loaded = LLM(checkpoint, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    assert loaded[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_rotary_inv_freq_tensors_are_skipped_as_hf_and_vllm_do(tmp_path, tiny_checkpoint):
    llama = tmp_path / "llama"
    shutil.copytree(tiny_checkpoint("llama")[0], llama)
    expected = LLM(llama, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    # Older Llama checkpoints saved the rotary buffer of every layer, with garbage-looking values.
    rewrite(llama, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.full((8,), 7.0)
                                       for i in range(2)}))
    loaded = LLM(llama, dtype="float32").generate(["The page"], GREEDY, use_tqdm=False)
    assert loaded[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_shape_mismatch_names_the_tensor(checkpoint):
    rewrite(checkpoint, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:, :10].contiguous()}))
    with pytest.raises(CheckpointError, match=r"lm_head.weight: the checkpoint has shape \(320, 10\)"):
        LLM(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("model.layers.0.mamba.A_log"))
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model.layers.0.mamba.A_log"):
        LLM(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    rewrite(checkpoint, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensors in the checkpoint: model.layers.9.extra.weight"):
        LLM(checkpoint)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_stays_close(checkpoint, dtype):
    reference = LLM(checkpoint, dtype="float32")
    half = LLM(checkpoint, dtype=dtype)
    assert next(half.engine.runner.model.parameters()).dtype == getattr(torch, dtype)
    ids = reference.get_tokenizer().encode("The page pool holds attention blocks")
    logits = []
    for llm in (reference, half):
        llm.engine.add_request({"prompt_token_ids": ids}, GREEDY)
        logits.append(llm.engine.runner.execute(llm.engine.scheduler.schedule())[1][0])
    # The same distribution to within half-precision rounding over a few layers.
    assert (logits[0] - logits[1]).abs().max() < 0.1 * logits[0].abs().max()
    assert logits[0].argmax() == logits[1].argmax()


def test_a_module_that_caches_other_shapes_than_the_declaration_is_refused(checkpoint):
    import dataclasses

    import torch

    from runtime.cache.pool import allocate_pool, bind_pool
    from runtime.cache.spec import MambaSpec
    from runtime.config import EngineConfig
    from runtime.loader import build_model

    config = EngineConfig(str(checkpoint), dtype="float32")
    model = build_model(config, torch.device("cpu"))
    layout = config.cache
    conv, ssm = layout.mamba.shapes
    wrong = dataclasses.replace(layout, mamba=MambaSpec(((conv[0], conv[1] + 8), ssm), layout.mamba.dtypes,
                                                        layout.mamba.page_size_padded))
    with pytest.raises(ValueError, match="the declaration and the implementation disagree"):
        bind_pool(model, allocate_pool(wrong, 4, torch.device("cpu")), wrong)


def test_plain_reads_give_what_safetensors_gives(tmp_path):
    # The loader reads whole tensors with file reads, not through safetensors' memory map (whose pages would count
    # in the process's memory until the file closes): every dtype and shape must come out as safetensors' own.
    from safetensors import safe_open

    from runtime.loader import read_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, 2, generator=g).bfloat16(),
        "f16": torch.randn(4, generator=g).half(), "f8": torch.randn(2, 3, generator=g).to(torch.float8_e4m3fn),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "i64": torch.randint(0, 1000, (2, 2), generator=g), "bool": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    read = {name: load() for name, load, _ in read_tensors(path)}
    with safe_open(path, framework="pt") as f:
        for name in tensors:
            expected = f.get_tensor(name)
            assert read[name].dtype == expected.dtype and read[name].shape == expected.shape, name
            assert torch.equal(read[name].reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name

