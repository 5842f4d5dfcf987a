"""Hand-written pages say the engine is not available yet; these tests fail the day that stops being true.

Whoever lands `LLM`, `tandem generate` or `tandem serve` then updates the warning on the page
named in the failure (and the expectation here).
"""

import pytest
from matrix_helpers import ROOT

import runtime
from runtime.cli import SUBCOMMANDS


def llm_is_importable() -> bool:
    try:
        return getattr(runtime, "LLM", None) is not None
    except ImportError:
        return False


CLAIMS = [
    # (page, warning it carries while the feature is missing, whether the feature exists)
    ("docs/serving.md", "`tandem serve` does not exist yet", lambda: "serve" in SUBCOMMANDS),
]


@pytest.mark.parametrize("page, warning, exists", CLAIMS)
def test_not_available_warnings_match_the_code(page, warning, exists):
    warns = warning in (ROOT / page).read_text(encoding="utf-8")
    if exists():
        assert not warns, f"{page} still says {warning!r}, but it exists now: update the page"
    else:
        assert warns, f"{page} must say {warning!r} while it does not exist"
