"""Plain-text table pieces that collectors hand to templates: columns, cells and footnotes."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Column:
    title: str
    align: str  # the separator cell: "---", ":-:" or "--:"


@dataclass(frozen=True)
class Note:
    number: int
    text: str


def text(value: str) -> str:
    """Declaration text, NFC-normalized, on one line."""
    return unicodedata.normalize("NFC", " ".join(str(value).split()))


def cell(value: str) -> str:
    """Text for a table cell: a `|` would end the cell, so it is escaped."""
    return text(value).replace("|", "\\|")


def code(value: str) -> str:
    return f"`{value}`"


class Footnotes:
    """Numbers notes in the order cells ask for them; the same text always gets the same number."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def mark(self, glyph: str, notes: Iterable[str | None]) -> str:
        """The glyph followed by the numbers of its notes, e.g. `🚧<sup>1</sup>`."""
        numbers = [self._number(note) for note in notes if note]
        if not numbers:
            return glyph
        return f"{glyph}<sup>{', '.join(str(n) for n in sorted(set(numbers)))}</sup>"

    def _number(self, note: str) -> int:
        return self._numbers.setdefault(text(note), len(self._numbers) + 1)

    @property
    def notes(self) -> list[Note]:
        return [Note(number, note) for note, number in self._numbers.items()]
