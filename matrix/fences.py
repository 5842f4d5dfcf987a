"""Lines of a markdown file, and which of them sit inside fenced code blocks (``` or ~~~)."""

from __future__ import annotations

import re

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class Fences:
    """Fed the lines of a file in order, says which are code (a fence line or inside a block)."""

    def __init__(self) -> None:
        self._opening: str | None = None

    def inside(self, line: str) -> bool:
        match = FENCE.match(line)
        if self._opening is None:
            if match:
                self._opening = match.group(1)
            return match is not None
        # A fence closes on a run of the same character at least as long, with nothing after it.
        run = match.group(1) if match else ""
        if run[:1] == self._opening[0] and len(run) >= len(self._opening) and not line[match.end():].strip():
            self._opening = None
        return True


def fenced(lines: list[str]) -> list[bool]:
    fences = Fences()
    return [fences.inside(line) for line in lines]


def split_lines(text: str) -> list[str]:
    """Lines with their endings (\\n or \\r\\n), split on \\n only, as editors number them."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
