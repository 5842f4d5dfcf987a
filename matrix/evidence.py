"""Every cell of the support matrix against the tests that claim to prove it (matrix/claims.py).

A supported or partial cell with no proving test fails `tandem matrix check`; a planned or
unsupported cell that a test proves is reported, so that its declaration gets flipped. The
evidence page lists the tests behind each cell, grouped by architecture and claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.cells import Column, code
from matrix.claims import CLAIMS, ENGINE, read_claims
from matrix.collect import FEATURE_LABELS, declarations
from matrix.vocabulary import LEGEND, MATRIX
from runtime.models import REGISTRY
from runtime.models.interface import Feature, ModelDeclaration, Status, Support

NEEDS_PROOF = (Status.SUPPORTED, Status.PARTIAL)
LABELS = {ENGINE: "V1 (engine)", **{feature.value: FEATURE_LABELS[feature] for feature in Feature}}
assert tuple(LABELS) == CLAIMS, "every claim needs a label, in the order of CLAIMS"


@dataclass(frozen=True)
class Cell:
    """One architecture's status for one claim, and the tests that prove it."""

    architecture: str
    claim: str
    support: Support
    tests: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.architecture} {LABELS[self.claim]}"

    @property
    def unproven(self) -> bool:
        return self.support.status in NEEDS_PROOF and not self.tests

    @property
    def ahead(self) -> bool:
        """A test proves what the declaration does not claim yet."""
        return self.support.status not in NEEDS_PROOF and bool(self.tests)


def declaration_file(architecture: str) -> str:
    return REGISTRY[architecture].replace(".", "/") + ".py"


def marker(cell: Cell) -> str:
    return f'@pytest.mark.proves("{cell.architecture}", "{cell.claim}")'


def cells(root: Path) -> list[Cell]:
    """Every (architecture, claim) cell, in table order, with the tests that claim to prove it."""
    tests: dict[tuple[str, str], set[str]] = {}
    for claim in read_claims(root):
        tests.setdefault((claim.architecture, claim.claim), set()).add(claim.test)
    return [
        Cell(decl.architecture, name, support_of(decl, name), tuple(sorted(tests.get((decl.architecture, name), []))))
        for decl in declarations()
        for name in CLAIMS
    ]


def support_of(decl: type[ModelDeclaration], claim: str) -> Support:
    return decl.capabilities.engine if claim == ENGINE else decl.capabilities.feature(Feature(claim))


@dataclass(frozen=True)
class Proofs:
    failures: tuple[str, ...]  # supported or partial cells that no test proves
    warnings: tuple[str, ...]  # planned or unsupported cells that a test proves
    num_proven: int  # supported or partial cells with a proving test
    num_tests: int


def examine(root: Path) -> Proofs:
    found = cells(root)
    failures = tuple(
        f"{cell.name}: the declaration says {cell.support.status.value} but no test proves it; add a test marked "
        f"{marker(cell)} or set the declaration to planned(...) in {declaration_file(cell.architecture)}"
        for cell in found if cell.unproven
    )
    warnings = tuple(
        f"warning: {cell.name}: {count(cell.tests)} prove(s) it (e.g. {cell.tests[0]}) but the declaration says "
        f"{cell.support.status.value}; set it to supported() in {declaration_file(cell.architecture)}"
        for cell in found if cell.ahead
    )
    num_proven = sum(1 for cell in found if cell.support.status in NEEDS_PROOF and cell.tests)
    return Proofs(failures, warnings, num_proven, len({test for cell in found for test in cell.tests}))


def count(tests: tuple[str, ...]) -> str:
    return f"{len(tests)} test" + ("" if len(tests) == 1 else "s")


def anchor(architecture: str) -> str:
    # The toc extension's slug of a heading that is only the architecture name (it keeps underscores: Qwen3_5...).
    assert architecture.replace("_", "").isalnum(), architecture
    return architecture.lower()


def summary_cell(cell: Cell) -> str:
    glyph = MATRIX[cell.support.status].char
    return f"{glyph} {len(cell.tests)}" if cell.tests or cell.support.status in NEEDS_PROOF else glyph


def evidence_page(root: Path) -> dict[str, Any]:
    found = cells(root)
    by_architecture: dict[str, list[Cell]] = {}
    for cell in found:
        by_architecture.setdefault(cell.architecture, []).append(cell)
    rows, sections = [], []
    for architecture, row in by_architecture.items():
        shown = [cell for cell in row if cell.tests or cell.support.status in NEEDS_PROOF]
        title = f"[{code(architecture)}](#{anchor(architecture)})" if shown else code(architecture)
        rows.append([title, *(summary_cell(cell) for cell in row)])
        if shown:
            sections.append({"title": architecture, "groups": [group(cell) for cell in shown]})
    columns = [Column("Architecture", "---")] + [Column(LABELS[claim], ":-:") for claim in CLAIMS]
    return {"legend": LEGEND, "columns": columns, "rows": rows, "sections": sections}


def group(cell: Cell) -> dict[str, Any]:
    glyph = MATRIX[cell.support.status]
    proven = f"{count(cell.tests)}" if cell.tests else "no test proves it"
    return {"title": f"**{LABELS[cell.claim]}**: {glyph.char} {glyph.name}, {proven}", "tests": list(cell.tests)}
