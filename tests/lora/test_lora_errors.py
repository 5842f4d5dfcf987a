"""Bad adapters are refused with one ValueError naming the adapter (and the module), before anything is queued or
loaded; the engine goes on serving the base model and good adapters as before."""

import json
import shutil

import pytest
from lora_helpers import build_checkpoint, linear_names, make_adapter, targets
from safetensors.torch import load_file, save_file

from runtime import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp("llama")
    hf = build_checkpoint("llama", directory, tokenizer_dir)
    good = tmp_path_factory.mktemp("good")
    make_adapter(hf, good, seed=0, r=4, lora_alpha=8, target_modules=targets(linear_names(hf)))
    llm = LLM(directory, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)
    return llm, LoRARequest("good", 1, str(good)), tmp_path_factory


def variant(tmp_path_factory, good: LoRARequest, name: str, edit=None, config=None) -> LoRARequest:
    """A copy of the good adapter under `name`, with its tensors edited by `edit` and its config updated."""
    path = tmp_path_factory.mktemp(name)
    shutil.copytree(good.lora_path, path, dirs_exist_ok=True)
    if edit is not None:
        tensors = load_file(path / "adapter_model.safetensors")
        save_file(edit(tensors), path / "adapter_model.safetensors")
    if config is not None:
        settings = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return LoRARequest(name, 7, str(path))


def renamed(tensors):
    return {key.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"): t for key, t in tensors.items()}


def wider(tensors):
    return {key: t.repeat(1, 2) if "down_proj.lora_A" in key else t for key, t in tensors.items()}


def higher_rank(tensors):
    return {key: (t.repeat(2, 1) if "lora_A" in key else t.repeat(1, 2)) for key, t in tensors.items()}


def dora(tensors):
    key = next(iter(tensors)).replace("lora_A.weight", "lora_magnitude_vector")
    return {**tensors, key: next(iter(tensors.values()))[0].clone()}


CASES = [
    ("missing", lambda tmp, good: LoRARequest("missing", 7, str(tmp.getbasetemp() / "nowhere")), "no such directory"),
    ("no-config", lambda tmp, good: _without(tmp, good, "adapter_config.json"), "no adapter_config.json"),
    ("no-weights", lambda tmp, good: _without(tmp, good, "adapter_model.safetensors"), "no adapter_model.safetensors"),
    ("bad-json", lambda tmp, good: _broken_json(tmp, good), "not valid JSON"),
    ("unknown-module", lambda tmp, good: variant(tmp, good, "unknown-module", renamed),
     "target module model.layers.0.self_attn.qq_proj"),
    ("other-base", lambda tmp, good: variant(tmp, good, "other-base", wider),
     "model.layers.0.mlp.down_proj: shapes (4, 192) and (64, 4) do not fit"),
    ("rank", lambda tmp, good: variant(tmp, good, "rank", higher_rank), "rank 8 is more than max_lora_rank=4"),
    ("dora", lambda tmp, good: variant(tmp, good, "dora", config={"use_dora": True}),
     "DoRA (use_dora) is not supported"),
    ("dora-tensor", lambda tmp, good: variant(tmp, good, "dora-tensor", dora), "DoRA (lora_magnitude_vector)"),
    ("not-lora", lambda tmp, good: variant(tmp, good, "not-lora", config={"peft_type": "IA3"}), "peft_type 'IA3'"),
]


def _without(tmp, good, filename):
    request = variant(tmp, good, f"without-{filename}")
    (tmp.getbasetemp() / request.lora_path / filename).unlink()
    return request


def _broken_json(tmp, good):
    request = variant(tmp, good, "bad-json")
    (tmp.getbasetemp() / request.lora_path / "adapter_config.json").write_text("{not json")
    return request


@pytest.mark.parametrize("name, make, message", CASES, ids=[case[0] for case in CASES])
def test_a_bad_adapter_is_refused_by_name_and_nothing_is_loaded(llama, name, make, message):
    llm, good, tmp = llama
    before = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[None, good])
    bad = make(tmp, good)
    with pytest.raises(ValueError, match=f"LoRA adapter '{bad.lora_name}'") as err:
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[good, bad])
    assert message in str(err.value) and "\n" not in str(err.value)
    manager = llm.engine.runner.lora
    assert 7 not in manager.cpu and all(r.lora_int_id != 7 for r in manager.slots)
    assert not llm.engine.has_unfinished()  # the good request of the refused call was not queued either
    after = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[None, good])
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_expert_projections_are_refused_by_name(llama):
    llm, good, tmp = llama
    bad = variant(tmp, good, "experts", lambda t: {k.replace("mlp.down_proj", "mlp.experts.0.down_proj"): v
                                                  for k, v in t.items()})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.0.down_proj: expert projections are not"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=bad)


def test_an_adapter_without_enable_lora_is_refused(llama):
    _, good, _ = llama
    base = LLM(llama[0].engine.config.model_dir, dtype="float32")
    with pytest.raises(ValueError, match="started without LoRA; pass enable_lora=True"):
        base.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=good)


def test_lora_request_ids_are_positive():
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("zero", 0, "/tmp")
