"""The install pulls what the runtime needs; the docs toolchain is an extra that the test extra includes."""

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).parents[1]
DOCS_TOOLS = ("mkdocs", "mkdocs-material", "pillow")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("==")[0].split("[")[0].strip().lower() for r in requirements}


def test_the_runtime_dependencies_hold_no_docs_tooling():
    runtime = names(project()["dependencies"])
    assert not runtime & set(DOCS_TOOLS), runtime & set(DOCS_TOOLS)
    assert "jinja2" in runtime  # chat templates (transformers) and `tandem matrix render` need it


def test_the_docs_extra_has_the_site_tools_and_the_test_extra_includes_it():
    extras = project()["optional-dependencies"]
    assert {"mkdocs", "mkdocs-material"} <= names(extras["docs"])
    assert "tandem[docs]" in extras["test"]


def test_only_the_mkdocs_hook_imports_mkdocs():
    importers = []
    for path in sorted([*ROOT.glob("runtime/**/*.py"), *ROOT.glob("matrix/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] in ("mkdocs", "material", "PIL") for m in modules):
                importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["matrix/mkdocs_hook.py"]
