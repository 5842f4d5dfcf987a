"""Declarations are validated when the registry loads them; a bad one names the model and the field."""

import json
import subprocess
import sys

import pytest

from runtime.hf_config import load_raw_config
from runtime.models import REGISTRY, UnknownArchitecture, all_declarations, resolve
from runtime.models.bamba.declaration import BambaForCausalLM
from runtime.models.common import capabilities
from runtime.models.interface import (
    Capabilities,
    DeclarationError,
    Feature,
    LayerKind,
    ModelDeclaration,
    Status,
    planned,
    supported,
    unsupported,
    validate_declaration,
)
from runtime.models.llama.declaration import LlamaForCausalLM


def test_every_registered_declaration_is_valid():
    declarations = all_declarations()
    assert [d.architecture for d in declarations] == sorted(REGISTRY)
    for decl in declarations:
        assert set(decl.capabilities.features) == set(Feature)


def test_required_architectures_are_registered():
    required = {
        "LlamaForCausalLM", "GraniteForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM",
        "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "NemotronHForCausalLM", "Zamba2ForCausalLM",
        "JambaForCausalLM",
    }
    assert required <= set(REGISTRY)


def test_a_model_without_a_forward_pass_is_never_supported():
    for decl in all_declarations():
        if decl.implementation is None:
            assert decl.capabilities.engine.status is Status.PLANNED, decl.architecture
            assert decl.capabilities.engine.note


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnknownArchitecture, match="supported architectures: BambaForCausalLM, "):
        resolve("GPT2LMHeadModel")


def test_declarations_import_no_torch():
    code = "import sys; from runtime.models import all_declarations; all_declarations(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


class HybridWithoutStates(ModelDeclaration):
    architecture = "HybridWithoutStates"
    model_name = "Broken"
    example_models = ("org/broken",)
    layer_kinds = frozenset({LayerKind.ATTENTION, LayerKind.MAMBA2})
    capabilities = capabilities()
    layout = LlamaForCausalLM.layout
    attention_shape = LlamaForCausalLM.attention_shape


class AttentionWithoutHeads(ModelDeclaration):
    architecture = "AttentionWithoutHeads"
    model_name = "Broken"
    example_models = ("org/broken",)
    layer_kinds = frozenset({LayerKind.ATTENTION})
    capabilities = capabilities()
    layout = LlamaForCausalLM.layout


class SupportedWithoutForward(LlamaForCausalLM):
    capabilities = capabilities(engine=supported())
    implementation = None


class SupportedWithMissingModule(LlamaForCausalLM):
    capabilities = capabilities(engine=supported())
    implementation = "runtime.nowhere:Model"


class PlannedWithoutNote(LlamaForCausalLM):
    capabilities = capabilities(engine=planned(""))


class MissingFeature(LlamaForCausalLM):
    capabilities = Capabilities(engine=planned("Not yet."), features={Feature.LORA: unsupported()})


class Mamba2WithoutChunkSize(BambaForCausalLM):
    mamba_chunk_size = ModelDeclaration.mamba_chunk_size


class NoExamples(LlamaForCausalLM):
    example_models = ()


@pytest.mark.parametrize(
    "cls,field",
    [
        (HybridWithoutStates, "mamba_state_shape"),
        (AttentionWithoutHeads, "attention_shape"),
        (SupportedWithoutForward, "capabilities.engine"),
        (SupportedWithMissingModule, "implementation"),
        (PlannedWithoutNote, "capabilities.engine"),
        (MissingFeature, "capabilities.features"),
        (Mamba2WithoutChunkSize, "mamba_chunk_size"),
        (NoExamples, "example_models"),
    ],
)
def test_bad_declaration_names_model_and_field(cls, field):
    with pytest.raises(DeclarationError) as err:
        validate_declaration(cls)
    assert str(err.value).startswith(f"{cls.__name__}: {field}:")


class WrongStateDtypes(BambaForCausalLM):
    @classmethod
    def mamba_state_dtypes(cls, cfg, dtype, ssm_dtype):
        return ("bfloat16",)


def test_state_dtypes_must_match_state_shapes():
    cfg = BambaForCausalLM.read_config(json.loads(json.dumps({"architectures": ["BambaForCausalLM"]})))
    with pytest.raises(DeclarationError, match="WrongStateDtypes: mamba_state_dtypes: gives 1 dtypes for 2"):
        WrongStateDtypes.mamba_state(cfg, 1, "bfloat16", None)


def test_infinity_both_spellings(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "config.json").write_text(
        '{"architectures": ["BambaForCausalLM"], "time_step_limit": [0.0, Infinity]}'
    )
    (tmp_path / "b" / "config.json").write_text(
        '{"architectures": ["BambaForCausalLM"], "time_step_limit": [0.0, {"__float__": "Infinity"}]}'
    )
    assert load_raw_config(tmp_path / "a")["time_step_limit"] == load_raw_config(tmp_path / "b")["time_step_limit"]
    assert load_raw_config(tmp_path / "b")["time_step_limit"][1] == float("inf")


def test_mamba_ssm_native_config_is_translated(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 768, "n_layer": 24, "ssm_cfg": {"layer": "Mamba2"}}))
    raw = load_raw_config(tmp_path)
    assert raw["architectures"] == ["Mamba2ForCausalLM"]
    assert (raw["num_heads"], raw["head_dim"], raw["n_groups"], raw["state_size"]) == (24, 64, 1, 128)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 768, "n_layer": 24, "ssm_cfg": {}}))
    assert load_raw_config(tmp_path)["architectures"] == ["MambaForCausalLM"]
