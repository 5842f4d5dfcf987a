"""Declarations -> plain, sorted rows for the support tables. Templates only print these."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from matrix.cells import Column, Footnotes, cell, code, text
from matrix.errors import BadDeclaration
from matrix.families import FAMILIES, Family, combined_status, family_of, family_status
from matrix.vocabulary import FAMILY, LEGEND, MATRIX
from runtime.models import all_declarations
from runtime.models.interface import DeclarationError, Feature, LayerKind, ModelDeclaration, Status, Support

Declaration = type[ModelDeclaration]
SupportOf = Callable[[Declaration], Support]

LAYER_LABELS = {
    LayerKind.ATTENTION: "attention",
    LayerKind.MAMBA2: "Mamba-2",
    LayerKind.MAMBA1: "Mamba-1",
    LayerKind.PARALLEL: "parallel attention + Mamba-2",
    LayerKind.HYBRID: "shared attention + Mamba-2",
    LayerKind.SHORT_CONV: "short convolution",
    LayerKind.GATED_DELTANET: "Gated DeltaNet",
    LayerKind.LIGHTNING: "lightning attention",
    LayerKind.MLP: "MLP",
}
assert set(LAYER_LABELS) == set(LayerKind), "every layer kind needs a label"

FEATURE_LABELS = {
    Feature.PREFIX_CACHING: "Prefix caching",
    Feature.CHUNKED_PREFILL: "Chunked prefill",
    Feature.CUDA_GRAPHS: "CUDA graphs",
    Feature.TENSOR_PARALLEL: "TP",
    Feature.PIPELINE_PARALLEL: "PP",
    Feature.LORA: "LoRA",
    Feature.SPECULATIVE_DECODING: "Spec decode",
}
assert set(FEATURE_LABELS) == set(Feature), "every feature needs a label"
# The supported-models table shows these features, in this order (vLLM's columns plus ours).
MODEL_TABLE_FEATURES = (
    Feature.PREFIX_CACHING,
    Feature.CHUNKED_PREFILL,
    Feature.TENSOR_PARALLEL,
    Feature.PIPELINE_PARALLEL,
    Feature.LORA,
    Feature.SPECULATIVE_DECODING,
)


def declarations() -> list[Declaration]:
    """Every registered declaration, validated, sorted by architecture name."""
    try:
        decls = all_declarations()
    except DeclarationError as err:
        raise BadDeclaration(str(err)) from None
    return sorted(decls, key=lambda d: (d.architecture.casefold(), d.architecture))


def engine(decl: Declaration) -> Support:
    return decl.capabilities.engine


def feature(which: Feature) -> SupportOf:
    return lambda decl: decl.capabilities.feature(which)


def layer_label(decl: Declaration) -> str:
    return ", ".join(LAYER_LABELS[kind] for kind in LayerKind if kind in decl.layer_kinds)


def quantization_label(decl: Declaration) -> str:
    """The weight formats the declaration lists (each proven by a test; docs/features/quantization.md)."""
    formats = getattr(decl, "quantizations", ())
    return ", ".join(code(cell(f)) for f in formats) if formats else "–"


def supported_models(root: Path) -> dict[str, Any]:
    footnotes = Footnotes()
    rows = []
    for decl in declarations():
        statuses = [engine(decl)] + [decl.capabilities.feature(f) for f in MODEL_TABLE_FEATURES]
        rows.append([
            code(decl.architecture),
            cell(decl.model_name),
            ", ".join(code(cell(m)) for m in decl.example_models),
            cell(layer_label(decl)),
            *(footnotes.mark(MATRIX[s.status].char, [s.note]) for s in statuses),
            quantization_label(decl),
        ])
    columns = [Column(t, "---") for t in ("Architecture", "Models", "Example HF Models", "Layers")]
    columns += [Column(t, ":-:") for t in ("V1", *(FEATURE_LABELS[f] for f in MODEL_TABLE_FEATURES))]
    columns += [Column("Quantization", "---")]
    return {"legend": LEGEND, "columns": columns, "rows": rows, "notes": footnotes.notes}


def families() -> list[tuple[Family, list[Declaration]]]:
    """The families that have models, in FAMILIES order, each with its models sorted by name."""
    members: dict[Family, list[Declaration]] = {}
    for decl in declarations():
        members.setdefault(family_of(decl), []).append(decl)
    return [
        (family, sorted(members[family], key=lambda d: (d.model_name.casefold(), d.architecture)))
        for family in FAMILIES
        if family in members
    ]


def status_summary(models: Sequence[Declaration], support_of: SupportOf) -> list[str]:
    """When models disagree, which models have which status, e.g. `supported: Llama; planned: Granite`."""
    names: dict[Status, list[str]] = {}
    for decl in models:
        names.setdefault(support_of(decl).status, []).append(decl.model_name)
    if len(names) < 2:
        return []
    return ["; ".join(f"{MATRIX[s].name}: {', '.join(names[s])}" for s in Status if s in names)]


def member_notes(models: Sequence[Declaration], support_of: SupportOf) -> list[str]:
    """Each distinct note once, prefixed with its models unless every model of the family has it."""
    names: dict[str, list[str]] = {}
    for decl in models:
        note = support_of(decl).note
        if note:
            names.setdefault(text(note), []).append(decl.model_name)
    return [
        note if len(who) == len(models) else f"{', '.join(who)}: {note}"
        for note, who in names.items()
    ]


def v1_families(root: Path) -> dict[str, Any]:
    rows = []
    for family, models in families():
        glyph = FAMILY[family_status((engine(d).status for d in models),
                                     (d.capabilities.feature(Feature.CUDA_GRAPHS).status for d in models))]
        notes = status_summary(models, engine) + member_notes(models, engine)
        rows.append([
            cell(family.name),
            ", ".join(cell(d.model_name) for d in models),
            f"{glyph.char} {glyph.name}",
            "<br>".join(cell(n) for n in notes),
        ])
    columns = [Column(t, "---") for t in ("Model family", "Models", "Status", "Notes")]
    return {"legend": LEGEND, "columns": columns, "rows": rows}


def v1_features(root: Path) -> dict[str, Any]:
    footnotes = Footnotes()
    groups = families()
    rows = []
    for which in Feature:
        support_of = feature(which)
        row = [cell(FEATURE_LABELS[which])]
        for _, models in groups:
            status = combined_status(support_of(d).status for d in models)
            notes = status_summary(models, support_of) + member_notes(models, support_of)
            row.append(footnotes.mark(MATRIX[status].char, notes))
        rows.append(row)
    columns = [Column("Feature", "---")] + [Column(cell(family.name), ":-:") for family, _ in groups]
    return {"legend": LEGEND, "columns": columns, "rows": rows, "notes": footnotes.notes}


def runtime_models(root: Path) -> dict[str, Any]:
    """The home page's sentence of which models run on the engine and which are planned."""
    def names(decls: Sequence[Declaration]) -> str:
        listed = sorted({cell(d.model_name) for d in decls}, key=str.casefold)
        return listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]

    decls = declarations()
    running = [d for d in decls if engine(d).status in (Status.SUPPORTED, Status.PARTIAL)]
    planned = [d for d in decls if d not in running]
    return {"running": names(running), "planned": names(planned) if planned else ""}
