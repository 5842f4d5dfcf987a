"""The docs tree as the tooling sees it: every markdown file, its regions, and what render would write."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from matrix import diagram, lint
from matrix.errors import UsageError
from matrix.files import read_text
from matrix.splice import Region, find_regions, is_stale, splice, validate
from matrix.targets import IDS, render_all
from matrix.vocabulary import show_invisible

DEFAULT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DocFile:
    path: Path
    display: str  # relative to the repository root, e.g. docs/models/supported_models.md
    text: str
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class Result:
    """One file: its text now, what render would write, and why they differ."""

    doc: DocFile
    expected: str
    stale: tuple[str, ...]
    findings: tuple[lint.Finding, ...]

    @property
    def changed(self) -> bool:
        return self.expected != self.doc.text

    def diff(self) -> str:
        lines = difflib.unified_diff(
            self.doc.text.splitlines(keepends=True),
            self.expected.splitlines(keepends=True),
            fromfile=f"a/{self.doc.display}",
            tofile=f"b/{self.doc.display}",
        )
        # Invisible characters (U+FE0E, zero-width, CR) are shown as <U+XXXX>, or two lines would look equal.
        return "".join(show_invisible(line.rstrip("\n")) + "\n" for line in lines)


def docs_dir(root: Path) -> Path:
    path = root / "docs"
    if not path.is_dir():
        raise UsageError(f"no docs/ directory under {root}; run from the repository or pass --root")
    return path


def display(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def read_docs(root: Path) -> list[DocFile]:
    """Every markdown file under docs/, sorted, with its regions; markers validated across all files."""
    docs = []
    for path in sorted(docs_dir(root).rglob("*.md")):
        shown = display(path, root)
        text = read_text(path, shown)
        docs.append(DocFile(path, shown, text, tuple(find_regions(text, shown))))
    validate((region for doc in docs for region in doc.regions), IDS)
    return docs


def examine(root: Path) -> list[Result]:
    docs = read_docs(root)
    bodies = render_all(root)
    results = []
    for doc in docs:
        spliced = splice(doc.text, list(doc.regions), bodies)
        results.append(Result(
            doc,
            expected=lint.fix(spliced),
            stale=tuple(r.id for r in doc.regions if is_stale(doc.text, r, bodies[r.id])),
            findings=tuple(lint.findings_in(doc.text, doc.display)),
        ))
    return results + examine_pictures(root)


def examine_pictures(root: Path) -> list[Result]:
    """The generated SVG files (matrix/diagram.py): whole files, stale when they differ from a fresh drawing."""
    results = []
    for picture in diagram.pictures(root):
        path = root / picture.path
        text = read_text(path, picture.path.as_posix()) if path.is_file() else ""
        doc = DocFile(path, picture.path.as_posix(), text, ())
        results.append(Result(doc, expected=picture.svg, stale=("page-pool diagram",) if text != picture.svg else (),
                              findings=()))
    return results
