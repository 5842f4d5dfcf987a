"""Model families for the V1 guide, derived from each declaration's layer kinds.

A family is named by the kinds of sequence mixer its models contain; statuses are
aggregated from the models' declarations, never written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from matrix.errors import BadDeclaration
from matrix.vocabulary import FamilyStatus
from runtime.models.interface import LayerKind, ModelDeclaration, Status

ATTENTION, MAMBA2, MAMBA1, LINEAR = "attention", "mamba2", "mamba1", "linear"

# The mixers each layer kind contains. MLP layers mix no tokens and do not decide the family.
MIXERS = {
    LayerKind.ATTENTION: {ATTENTION},
    LayerKind.MAMBA2: {MAMBA2},
    LayerKind.MAMBA1: {MAMBA1},
    LayerKind.PARALLEL: {ATTENTION, MAMBA2},
    LayerKind.HYBRID: {ATTENTION, MAMBA2},
    LayerKind.SHORT_CONV: {LINEAR},
    LayerKind.GATED_DELTANET: {LINEAR},
    LayerKind.LIGHTNING: {LINEAR},
    LayerKind.MLP: set(),
}
assert set(MIXERS) == set(LayerKind), "every layer kind needs its mixers"


@dataclass(frozen=True)
class Family:
    name: str
    mixers: frozenset[str]


# In the order the V1 guide lists them.
FAMILIES = (
    Family("Decoder-only attention", frozenset({ATTENTION})),
    Family("Mamba-2", frozenset({MAMBA2})),
    Family("Mamba-1", frozenset({MAMBA1})),
    Family("Hybrid attention + Mamba-2", frozenset({ATTENTION, MAMBA2})),
    Family("Hybrid attention + Mamba-1", frozenset({ATTENTION, MAMBA1})),
    Family("Hybrid attention + linear attention / short convolution", frozenset({ATTENTION, LINEAR})),
)


def family_of(decl: type[ModelDeclaration]) -> Family:
    mixers = frozenset().union(*(MIXERS[kind] for kind in decl.layer_kinds))
    for family in FAMILIES:
        if family.mixers == mixers:
            return family
    kinds = ", ".join(sorted(kind.value for kind in decl.layer_kinds))
    raise BadDeclaration(
        f"{decl.__name__}: layer_kinds ({kinds}) fit no model family of the V1 guide; "
        "add a Family for this combination in matrix/families.py"
    )


def family_status(engine: Iterable[Status], cuda_graphs: Iterable[Status]) -> FamilyStatus:
    """The family's V1-guide status from its models' engine (and CUDA-graph) statuses."""
    engine, cuda_graphs = set(engine), set(cuda_graphs)
    assert engine, "a family has at least one model"
    if engine == {Status.SUPPORTED}:
        return FamilyStatus.OPTIMIZED if cuda_graphs == {Status.SUPPORTED} else FamilyStatus.FUNCTIONAL
    if engine & {Status.SUPPORTED, Status.PARTIAL}:
        return FamilyStatus.WIP
    if Status.PLANNED in engine:
        return FamilyStatus.PLANNED
    return FamilyStatus.DELAYED


def combined_status(statuses: Iterable[Status]) -> Status:
    """One matrix status for several models: theirs if they agree, else partial or planned."""
    statuses = set(statuses)
    assert statuses, "a family has at least one model"
    if len(statuses) == 1:
        return statuses.pop()
    if statuses & {Status.SUPPORTED, Status.PARTIAL}:
        return Status.PARTIAL
    return Status.PLANNED  # some planned, the rest unsupported
