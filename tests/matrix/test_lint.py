"""The glyph linter catches every non-canonical variant, reports file:line:col with codepoints, and fixes it."""

import pytest
from matrix_helpers import edit

from matrix import lint
from matrix.vocabulary import CANONICAL, FAMILY_LEGEND, MATRIX_LEGEND, NOT_APPLICABLE, UNKNOWN

VARIANTS = [
    # (cell as written, code, codepoints reported, canonical cell)
    ("✅\ufe0e", "G001", "U+2705 U+FE0E", "✅"),
    ("✅\ufe0f", "G001", "U+2705 U+FE0F", "✅"),
    ("❌\ufe0e", "G001", "U+274C U+FE0E", "❌"),
    ("🚧\ufe0f", "G001", "U+1F6A7 U+FE0F", "🚧"),
    ("❓\ufe0e", "G001", "U+2753 U+FE0E", "❓"),
    ("\ufe0e", "G002", "U+FE0E", ""),
    ("\ufe0f", "G002", "U+FE0F", ""),
    ("✅\u200b", "G003", "U+200B", "✅"),
    ("\u200c✅", "G003", "U+200C", "✅"),
    ("✅\u200d", "G003", "U+200D", "✅"),
    ("✅\u2060", "G003", "U+2060", "✅"),
    ("\ufeff✅", "G003", "U+FEFF", "✅"),
    ("✔", "G004", "U+2714", "✅"),
    ("✓", "G004", "U+2713", "✅"),
    ("☑", "G004", "U+2611", "✅"),
    ("✔\ufe0f", "G004", "U+2714 U+FE0F", "✅"),
    ("✖", "G004", "U+2716", "❌"),
    ("✗", "G004", "U+2717", "❌"),
    ("❎", "G004", "U+274E", "❌"),
]


@pytest.mark.parametrize("written, code, codepoints, canonical", VARIANTS)
def test_each_variant_in_a_table_cell_is_found_and_fixed(written, code, codepoints, canonical):
    text = f"# Page\n\n| Model | LoRA |\n| --- | :-: |\n| Llama | {written} |\n"
    findings = lint.findings_in(text, "docs/page.md")
    assert len(findings) == 1
    found = findings[0]
    # A zero-width character is reported alone; the glyph next to it is fine.
    sequence = written.replace("✅", "") if code == "G003" else written
    assert (found.line, found.code, found.sequence) == (5, code, sequence)
    assert found.format().startswith(f"docs/page.md:5:{found.col}: {code} {codepoints}: ")
    assert lint.fix(text) == f"# Page\n\n| Model | LoRA |\n| --- | :-: |\n| Llama | {canonical} |\n"
    assert lint.findings_in(lint.fix(text)) == []


def test_the_column_counts_characters_from_one():
    [found] = lint.findings_in("| Llama | ✅ | ❌\ufe0e |\n")
    assert found.col == len("| Llama | ✅ | ") + 1


def test_lookalikes_outside_tables_and_in_code_blocks_are_left_alone():
    text = "We write ✓ in prose.\n\n```markdown\n| Llama | ✔ |\n```\n"
    assert lint.findings_in(text) == []


def test_selectors_and_zero_width_characters_are_found_everywhere():
    text = "A ✅\ufe0e in prose.\n\n```text\nzero\u200bwidth\n```\n"
    assert [(f.line, f.code) for f in lint.findings_in(text)] == [(1, "G001"), (4, "G003")]


def test_canonical_text_and_every_canonical_glyph_are_clean():
    glyphs = [g.char for g in (*MATRIX_LEGEND, UNKNOWN, NOT_APPLICABLE, *FAMILY_LEGEND)]
    assert set(glyphs) == CANONICAL
    text = "| a | " + " | ".join(glyphs) + " |\n"
    assert lint.findings_in(text) == []


def test_lint_reports_file_line_col_and_the_fix_command_then_fixes(cli, tmp_path):
    page = tmp_path / "page.md"
    table = "# Title\n\n| Model | V1 |\n| --- | :-: |\n"
    page.write_text(table + "| Bamba | ✅\ufe0e |\n| Llama | ✔️ |\n", encoding="utf-8")
    ran = cli("lint", str(page))
    assert ran.code == 1
    assert f"{page}:5:11: G001 U+2705 U+FE0E: variation selector after the status glyph ✅" in ran.out
    assert f"{page}:6:11: G004 U+2714 U+FE0F: lookalike ✔ (HEAVY CHECK MARK) in a table cell; use ✅ U+2705" \
        in ran.out
    assert f"run `tandem matrix lint --fix {page}`" in ran.out

    fixed = cli("lint", "--fix", str(page))
    assert fixed.code == 0 and f"fixed 2 glyphs in {page}" in fixed.out
    assert page.read_text(encoding="utf-8") == table + "| Bamba | ✅ |\n| Llama | ✅ |\n"
    assert cli("lint", str(page)).code == 0


def test_check_lints_hand_written_pages_and_render_fixes_them(cli, root):
    page = root / "docs/contributing.md"
    edit(page, "| G001 |", "| G001 ✔ |")
    edit(page, "# Contributing", "# Contributing\u200b")
    ran = cli("check", "--root", str(root))
    assert ran.code == 1
    assert "docs/contributing.md:1:15: G003 U+200B: zero-width character (ZERO WIDTH SPACE)" in ran.out
    assert ": G004 U+2714: lookalike ✔" in ran.out
    assert "0 stale regions and 2 non-canonical glyphs in 1 file;" in ran.out
    assert cli("render", "--root", str(root)).code == 0
    assert cli("check", "--root", str(root)).code == 0
    assert "| G001 ✅ |" in page.read_text(encoding="utf-8")


def test_a_byte_order_mark_is_reported_and_removed(cli, root):
    page = root / "docs/serving.md"
    original = page.read_bytes()
    page.write_bytes(b"\xef\xbb\xbf" + original)
    ran = cli("check", "--root", str(root))
    assert ran.code == 1 and "docs/serving.md:1:1: G003 U+FEFF" in ran.out
    assert cli("render", "--root", str(root)).code == 0
    assert page.read_bytes() == original
