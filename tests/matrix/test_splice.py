"""Markers: each kind of breakage exits 2 with a clear message; writes keep every byte outside them."""

import os

import pytest
from matrix_helpers import edit

from matrix.files import write_atomic
from matrix.splice import find_regions, splice

PAGE = "docs/models/supported_models.md"
BEGIN = "<!-- BEGIN GENERATED: supported-models (do not edit; run `tandem matrix render`) -->"
END = "<!-- END GENERATED: supported-models -->"


def region(region_id: str, body: str = "stale\n") -> str:
    return f"<!-- BEGIN GENERATED: {region_id} -->\n{body}<!-- END GENERATED: {region_id} -->\n"


BREAKAGES = {
    "missing END": (
        lambda root: edit(root / PAGE, END + "\n", ""),
        "{PAGE}:{begin}: BEGIN GENERATED: supported-models has no END; add `" + END + "`",
    ),
    "END without BEGIN": (
        lambda root: edit(root / PAGE, BEGIN + "\n", ""),
        "END GENERATED: supported-models has no BEGIN before it",
    ),
    "mismatched END": (
        lambda root: edit(root / PAGE, END, "<!-- END GENERATED: v1-features -->"),
        "END GENERATED: v1-features closes region 'supported-models' opened at line {begin}",
    ),
    "unknown id": (
        lambda root: (root / "docs/extra.md").write_text(region("supported-model")),
        "docs/extra.md:1: unknown generated region 'supported-model'; known ids: supported-models,",
    ),
    "duplicate id in one file": (
        lambda root: edit(root / PAGE, "## Text generation\n", "## Text generation\n\n" + region("supported-models")),
        "{PAGE}:{begin_plus_4}: duplicate generated region 'supported-models', also at {PAGE}:{begin}; keep one",
    ),
    "duplicate id in two files": (
        lambda root: (root / "docs/extra.md").write_text("# Extra\n\n" + region("cache-layout")),
        "docs/extra.md:3: duplicate generated region 'cache-layout', also at docs/cache_layout.md:",
    ),
    "nested regions": (
        lambda root: edit(root / PAGE, "| Architecture |", region("cache-layout") + "| Architecture |"),
        "BEGIN GENERATED: cache-layout is nested inside region 'supported-models' opened at line {begin}",
    ),
    "malformed marker": (
        lambda root: edit(root / PAGE, END, "<!-- END GENERATED -->"),
        "malformed marker '<!-- END GENERATED -->'",
    ),
}


@pytest.mark.parametrize("command", ["check", "render"])
@pytest.mark.parametrize("breakage", BREAKAGES)
def test_broken_markers_exit_2_with_a_clear_message(cli, root, command, breakage):
    breaking, message = BREAKAGES[breakage]
    begin = (root / PAGE).read_text(encoding="utf-8").split("\n").index(BEGIN) + 1
    message = message.format(PAGE=PAGE, begin=begin, begin_plus_4=begin + 4)
    breaking(root)
    before = (root / PAGE).read_bytes()
    ran = cli(command, "--root", str(root))
    assert ran.code == 2, ran.out + ran.err
    assert message in ran.err
    assert (root / PAGE).read_bytes() == before, "a failed render wrote nothing"


def test_a_registered_region_on_no_page_exits_2(cli, root):
    text = (root / "docs/cache_layout.md").read_text(encoding="utf-8")
    regions = find_regions(text, "docs/cache_layout.md")
    table = next(r for r in regions if r.id == "cache-layout")
    lines = text.split("\n")
    del lines[table.begin_line - 1:table.end_line]
    (root / "docs/cache_layout.md").write_text("\n".join(lines), encoding="utf-8")
    ran = cli("check", "--root", str(root))
    assert ran.code == 2
    assert "generated region(s) cache-layout registered in matrix/targets.py but found in no docs page" in ran.err


def test_markers_inside_code_blocks_are_examples(cli, root):
    example = "```markdown\n" + region("supported-models", "| Llama | ✅ |\n") + "```\n"
    (root / "docs/example.md").write_text("# Example\n\n" + example, encoding="utf-8")
    assert cli("check", "--root", str(root)).code == 0


def test_splice_keeps_every_byte_outside_the_markers():
    outside_before = "\ufeffTitle  \n\tindented\r\nno blank line before\n"
    outside_after = "\nafter, with trailing spaces   \nand no final newline"
    text = outside_before + region("x", "old\nbody\n") + outside_after
    new = splice(text, find_regions(text, "t.md"), {"x": "new\n"})
    assert new == outside_before + region("x", "new\n") + outside_after


def test_a_crlf_file_stays_crlf_and_keeps_its_bytes(cli, root):
    page = root / PAGE
    lf = page.read_bytes()
    crlf = lf.replace(b"\n", b"\r\n")
    page.write_bytes(crlf)
    assert cli("check", "--root", str(root)).code == 0, "a fresh CRLF file is fresh"

    stale = crlf.replace("| ❌ | ❌ |".encode(), "| ✅ | ✅ |".encode(), 1)
    page.write_bytes(stale)
    assert cli("check", "--root", str(root)).code == 1
    assert cli("render", "--root", str(root)).code == 0
    assert page.read_bytes() == crlf
    assert cli("check", "--root", str(root)).code == 0


def test_rendering_twice_is_byte_identical(cli, root):
    edit(root / "docs/cache_layout.md", "| `ai21labs/Jamba-v0.1` |", "| `stale` |")
    assert cli("render", "--root", str(root)).code == 0
    first = {p: p.read_bytes() for p in sorted((root / "docs").rglob("*.md"))}
    ran = cli("render", "--root", str(root))
    assert ran.code == 0 and ran.out == "docs are up to date\n"
    assert {p: p.read_bytes() for p in sorted((root / "docs").rglob("*.md"))} == first


def test_a_failed_write_leaves_the_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "page.md"
    target.write_text("original\n")
    target.chmod(0o640)

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, "new\n")
    assert target.read_text() == "original\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]

    monkeypatch.undo()
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]
