"""The glyph linter: every status glyph bare and canonical, in every markdown file under docs/.

Codes: G001 a variation selector after a status glyph; G002 a variation selector after
anything else (a lone one); G003 a zero-width character; G004 a lookalike (✔ ✓ ☑ ✖ ✗ ❎ ...)
in a table cell. Columns count characters (codepoints), from 1. Every finding has a fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from matrix.fences import fenced, split_lines
from matrix.vocabulary import CANONICAL, LOOKALIKES, VARIATION_SELECTORS, ZERO_WIDTH, char_name, codepoints


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    col: int
    code: str
    sequence: str  # the offending characters
    replacement: str  # what the fix writes in their place
    message: str

    def format(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {codepoints(self.sequence)}: {self.message}"


@dataclass(frozen=True)
class _Hit:
    start: int
    end: int
    code: str
    replacement: str
    message: str


def _selectors_end(line: str, start: int) -> int:
    end = start
    while end < len(line) and line[end] in VARIATION_SELECTORS:
        end += 1
    return end


def _hit_at(line: str, i: int, in_table: bool) -> _Hit | None:
    char = line[i]
    if char in CANONICAL and _selectors_end(line, i + 1) > i + 1:
        end = _selectors_end(line, i + 1)
        message = f"variation selector after the status glyph {char} ({char_name(char)}); write it bare"
        return _Hit(i, end, "G001", char, f"{message} as {codepoints(char)}")
    if char in LOOKALIKES and in_table:
        glyph = LOOKALIKES[char]
        use = f"{glyph.char} {codepoints(glyph.char)} ({glyph.name})"
        message = f"lookalike {char} ({char_name(char)}) in a table cell; use {use}"
        return _Hit(i, _selectors_end(line, i + 1), "G004", glyph.char, message)
    if char in VARIATION_SELECTORS:
        return _Hit(i, _selectors_end(line, i), "G002", "",
                    f"lone variation selector ({char_name(char)}); status glyphs are written bare, delete it")
    if char in ZERO_WIDTH:
        return _Hit(i, i + 1, "G003", "", f"zero-width character ({char_name(char)}); delete it")
    return None


def _hits(line: str, in_table: bool) -> Iterator[_Hit]:
    i = 0
    while i < len(line):
        hit = _hit_at(line, i, in_table)
        if hit is None:
            i += 1
        else:
            yield hit
            i = hit.end


def _lines(text: str) -> Iterator[tuple[int, str, list[_Hit]]]:
    lines = split_lines(text)
    for number, (line, in_code) in enumerate(zip(lines, fenced(lines)), start=1):
        in_table = not in_code and line.lstrip().startswith("|")
        yield number, line, list(_hits(line, in_table))


def findings_in(text: str, path: str = "<text>") -> list[Finding]:
    return [
        Finding(path, number, hit.start + 1, hit.code, line[hit.start:hit.end], hit.replacement, hit.message)
        for number, line, hits in _lines(text)
        for hit in hits
    ]


def fix(text: str) -> str:
    """The text with every finding replaced by its canonical form; everything else untouched."""
    out = []
    for _, line, hits in _lines(text):
        last = 0
        for hit in hits:
            out.append(line[last:hit.start] + hit.replacement)
            last = hit.end
        out.append(line[last:])
    return "".join(out)
