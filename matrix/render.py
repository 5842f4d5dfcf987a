"""The Jinja2 environment and the rendering of one generated region's body."""

from __future__ import annotations

import functools
import unicodedata
from pathlib import Path
from typing import Any, Mapping

import jinja2

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"


@functools.cache
def environment() -> jinja2.Environment:
    # Markdown, not HTML: no autoescaping. StrictUndefined turns a typo into an error, not an empty cell.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, context: Mapping[str, Any]) -> str:
    """The region body: NFC text with no trailing spaces, set off by one blank line at each end.

    The blank lines keep the markers' HTML comments from running into a table or list in
    any markdown renderer (GitHub's included).
    """
    text = unicodedata.normalize("NFC", environment().get_template(template).render(**context))
    assert text.strip("\n"), f"{template}: rendered nothing"
    assert all(line == line.rstrip() for line in text.split("\n")), f"{template}: trailing whitespace"
    assert "\r" not in text
    return "\n" + text.strip("\n") + "\n\n"
