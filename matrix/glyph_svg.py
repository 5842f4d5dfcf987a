"""Each canonical status glyph drawn as a small inline SVG, for the built site only.

The markdown keeps the Unicode glyph (GitHub and editors show it); the mkdocs hook swaps it for
this drawing so the page shows it on machines without a colour emoji font (most Linux servers
and CI images draw an empty box). Each drawing carries the glyph's legend name as its
accessible label, and `colour` is the colour a browser test looks for in the drawn cell.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from types import MappingProxyType

from matrix.vocabulary import LEGEND


@dataclass(frozen=True)
class Drawing:
    colour: str  # the main fill, "#rrggbb"
    body: str  # SVG elements on a 16 x 16 view box

    @property
    def rgb(self) -> tuple[int, int, int]:
        return tuple(int(self.colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def _disc(colour: str) -> Drawing:
    return Drawing(colour, f'<circle cx="8" cy="8" r="7" fill="{colour}"/>')


DRAWINGS = MappingProxyType({
    "\u2705": Drawing("#2e9e44", '<rect x="1" y="1" width="14" height="14" rx="3" fill="#2e9e44"/>'
                                 '<path d="M4 8.5l2.8 2.8L12.2 5" fill="none" stroke="#fff" stroke-width="2.2" '
                                 'stroke-linecap="round" stroke-linejoin="round"/>'),
    "\U0001F7E1": _disc("#f5c518"),
    "\U0001F6A7": Drawing("#f08c00", '<rect x="1" y="3" width="14" height="7" rx="1" fill="#f08c00"/>'
                                     '<path d="M3 10l4-7M8 10l4-7M13 10l2-3.5" stroke="#222" stroke-width="1.6"/>'
                                     '<path d="M3 10v4M13 10v4" stroke="#555" stroke-width="1.6"/>'),
    "\u274C": Drawing("#d93025", '<path d="M3.5 3.5l9 9M12.5 3.5l-9 9" stroke="#d93025" stroke-width="3" '
                                 'stroke-linecap="round"/>'),
    "\u2753": Drawing("#c2185b", '<path d="M5 5.5a3 3 0 1 1 4.2 2.8c-.8.4-1.2 1-1.2 1.9v.6" fill="none" '
                                 'stroke="#c2185b" stroke-width="2.4" stroke-linecap="round"/>'
                                 '<circle cx="8" cy="13.6" r="1.4" fill="#c2185b"/>'),
    "\u2796": Drawing("#616161", '<rect x="2" y="6.6" width="12" height="2.8" rx="1.2" fill="#616161"/>'),
    "\U0001F680": Drawing("#1a73e8", '<path d="M8 1c2.6 1.8 3.6 4.8 3 8.5H5C4.4 5.8 5.4 2.8 8 1z" fill="#1a73e8"/>'
                                     '<circle cx="8" cy="5.6" r="1.3" fill="#fff"/>'
                                     '<path d="M5 9.5l-2 3h3zM11 9.5l2 3h-3z" fill="#1a73e8"/>'
                                     '<path d="M6.6 10.5h2.8L8 14.5z" fill="#f08c00"/>'),
    "\U0001F7E2": _disc("#34a853"),
    "\U0001F7E0": _disc("#ff6d00"),
    "\U0001F534": _disc("#d93025"),
})
assert set(DRAWINGS) == {glyph.char for glyph in LEGEND}, "every legend glyph has a drawing"
NAMES = MappingProxyType({glyph.char: glyph.name for glyph in LEGEND})


def inline_svg(char: str) -> str:
    """The glyph as a labelled inline SVG; `data-glyph` keeps the character for scripts and tests."""
    label = html.escape(NAMES[char], quote=True)
    return (f'<span class="status-glyph" role="img" aria-label="{label}" title="{label}" data-glyph="{char}">'
            f'<svg viewBox="0 0 16 16" width="1.25em" height="1.25em" aria-hidden="true" focusable="false">'
            f'{DRAWINGS[char].body}</svg></span>')


def replace_glyphs(page_html: str) -> str:
    """Every canonical glyph in the text of `page_html` (never inside a tag) as its inline SVG."""
    out, i = [], 0
    while i < len(page_html):
        if page_html[i] == "<":
            end = page_html.find(">", i)
            end = len(page_html) if end < 0 else end + 1
            out.append(page_html[i:end])
            i = end
            continue
        char = page_html[i]
        out.append(inline_svg(char) if char in DRAWINGS else char)
        i += 1
    return "".join(out)
