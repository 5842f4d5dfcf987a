"""mkdocs hook: every generated region is re-rendered at build time, so the site is never stale.

The committed region is replaced in memory only (writing into docs/ would make
`mkdocs serve` rebuild forever). A committed region that differs from the fresh one,
a non-canonical glyph, or a supported cell that no test proves, is logged as a warning
through the plugin logger, so `mkdocs build --strict` fails; broken markers abort any build.
In the HTML, each status glyph becomes an inline SVG with an accessible label (matrix/glyph_svg.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import get_plugin_logger

# mkdocs loads hooks by file path; a checkout that was not pip-installed still finds its packages.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from matrix import evidence, lint  # noqa: E402
from matrix.docs import examine_pictures, read_docs  # noqa: E402
from matrix.errors import MatrixError  # noqa: E402
from matrix.glyph_svg import replace_glyphs  # noqa: E402
from matrix.splice import find_regions, is_stale, splice  # noqa: E402
from matrix.targets import render_all  # noqa: E402

log = get_plugin_logger(__name__)
FIX = "run `tandem matrix render`"
_bodies: dict[str, str] = {}


def on_pre_build(config) -> None:
    """Validate every marker under docs/ and render every region once per build."""
    docs_dir = Path(config["docs_dir"])
    if docs_dir.name != "docs":
        raise PluginError(f"generated docs: docs_dir must be named docs (the tables read docs/configs), not {docs_dir}")
    root = docs_dir.parent
    try:
        read_docs(root)
        bodies = render_all(root)
        proofs = evidence.examine(root)
    except MatrixError as err:
        raise PluginError(f"generated docs: {err}") from None
    # An unproven supported cell fails a strict build, as `tandem matrix check` does; a proof ahead
    # of its declaration is only reported.
    for failure in proofs.failures:
        log.warning(failure)
    for picture in examine_pictures(root):
        if picture.changed:
            log.warning(f"{picture.doc.display} is stale; {FIX}")
    for warning in proofs.warnings:
        log.info(warning)
    _bodies.clear()
    _bodies.update(bodies)


def on_page_markdown(markdown: str, page, config, files) -> str:
    shown = f"docs/{page.file.src_uri}"
    try:
        regions = find_regions(markdown, shown)
    except MatrixError as err:
        raise PluginError(f"generated docs: {err}") from None
    for region in regions:
        if is_stale(markdown, region, _bodies[region.id]):
            log.warning(f"{shown}: generated region '{region.id}' is stale; {FIX}")
    for finding in lint.findings_in(markdown, shown):
        log.warning(f"{finding.format()}; {FIX}")
    return splice(markdown, regions, _bodies)


def on_page_content(html: str, page, config, files) -> str:
    """Each status glyph as a labelled inline SVG: the markdown keeps the Unicode glyph, and the page
    shows it without a colour emoji font (most Linux servers and CI images have none)."""
    return replace_glyphs(html)
