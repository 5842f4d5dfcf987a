"""The one definition of every status glyph: the tables, the legends and the linter read it.

Each glyph is a single codepoint with default emoji presentation, written bare: never
followed by U+FE0E/U+FE0F (U+2705 has no standardized variation sequence at all, and
renderers disagree about what a selector after it means). See docs-tooling.md §0.
"""

from __future__ import annotations

import enum
import unicodedata
from dataclasses import dataclass
from types import MappingProxyType

from runtime.models.interface import Status


@dataclass(frozen=True)
class Glyph:
    char: str
    name: str  # the short name a legend shows in bold
    meaning: str  # the rest of the legend entry

    def __post_init__(self) -> None:
        assert len(self.char) == 1, f"{self.name}: a status glyph is one codepoint, got {codepoints(self.char)}"
        assert unicodedata.is_normalized("NFC", self.char)


# The support matrix (one model or family x one feature).
SUPPORTED = Glyph("\u2705", "supported", "works on the engine")
PARTIAL = Glyph("\U0001F7E1", "partial", "works with limitations, or for only some models of a family (see the note)")
PLANNED = Glyph("\U0001F6A7", "planned", "planned or in progress; not available yet")
UNSUPPORTED = Glyph("\u274C", "not supported", "not supported and not planned")
UNKNOWN = Glyph("\u2753", "unknown", "not tested")
NOT_APPLICABLE = Glyph("\u2796", "not applicable", "does not apply to this model")

MATRIX = MappingProxyType({
    Status.SUPPORTED: SUPPORTED,
    Status.PARTIAL: PARTIAL,
    Status.PLANNED: PLANNED,
    Status.UNSUPPORTED: UNSUPPORTED,
})
# The legend above each support table: the glyphs a status can turn into, in this order.
MATRIX_LEGEND = tuple(MATRIX.values())


class FamilyStatus(enum.Enum):
    """A model family's status on the engine, in vLLM's V1-guide vocabulary."""

    OPTIMIZED = "optimized"
    FUNCTIONAL = "functional"
    WIP = "wip"
    PLANNED = "planned"
    DELAYED = "delayed"
    DEPRECATED = "deprecated"


# One meaning per glyph across the whole site: a family that is partly there shares the matrix's
# "partial" glyph, and a family still to come shares its "planned" glyph (vLLM's V1 guide uses 🟡
# and 🚧 the other way round, which gave the same page two meanings for each).
FAMILY = MappingProxyType({
    FamilyStatus.OPTIMIZED: Glyph("\U0001F680", "Optimized", "every model runs on the engine, with CUDA graphs"),
    FamilyStatus.FUNCTIONAL: Glyph("\U0001F7E2", "Functional", "every model runs on the engine"),
    FamilyStatus.WIP: Glyph(PARTIAL.char, "WIP", PARTIAL.meaning),
    FamilyStatus.PLANNED: Glyph(PLANNED.char, "Planned", PLANNED.meaning),
    FamilyStatus.DELAYED: Glyph("\U0001F7E0", "Delayed", "not supported, and not planned for now"),
    FamilyStatus.DEPRECATED: Glyph("\U0001F534", "Deprecated", "was supported and is being removed"),
})
FAMILY_LEGEND = tuple(FAMILY.values())


def _one_legend(*glyphs: Glyph) -> tuple[Glyph, ...]:
    """Every glyph once, names of the same glyph joined ("partial / WIP"); a glyph has one meaning."""
    merged: dict[str, Glyph] = {}
    for glyph in glyphs:
        seen = merged.get(glyph.char)
        if seen is None:
            merged[glyph.char] = glyph
            continue
        assert seen.meaning == glyph.meaning, f"{glyph.char} has two meanings: {seen.meaning!r}, {glyph.meaning!r}"
        if glyph.name.lower() != seen.name.lower():
            merged[glyph.char] = Glyph(glyph.char, f"{seen.name} / {glyph.name}", seen.meaning)
    return tuple(merged.values())


# The one legend every page shows above its glyphs, in this order.
LEGEND = _one_legend(FAMILY[FamilyStatus.OPTIMIZED], FAMILY[FamilyStatus.FUNCTIONAL], *MATRIX_LEGEND,
                     *FAMILY_LEGEND, UNKNOWN, NOT_APPLICABLE)

# Every canonical glyph: the linter flags a variation selector after any of them.
CANONICAL = frozenset(glyph.char for glyph in LEGEND)

# Characters that look like a status glyph; in a table cell the linter replaces them.
LOOKALIKES = MappingProxyType({
    "\u2714": SUPPORTED,  # ✔ HEAVY CHECK MARK (text by default; ✔️ with U+FE0F)
    "\u2713": SUPPORTED,  # ✓ CHECK MARK
    "\u2611": SUPPORTED,  # ☑ BALLOT BOX WITH CHECK
    "\U0001F5F8": SUPPORTED,  # 🗸 LIGHT CHECK MARK
    "\u2716": UNSUPPORTED,  # ✖ HEAVY MULTIPLICATION X
    "\u2717": UNSUPPORTED,  # ✗ BALLOT X
    "\u2718": UNSUPPORTED,  # ✘ HEAVY BALLOT X
    "\u274E": UNSUPPORTED,  # ❎ NEGATIVE SQUARED CROSS MARK
    "\u2754": UNKNOWN,  # ❔ WHITE QUESTION MARK ORNAMENT (pale on the light theme)
})

VARIATION_SELECTORS = frozenset(chr(c) for c in range(0xFE00, 0xFE10))
ZERO_WIDTH = frozenset("\u200B\u200C\u200D\u2060\uFEFF")
# Shown as <U+XXXX> wherever the tooling prints text a human compares by eye.
INVISIBLE = VARIATION_SELECTORS | ZERO_WIDTH | {"\r"}


def codepoints(text: str) -> str:
    """`"✅\\ufe0e"` -> `"U+2705 U+FE0E"`."""
    return " ".join(f"U+{ord(c):04X}" for c in text)


def char_name(char: str) -> str:
    return unicodedata.name(char, f"U+{ord(char):04X}")


def show_invisible(text: str) -> str:
    """Make invisible characters visible, e.g. `"✅\\ufe0e"` -> `"✅<U+FE0E>"`."""
    return "".join(f"<U+{ord(c):04X}>" if c in INVISIBLE else c for c in text)
