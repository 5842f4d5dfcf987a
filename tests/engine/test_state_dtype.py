"""The SSM state dtype: config.json's mamba_ssm_cache_dtype is honoured, the option overrides it, and a
bfloat16 model runs on a float32 state."""

import json
import shutil

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.layers.mamba2 import Mamba2Mixer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def bamba(tmp_path, tiny_checkpoint):
    target = tmp_path / "bamba"
    shutil.copytree(tiny_checkpoint("bamba")[0], target)
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, "mamba_ssm_cache_dtype": "float32"}))
    return target


def test_config_json_asks_and_the_option_overrides(bamba):
    asked = EngineConfig(str(bamba), dtype="bfloat16")
    assert asked.state_dtype.dtype == "float32"
    assert asked.state_dtype.reason == "asked for by mamba_ssm_cache_dtype in config.json"
    assert asked.cache.mamba.dtypes == ("bfloat16", "float32")
    overridden = EngineConfig(str(bamba), dtype="bfloat16", mamba_ssm_dtype="bfloat16")
    assert overridden.state_dtype.reason == "set by --mamba-ssm-dtype / mamba_ssm_dtype"
    assert overridden.cache.mamba.dtypes == ("bfloat16", "bfloat16")
    assert overridden.cache.page_size_bytes < asked.cache.page_size_bytes


def test_an_unknown_state_dtype_in_config_json_is_a_one_line_error(bamba):
    raw = json.loads((bamba / "config.json").read_text())
    (bamba / "config.json").write_text(json.dumps({**raw, "mamba_ssm_cache_dtype": "int4"}))
    with pytest.raises(ValueError, match="unknown mamba_ssm_cache_dtype in config.json 'int4'"):
        EngineConfig(str(bamba))


def test_a_bfloat16_model_generates_on_the_float32_state_config_json_asks_for(bamba):
    llm = LLM(bamba, dtype="bfloat16")
    mixers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(m.ssm_states.dtype == torch.float32 for m in mixers)
    assert all(m.conv_states.dtype == torch.bfloat16 for m in mixers)
    out = llm.generate(["The page pool holds"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
