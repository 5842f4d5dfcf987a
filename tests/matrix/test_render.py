"""What the generator emits: deterministic, canonical, and equal to what the declarations and the resolver say."""

import unicodedata

import jinja2
import pytest
from matrix_helpers import ROOT

from matrix import lint
from matrix.cells import Footnotes, cell
from matrix.collect import MODEL_TABLE_FEATURES, declarations, supported_models
from matrix.configs import cache_layout
from matrix.render import render
from matrix.targets import render_all
from matrix.vocabulary import MATRIX, NOT_APPLICABLE, codepoints, show_invisible
from runtime.config import EngineConfig
from runtime.models import REGISTRY


def test_rendering_is_deterministic_canonical_and_nfc():
    first, second = render_all(ROOT), render_all(ROOT)
    assert first == second
    for region_id, body in first.items():
        assert unicodedata.is_normalized("NFC", body), region_id
        assert lint.findings_in(body) == [], region_id
        assert body.startswith("\n") and body.endswith("\n\n") and not body.endswith("\n\n\n"), region_id
        assert str(ROOT) not in body, f"{region_id} leaks an absolute path"


def test_templates_refuse_an_undefined_name():
    with pytest.raises(jinja2.UndefinedError):
        render("supported_models.md.j2", {"legend": [], "columns": [], "rows": []})


def test_a_pipe_in_a_cell_is_escaped():
    assert cell("attention | Mamba-2") == "attention \\| Mamba-2"
    assert cell("two\nlines") == "two lines"


def test_the_same_note_gets_the_same_footnote_number():
    notes = Footnotes()
    assert notes.mark("🚧", ["Needs a kernel."]) == "🚧<sup>1</sup>"
    assert notes.mark("❌", [None]) == "❌"
    assert notes.mark("🚧", ["Other."]) == "🚧<sup>2</sup>"
    assert notes.mark("🟡", ["Needs a  kernel.", "Other."]) == "🟡<sup>1, 2</sup>"
    assert [(n.number, n.text) for n in notes.notes] == [(1, "Needs a kernel."), (2, "Other.")]


def test_every_architecture_has_one_row_whose_cells_are_its_declared_statuses():
    table = supported_models(ROOT)
    assert [row[0] for row in table["rows"]] == [f"`{d.architecture}`" for d in declarations()]
    assert len(table["rows"]) == len(REGISTRY)
    notes = {n.number: n.text for n in table["notes"]}
    for decl, row in zip(declarations(), table["rows"]):
        supports = [decl.capabilities.engine] + [decl.capabilities.feature(f) for f in MODEL_TABLE_FEATURES]
        for support, status_cell in zip(supports, row[4:-1], strict=True):
            glyph, _, numbers = status_cell.partition("<sup>")
            assert glyph == MATRIX[support.status].char
            if support.note:
                assert notes[int(numbers.removesuffix("</sup>"))] == support.note
            else:
                assert not numbers
        # The last column: the quantization formats the declaration lists.
        assert row[-1] == (", ".join(f"`{f}`" for f in decl.quantizations) or "–")


def test_the_cache_layout_table_is_what_engine_config_resolves():
    table = cache_layout(ROOT)
    rows = {row[0]: row for row in table["rows"]}
    bamba = rows["`ibm-ai-platform/Bamba-9B`"]
    layout = EngineConfig(model=str(ROOT / "docs/configs/ibm-ai-platform__Bamba-9B"), dtype="bfloat16").cache
    assert bamba[3:] == [
        f"{layout.block_size:,}",
        f"{layout.mamba.unpadded_page_size_bytes:,}",
        f"{layout.attention.page_size_bytes:,}",
        f"{layout.mamba.padding_pct:.2f} %",
    ]
    # The numbers vLLM's own tests pin for these configs (see tests/runtime/test_plan.py).
    assert (bamba[3], rows["`tiiuae/Falcon-H1-0.5B-Instruct`"][3], rows["`ibm-granite/granite-4.0-h-tiny`"][3]) == (
        "528", "800", "400"
    )
    mamba = rows["`state-spaces/mamba-130m-hf`"]
    assert mamba[2:] == ["float32", NOT_APPLICABLE.char, "116,736", NOT_APPLICABLE.char, NOT_APPLICABLE.char]
    llama = rows["`meta-llama/Llama-3.2-1B`"]
    assert (llama[3], llama[4], llama[6]) == ("16", NOT_APPLICABLE.char, NOT_APPLICABLE.char)
    assert bamba[2] == "bfloat16<sup>1</sup>" and "states no dtype" in table["notes"][0].text


def test_codepoints_and_invisible_characters_are_spelled_out():
    assert codepoints("✅\ufe0e") == "U+2705 U+FE0E"
    assert show_invisible("| ✅\ufe0e |\u200b\r") == "| ✅<U+FE0E> |<U+200B><U+000D>"
