"""The page-pool diagrams: drawn from the layout the runtime computes, and kept fresh like the tables."""

import re
import xml.etree.ElementTree as ET

import pytest
from matrix_helpers import ROOT, mkdocs_build, site_config

from matrix.configs import CONFIGS_DIR, engine_config
from matrix.diagram import EXAMPLES, SEQUENCE_TOKENS, image_path, pictures
from runtime.cache.layout import cdiv

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_diagram_draws_the_runtime_layout(name):
    layout = engine_config(ROOT / CONFIGS_DIR / name).cache
    svg = (ROOT / image_path(name)).read_text(encoding="utf-8")
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]
    # One box per layer, named by its kind; one box per page id of a sequence; the page's contents.
    assert [t for t in titles if t.startswith("layer ")] == [
        f"layer {i}: {kind.value}" for i, kind in enumerate(layout.layers)]
    pages = [t for t in titles if re.fullmatch(r"(attention group \d+, block \d+|state group \d+)", t)]
    assert len(pages) == layout.pages_per_sequence(SEQUENCE_TOKENS)
    assert sum(t.startswith("attention group") for t in pages) == (
        layout.num_attention_groups * cdiv(SEQUENCE_TOKENS, layout.block_size))
    assert f"takes {layout.pages_per_sequence(SEQUENCE_TOKENS)} page ids" in svg
    assert f"One page: {layout.page_size_bytes:,} B" in svg
    padding = layout.page_size_bytes - layout.mamba.unpadded_page_size_bytes
    assert f"padding: {padding:,} B" in titles
    assert f"K and V of {layout.block_size} tokens x {layout.attention.bytes_per_token:,} B" in titles


def test_the_cache_layout_page_shows_every_diagram():
    page = (ROOT / "docs/cache_layout.md").read_text(encoding="utf-8")
    for name in EXAMPLES:
        assert f"](images/page_pool/{name}.svg)" in page


def test_a_stale_or_missing_diagram_fails_the_check_until_render(cli, root):
    first, second = (root / image_path(name) for name in EXAMPLES[:2])
    first.write_text(first.read_text(encoding="utf-8").replace("page ids", "pages"), encoding="utf-8")
    second.unlink()

    stale = cli("check", "--root", str(root))
    assert stale.code == 1
    assert f"{image_path(EXAMPLES[0]).as_posix()}: generated region 'page-pool diagram' is stale" in stale.out
    assert f"{image_path(EXAMPLES[1]).as_posix()}: generated region 'page-pool diagram' is stale" in stale.out
    assert "run `tandem matrix render" in stale.out

    assert cli("render", "--root", str(root)).code == 0
    assert {p.path: p.svg for p in pictures(root)} == {
        image_path(name): (root / image_path(name)).read_text(encoding="utf-8") for name in EXAMPLES}
    assert cli("check", "--root", str(root)).code == 0


def test_a_stale_diagram_fails_the_strict_build(root, tmp_path):
    path = root / image_path(EXAMPLES[0])
    path.write_text(path.read_text(encoding="utf-8").replace("page ids", "pages"), encoding="utf-8")
    result = mkdocs_build(site_config(root), tmp_path / "site")
    assert result.returncode != 0
    assert f"{image_path(EXAMPLES[0]).as_posix()} is stale" in result.stdout + result.stderr
