"""A ✅ must be earned: `matrix check` fails on a supported or partial cell that no test claims to prove."""

import pytest
from matrix_helpers import ROOT, add_proof, edit, mkdocs_build, site_config

from matrix import evidence
from matrix.claims import read_claims
from runtime.models.bamba.declaration import BambaForCausalLM
from runtime.models.common import ON_ENGINE, capabilities
from runtime.models.interface import partial, supported
from runtime.models.llama.declaration import LlamaForCausalLM
from runtime.models.minimax.declaration import MiniMaxForCausalLM

PAGE = "docs/models/evidence.md"
GRAPHS_NOTE = "Captured for decode steps only."


def test_every_supported_cell_of_the_repository_is_proven():
    proofs = evidence.examine(ROOT)
    assert proofs.failures == ()
    assert proofs.warnings == ()
    cells = evidence.cells(ROOT)
    needing = [cell for cell in cells if cell.support.status in evidence.NEEDS_PROOF]
    assert needing and all(cell.tests for cell in needing)
    assert proofs.num_proven == len(needing)


@pytest.mark.parametrize("model, overrides, cell, status", [
    # A feature cell: CUDA graphs flipped to supported with no test (as LoRA was in the example, before
    # LoRA landed with its tests).
    (LlamaForCausalLM, dict(chunked_prefill=supported(), cuda_graphs=supported()), ("LlamaForCausalLM", "CUDA graphs"),
     "supported"),
    # A partial cell.
    (BambaForCausalLM, dict(chunked_prefill=supported(), cuda_graphs=partial(GRAPHS_NOTE)),
     ("BambaForCausalLM", "CUDA graphs"), "partial"),
])
def test_an_unproven_feature_cell_fails_the_check_until_a_test_proves_it(cli, root, monkeypatch, model, overrides,
                                                                         cell, status):
    monkeypatch.setattr(model, "capabilities", capabilities(ON_ENGINE, **overrides))
    assert cli("render", "--root", str(root)).code == 0  # the tables are fresh: only the proof is missing

    ran = cli("check", "--root", str(root))
    architecture, claim = cell
    label = evidence.LABELS[claim]
    assert ran.code == 1
    assert (f"{architecture} {label}: the declaration says {status} but no test proves it; add a test marked "
            f'@pytest.mark.proves("{architecture}", "{claim}") or set the declaration to planned(...) in '
            f"{evidence.declaration_file(architecture)}") in ran.out
    assert "1 supported or partial cell with no proving test" in ran.out

    add_proof(root, architecture, claim)
    stale = cli("check", "--root", str(root))
    assert stale.code == 1 and "generated region 'evidence' is stale" in stale.out
    assert "with no proving test" not in stale.out
    assert cli("render", "--root", str(root)).code == 0
    assert cli("check", "--root", str(root)).code == 0
    page = (root / PAGE).read_text(encoding="utf-8")
    assert "- `tests/test_proof_0.py::test_it`" in page


def test_an_engine_cell_flipped_to_supported_fails_the_check(cli, root, monkeypatch):
    monkeypatch.setattr(MiniMaxForCausalLM, "implementation", "runtime.models.llama.model:LlamaForCausalLM")
    monkeypatch.setattr(MiniMaxForCausalLM, "capabilities", capabilities(ON_ENGINE))
    cli("render", "--root", str(root))
    ran = cli("check", "--root", str(root))
    assert ran.code == 1
    assert ("MiniMaxForCausalLM V1 (engine): the declaration says supported but no test proves it; add a test "
            'marked @pytest.mark.proves("MiniMaxForCausalLM", "engine") or set the declaration to planned(...) in '
            "runtime/models/minimax/declaration.py") in ran.out


def remove_chunked_prefill_proofs(root):
    # Both tests/engine/test_parity.py and test_scheduling.py prove chunked prefill, each with one decorator.
    for path in ("tests/engine/test_parity.py", "tests/engine/test_scheduling.py"):
        edit(root / path, "@pytest.mark.proves(", "@pytest.mark.slow(")


def test_removing_a_proof_fails_the_check(cli, root):
    remove_chunked_prefill_proofs(root)
    ran = cli("check", "--root", str(root))
    assert ran.code == 1
    unproven = [line for line in ran.out.splitlines() if "but no test proves it" in line]
    assert len(unproven) == 10 and all(" Chunked prefill: " in line for line in unproven)


def test_a_proof_of_a_planned_cell_is_reported_not_failed(cli, root):
    add_proof(root, "LlamaForCausalLM", "CUDA graphs")
    cli("render", "--root", str(root))
    ran = cli("check", "--root", str(root))
    assert ran.code == 0, ran.out
    assert ran.out.startswith("docs are up to date")
    assert ("warning: LlamaForCausalLM CUDA graphs: 1 test prove(s) it (e.g. tests/test_proof_0.py::test_it) but "
            "the declaration says planned; set it to supported() in runtime/models/llama/declaration.py") in ran.out


def test_a_typo_in_a_marker_exits_3_naming_the_file_and_line(cli, root):
    add_proof(root, "LlamaForCausalLM", "chunked-prefill")
    ran = cli("check", "--root", str(root))
    assert ran.code == 3
    assert ran.err.startswith("matrix: error: tests/test_proof_0.py:4: proves names 'chunked-prefill', which is "
                              "neither an architecture nor a claim (did you mean 'chunked prefill'?)")


def test_the_evidence_page_lists_the_tests_by_architecture_and_claim():
    page = (ROOT / PAGE).read_text(encoding="utf-8")
    bamba = page[page.index("### BambaForCausalLM"):page.index("### FalconH1ForCausalLM")]
    assert "**V1 (engine)**: ✅ supported, " in bamba
    assert "- `tests/engine/test_parity.py::test_greedy_tokens_and_logprobs_match_transformers[bamba]`" in bamba
    assert "**Chunked prefill**: ✅ supported, 2 tests\n\n- `tests/engine/test_parity.py::" in bamba
    assert "- `tests/engine/test_scheduling.py::test_chunked_prefill_equals_one_shot`" in bamba
    assert "| [`BambaForCausalLM`](#bambaforcausallm) | ✅ " in page
    assert "| `MiniMaxForCausalLM` | 🚧 | 🚧 | 🚧 | 🚧 | 🚧 | ❌ | ❌ |" in page  # nothing claimed, nothing to list


def test_an_unproven_cell_fails_the_strict_build(root, tmp_path):
    remove_chunked_prefill_proofs(root)
    result = mkdocs_build(site_config(root), tmp_path / "site")
    assert result.returncode != 0
    assert "LlamaForCausalLM Chunked prefill: the declaration says supported but no test proves it" in result.stderr


def test_the_built_evidence_page_links_each_row_to_its_section(built_site):
    html = (built_site / "models/evidence.html").read_text(encoding="utf-8")
    assert 'id="bambaforcausallm"' in html and 'href="#bambaforcausallm"' in html


def test_each_tiny_model_case_proves_its_own_architecture():
    """A case named after a tiny model (tests/tiny_models.py) can only prove that model's architecture."""
    from tiny_models import CONFIGS as TINY
    from tiny_models import FAMILY_CONFIGS

    CONFIGS = {**TINY, **FAMILY_CONFIGS}
    cases = [(claim.test.partition("[")[2].rstrip("]"), claim) for claim in read_claims(ROOT)]
    checked = [(CONFIGS[case][1], claim.architecture, claim.test) for case, claim in cases if case in CONFIGS]
    assert checked
    assert [c for c in checked if c[0] != c[1]] == []
