"""BEGIN/END GENERATED markers: finding regions, validating them, and replacing their bodies.

A region is `<!-- BEGIN GENERATED: id -->` ... `<!-- END GENERATED: id -->`, each marker
alone on its line; the generator owns every byte between the two lines. Markers inside
fenced code blocks are examples, not markers. Bytes outside regions are never changed,
and a body is written with the line ending of its BEGIN line, so CRLF files stay CRLF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from matrix.errors import MarkerError
from matrix.fences import Fences, split_lines

BEGIN = re.compile(r"<!--\s*BEGIN GENERATED:\s*(?P<id>[^\s>]+)(?:\s+[^>]*?)?\s*-->")
END = re.compile(r"<!--\s*END GENERATED:\s*(?P<id>[^\s>]+)\s*-->")
HINT = "each region is `<!-- BEGIN GENERATED: id -->` ... `<!-- END GENERATED: id -->`, each marker on its own line"


@dataclass(frozen=True)
class Region:
    id: str
    path: str
    begin_line: int
    end_line: int
    body_start: int  # character offsets of the body in the file's text
    body_end: int
    newline: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.begin_line}"


@dataclass(frozen=True)
class _Open:
    id: str
    line: int
    body_start: int
    newline: str


def _marker(line: str, path: str, number: int) -> tuple[str, str] | None:
    stripped = line.strip()
    if not stripped.startswith("<!--") or ("BEGIN GENERATED" not in stripped and "END GENERATED" not in stripped):
        return None
    for kind, pattern in (("BEGIN", BEGIN), ("END", END)):
        match = pattern.fullmatch(stripped)
        if match:
            return kind, match.group("id")
    raise MarkerError(f"{path}:{number}: malformed marker {stripped!r}; {HINT}")


def find_regions(text: str, path: str) -> list[Region]:
    regions: list[Region] = []
    fences, current, offset = Fences(), None, 0
    for number, line in enumerate(split_lines(text), start=1):
        in_code = current is None and fences.inside(line)
        marker = None if in_code else _marker(line, path, number)
        if marker and marker[0] == "BEGIN":
            if current is not None:
                raise MarkerError(f"{path}:{number}: BEGIN GENERATED: {marker[1]} is nested inside "
                                  f"region {current.id!r} opened at line {current.line}; regions cannot nest")
            newline = "\r\n" if line.endswith("\r\n") else "\n"
            current = _Open(marker[1], number, offset + len(line), newline)
        elif marker and current is None:
            raise MarkerError(f"{path}:{number}: END GENERATED: {marker[1]} has no BEGIN before it; {HINT}")
        elif marker:
            if marker[1] != current.id:
                raise MarkerError(f"{path}:{number}: END GENERATED: {marker[1]} closes region {current.id!r} "
                                  f"opened at line {current.line}; write `<!-- END GENERATED: {current.id} -->`")
            regions.append(Region(current.id, path, current.line, number, current.body_start, offset, current.newline))
            current = None
        offset += len(line)
    if current is not None:
        raise MarkerError(f"{path}:{current.line}: BEGIN GENERATED: {current.id} has no END; "
                          f"add `<!-- END GENERATED: {current.id} -->` after the region")
    return regions


def validate(regions: Iterable[Region], known_ids: Iterable[str]) -> None:
    """Every region's id is registered, no id occurs twice, and every registered id occurs."""
    known, seen = list(known_ids), {}
    for region in regions:
        if region.id not in known:
            raise MarkerError(f"{region.where}: unknown generated region {region.id!r}; known ids: {', '.join(known)}")
        if region.id in seen:
            raise MarkerError(f"{region.where}: duplicate generated region {region.id!r}, "
                              f"also at {seen[region.id].where}; keep one of them")
        seen[region.id] = region
    missing = [region_id for region_id in known if region_id not in seen]
    if missing:
        raise MarkerError(
            f"generated region(s) {', '.join(missing)} registered in matrix/targets.py but found in no docs page; "
            f"add `<!-- BEGIN GENERATED: {missing[0]} -->` and `<!-- END GENERATED: {missing[0]} -->` to a page"
        )


def body_in_file(body: str, region: Region) -> str:
    """A rendered body (LF) in the line endings of the region's file."""
    return body.replace("\n", region.newline)


def is_stale(text: str, region: Region, body: str) -> bool:
    return text[region.body_start:region.body_end] != body_in_file(body, region)


def splice(text: str, regions: list[Region], bodies: Mapping[str, str]) -> str:
    """The text with each region's body replaced; every byte outside the regions kept."""
    out, last = [], 0
    for region in sorted(regions, key=lambda r: r.body_start):
        out.append(text[last:region.body_start])
        out.append(body_in_file(bodies[region.id], region))
        last = region.body_end
    out.append(text[last:])
    return "".join(out)
