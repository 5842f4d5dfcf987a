"""Hand-written pages once said commands were "not available yet"; no page may say so of a command that exists.

`tandem generate` and `tandem serve` have landed and their pages were rewritten; this keeps a
stale warning from coming back.
"""

import re
from pathlib import Path

import pytest
from matrix_helpers import ROOT

from runtime.cli import SUBCOMMANDS


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_no_page_says_an_existing_command_is_missing(command):
    claim = f"`tandem {command}` does not exist"
    stale = [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").rglob("*.md"))
             if claim in page.read_text(encoding="utf-8")]
    assert not stale, f"{', '.join(stale)} still say {claim!r}, but it exists: update the page"


def paragraphs(page: str) -> list[str]:
    return [" ".join(p.split()) for p in (ROOT / "docs" / page).read_text(encoding="utf-8").split("\n\n")]


def test_the_home_page_lists_planned_architectures_as_planned():
    from matrix.collect import declarations
    from runtime.models.interface import Status

    page = " ".join((ROOT / "docs/index.md").read_text(encoding="utf-8").split())
    def names(listing: str) -> set[str]:
        return set(re.split(r", | and ", listing))

    runs = names(page.split("The engine runs ", 1)[1].split(" models.", 1)[0])
    planned = names(page.split("The engine runs ", 1)[1].split(" models. ", 1)[1].split(" are planned:", 1)[0])
    for decl in declarations():
        running = decl.capabilities.engine.status in (Status.SUPPORTED, Status.PARTIAL)
        assert decl.model_name in (runs if running else planned), decl.model_name
        assert decl.model_name not in (planned if running else runs), decl.model_name


def test_the_default_pool_size_is_stated_as_the_code_computes_it():
    from runtime.cache import pool

    page = (ROOT / "docs/usage/offline_inference.md").read_text(encoding="utf-8")
    assert "90% of free memory" not in page and "90 % of free memory" not in page
    headroom = round((1 - pool.GPU_MEMORY_UTILIZATION) * 100)
    assert f"its free memory at start-up less {headroom}% of its total" in page
    assert f"{pool.CPU_CACHE_BYTES // 1024**3}GiB on the CPU" in page


def test_the_serving_examples_name_the_model_the_server_serves():
    page = (ROOT / "docs/serving.md").read_text(encoding="utf-8")
    served = re.search(r"\.venv/bin/tandem serve (\S+)\n", page).group(1)
    names = re.findall(r'"model": "([^"]+)"', page) + re.findall(r'model="([^"]+)"', page)
    assert names and set(names) == {Path(served).name}
