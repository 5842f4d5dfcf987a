"""Model families come from layer kinds; family statuses from the models' declared statuses."""

import pytest

from matrix.errors import BadDeclaration
from matrix.families import combined_status, family_of, family_status
from matrix.vocabulary import FamilyStatus
from runtime.models import resolve
from runtime.models.interface import LayerKind, ModelDeclaration, Status

S, P, PL, U = Status.SUPPORTED, Status.PARTIAL, Status.PLANNED, Status.UNSUPPORTED

FAMILIES = {
    "LlamaForCausalLM": "Decoder-only attention",
    "GraniteForCausalLM": "Decoder-only attention",
    "Mamba2ForCausalLM": "Mamba-2",
    "MambaForCausalLM": "Mamba-1",
    "BambaForCausalLM": "Hybrid attention + Mamba-2",
    "GraniteMoeHybridForCausalLM": "Hybrid attention + Mamba-2",
    "NemotronHForCausalLM": "Hybrid attention + Mamba-2",
    "FalconH1ForCausalLM": "Hybrid attention + Mamba-2",
    "Zamba2ForCausalLM": "Hybrid attention + Mamba-2",
    "JambaForCausalLM": "Hybrid attention + Mamba-1",
    "Lfm2ForCausalLM": "Hybrid attention + linear attention / short convolution",
    "Qwen3NextForCausalLM": "Hybrid attention + linear attention / short convolution",
}


@pytest.mark.parametrize("architecture, family", FAMILIES.items())
def test_each_architecture_is_in_the_family_its_layers_say(architecture, family):
    assert family_of(resolve(architecture)).name == family


@pytest.mark.parametrize(
    "engine, cuda_graphs, expected",
    [
        ([S, S], [S, S], FamilyStatus.OPTIMIZED),
        ([S, S], [S, PL], FamilyStatus.FUNCTIONAL),
        ([S, PL], [PL, PL], FamilyStatus.WIP),
        ([P], [PL], FamilyStatus.WIP),
        ([PL, PL], [PL, PL], FamilyStatus.PLANNED),
        ([PL, U], [PL, U], FamilyStatus.PLANNED),
        ([U], [U], FamilyStatus.DELAYED),
    ],
)
def test_family_status(engine, cuda_graphs, expected):
    assert family_status(engine, cuda_graphs) is expected


@pytest.mark.parametrize(
    "statuses, expected",
    [([S, S], S), ([U], U), ([S, U], P), ([S, P], P), ([PL, S], P), ([PL, U], PL), ([PL, PL], PL)],
)
def test_combined_feature_status(statuses, expected):
    assert combined_status(statuses) is expected


def test_layer_kinds_with_no_family_are_a_bad_declaration():
    class Odd(ModelDeclaration):
        layer_kinds = frozenset({LayerKind.MAMBA1, LayerKind.MAMBA2})

    with pytest.raises(BadDeclaration, match=r"Odd: layer_kinds \(mamba1, mamba2\) fit no model family"):
        family_of(Odd)
