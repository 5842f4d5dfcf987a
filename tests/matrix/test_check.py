"""`matrix check` on the repository, and the check/render cycle after a declaration changes."""

import subprocess
import sys

import pytest
from matrix_helpers import ROOT, add_proof, edit

from matrix.splice import find_regions
from matrix.targets import IDS
from runtime.models import resolve
from runtime.models.bamba.declaration import BambaForCausalLM
from runtime.models.common import capabilities
from runtime.models.granite.declaration import GraniteForCausalLM
from runtime.models.interface import planned, supported
from runtime.models.llama.declaration import LlamaForCausalLM

LORA_NOTE = "LoRA on the attention and Mamba projections."


def snapshot(path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_repository_docs_are_fresh(cli):
    """Fails when a committed table is stale: run `tandem matrix render` and commit the result."""
    ran = cli("check")
    assert ran.code == 0, ran.out + ran.err
    assert ran.out.startswith("docs are up to date")


def test_a_changed_declaration_fails_the_check_until_render(cli, root, monkeypatch):
    real_docs = snapshot(ROOT / "docs")
    monkeypatch.setattr(BambaForCausalLM, "capabilities", capabilities(lora=supported(LORA_NOTE)))

    stale = cli("check", "--root", str(root))
    assert stale.code == 1
    assert "--- a/docs/models/supported_models.md" in stale.out
    assert "+| `BambaForCausalLM` | Bamba |" in stale.out
    assert f"{LORA_NOTE}" in stale.out
    assert "generated region 'supported-models' is stale" in stale.out
    assert "generated region 'v1-features' is stale" in stale.out
    assert f"run `tandem matrix render --root {root}`" in stale.out

    add_proof(root, "BambaForCausalLM", "LoRA")  # a supported cell needs a proving test
    assert cli("render", "--root", str(root)).code == 0
    assert cli("check", "--root", str(root)).code == 0
    table = (root / "docs/models/supported_models.md").read_text(encoding="utf-8")
    bamba = next(line for line in table.splitlines() if line.startswith("| `BambaForCausalLM`"))
    assert bamba.endswith("| ❌ | ✅<sup>4</sup> | 🚧<sup>1</sup> | `int8`, `int4`, `compressed-tensors`, `gguf` |")
    features = (root / "docs/usage/v1_guide.md").read_text(encoding="utf-8")
    assert f"Bamba: {LORA_NOTE}" in features
    assert snapshot(ROOT / "docs") == real_docs


FAMILY_ROW = "| Decoder-only attention | Granite, Llama |"


@pytest.mark.parametrize(
    "supported_models, planned_models, family_row",
    [
        ([LlamaForCausalLM, GraniteForCausalLM], [], f"{FAMILY_ROW} 🟢 Functional |  |"),
        (
            [LlamaForCausalLM],
            [GraniteForCausalLM],
            f"{FAMILY_ROW} 🟡 WIP | supported: Llama; planned: Granite<br>Granite: Not yet. |",
        ),
        ([], [LlamaForCausalLM, GraniteForCausalLM], f"{FAMILY_ROW} 🚧 Planned | Not yet. |"),
    ],
)
def test_family_status_follows_the_engine_status(cli, root, monkeypatch, supported_models, planned_models,
                                                 family_row):
    for model in supported_models:
        monkeypatch.setattr(model, "implementation", "runtime.models.llama.model:LlamaForCausalLM")
        monkeypatch.setattr(model, "capabilities", capabilities(supported()))
    for model in planned_models:
        monkeypatch.setattr(model, "implementation", None)
        monkeypatch.setattr(model, "capabilities", capabilities(planned("Not yet.")))
    guide = root / "docs/usage/v1_guide.md"
    # Start from a row that no status renders, so that only the render can write the expected one.
    committed = family_row_of(guide)
    edit(guide, committed, f"{FAMILY_ROW} stale | stale |")
    assert cli("render", "--root", str(root)).code == 0
    assert family_row_of(guide) == family_row


def family_row_of(page):
    rows = [line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith(FAMILY_ROW)]
    assert len(rows) == 1, rows
    return rows[0]


def test_a_hand_edited_glyph_is_shown_with_its_invisible_selector(cli, root):
    page = root / "docs/models/supported_models.md"
    edit(page, "| ❌ | ❌ |", "| ❌ | ❌\ufe0e |")
    ran = cli("check", "--root", str(root))
    assert ran.code == 1
    assert "-| `KimiLinearForCausalLM`" in ran.out and "| ❌ | ❌<U+FE0E> |" in ran.out
    assert "docs/models/supported_models.md:" in ran.out and ": G001 U+274C U+FE0E:" in ran.out
    assert cli("render", "--root", str(root)).code == 0
    assert "\ufe0e" not in page.read_text(encoding="utf-8")


def test_print_gives_each_committed_region(cli):
    bodies = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for region in find_regions(text, str(page)):
            bodies[region.id] = text[region.body_start:region.body_end]
    assert sorted(bodies) == sorted(IDS)
    for region_id, body in bodies.items():
        ran = cli("print", region_id)
        assert ran.code == 0 and ran.out == body


def test_print_of_an_unknown_id_is_a_usage_error(cli):
    ran = cli("print", "supported-modles")
    assert ran.code == 2
    assert "unknown generated region 'supported-modles'; known ids: supported-models," in ran.err


@pytest.fixture
def revalidate():
    resolve.cache_clear()
    yield
    resolve.cache_clear()


def test_a_bad_declaration_exits_3(cli, root, monkeypatch, revalidate):
    monkeypatch.setattr(BambaForCausalLM, "example_models", ())
    ran = cli("check", "--root", str(root))
    assert ran.code == 3
    assert "BambaForCausalLM: example_models: lists no checkpoint" in ran.err


def test_layer_kinds_without_a_family_exit_3(cli, root, monkeypatch):
    from runtime.models.interface import LayerKind

    monkeypatch.setattr(BambaForCausalLM, "layer_kinds", frozenset({LayerKind.MAMBA1, LayerKind.MAMBA2}))
    ran = cli("render", "--root", str(root))
    assert ran.code == 3
    assert "fit no model family" in ran.err and "matrix/families.py" in ran.err


@pytest.mark.parametrize("command", [["runtime", "matrix", "check"], ["matrix", "check"]])
def test_tandem_matrix_check_and_python_m_matrix_are_clean_on_the_repository(command):
    result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "docs are up to date" in result.stdout


def test_the_check_imports_no_torch():
    """The pre-commit hook runs the check: it reads declarations without importing torch (how long it
    takes is for bench/, never for an assertion)."""
    code = (
        "import sys\n"
        "from matrix.cli import main\n"
        "assert main(['check']) == 0\n"
        "assert 'torch' not in sys.modules, 'the check imported torch'\n"
        "assert 'transformers' not in sys.modules, 'the check imported transformers'\n"
        "print('checked without torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "checked without torch"


def test_a_root_without_docs_is_a_usage_error(cli, tmp_path):
    ran = cli("check", "--root", str(tmp_path))
    assert ran.code == 2
    assert f"no docs/ directory under {tmp_path}; run from the repository or pass --root" in ran.err


def test_a_kept_config_the_resolver_refuses_exits_3(cli, root):
    (root / "docs/configs/broken__Model").mkdir()
    (root / "docs/configs/broken__Model/config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    ran = cli("check", "--root", str(root))
    assert ran.code == 3
    assert "docs/configs/broken__Model: unknown architecture 'NoSuchForCausalLM'" in ran.err
