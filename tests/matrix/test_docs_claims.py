"""Hand-written pages once said commands were "not available yet"; no page may say so of a command that exists.

`tandem generate` and `tandem serve` have landed and their pages were rewritten; this keeps a
stale warning from coming back.
"""

import pytest
from matrix_helpers import ROOT

from runtime.cli import SUBCOMMANDS


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_no_page_says_an_existing_command_is_missing(command):
    claim = f"`tandem {command}` does not exist"
    stale = [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").rglob("*.md"))
             if claim in page.read_text(encoding="utf-8")]
    assert not stale, f"{', '.join(stale)} still say {claim!r}, but it exists: update the page"
