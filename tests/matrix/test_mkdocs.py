"""`mkdocs build --strict`: green on the repository, red on a stale table, aborted by broken markers."""

from matrix_helpers import ROOT, edit, mkdocs_build, site_config

PAGE = "docs/models/supported_models.md"


def docs_bytes(root):
    return {p: p.read_bytes() for p in sorted((root / "docs").rglob("*")) if p.is_file()}


def test_the_repository_builds_strict_and_the_build_writes_nothing_into_docs(built_site):
    page = (built_site / "models/supported_models.html").read_text(encoding="utf-8")
    assert "<table>" in page and "BambaForCausalLM" in page
    for name in ("index", "usage/v1_guide", "usage/offline_inference", "serving", "cache_layout",
                 "architecture", "contributing", "configs/SOURCES"):
        assert (built_site / f"{name}.html").is_file(), name
    assert "Mamba page padded by" in (built_site / "index.html").read_text(encoding="utf-8")


def test_building_leaves_docs_untouched(root, tmp_path):
    before = docs_bytes(root)
    result = mkdocs_build(site_config(root), tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert docs_bytes(root) == before


def test_a_stale_table_fails_the_strict_build_but_is_published_fresh(root, tmp_path):
    edit(root / PAGE, "| `LlamaForCausalLM` | Llama |", "| `LlamaForCausalLM` | Llama (stale) |")
    strict = mkdocs_build(site_config(root), tmp_path / "strict")
    assert strict.returncode != 0
    assert f"{PAGE}: generated region 'supported-models' is stale; run `tandem matrix render`" in strict.stderr
    assert "Aborted with 1 warnings in strict mode!" in strict.stdout + strict.stderr

    lenient = mkdocs_build(site_config(root), tmp_path / "lenient", strict=False)
    assert lenient.returncode == 0, lenient.stderr
    html = (tmp_path / "lenient/models/supported_models.html").read_text(encoding="utf-8")
    assert "Llama (stale)" not in html and "<code>LlamaForCausalLM</code>" in html


def test_a_non_canonical_glyph_fails_the_strict_build(root, tmp_path):
    edit(root / "docs/serving.md", "# Serving", "# Serving ✅\ufe0f")
    result = mkdocs_build(site_config(root), tmp_path / "site")
    assert result.returncode != 0
    assert "docs/serving.md:1:11: G001 U+2705 U+FE0F" in result.stderr


def test_broken_markers_abort_even_a_lenient_build(root, tmp_path):
    edit(root / PAGE, "<!-- END GENERATED: supported-models -->\n", "")
    result = mkdocs_build(site_config(root), tmp_path / "site", strict=False)
    assert result.returncode != 0
    assert "BEGIN GENERATED: supported-models has no END" in result.stderr
    assert "Aborted with a BuildError!" in result.stdout + result.stderr


def test_mkdocs_yml_uses_the_hook_and_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "  - matrix/mkdocs_hook.py" in config and "name: material" in config
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {page for page in pages if f": {page}" not in config} == set()
