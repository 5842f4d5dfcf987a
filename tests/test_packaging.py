"""The install pulls what the runtime needs; the docs toolchain and Triton are extras that the test extra includes."""

import ast
import os
import subprocess
import sys
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


def test_triton_is_an_extra_for_the_gpu_kernels_and_the_tests():
    extras = project()["optional-dependencies"]
    assert "triton" not in names(project()["dependencies"])  # about 1 GB that a CPU-only install never runs
    assert "triton" in names(extras["gpu"])
    assert "tandem[gpu]" in extras["test"]  # the kernel tests run Triton's interpreter on the CPU


# Runs in a child with `import triton` failing, as in a CPU-only install: the engine generates, and
# asking for the Triton kernels names the extra that brings them.
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError
import torch
from runtime import LLM, SamplingParams, kernels
out = LLM().generate(["Tandem is"], SamplingParams(temperature=0, max_tokens=8))
assert out[0].outputs[0].token_ids, out
assert kernels.backend == "torch", kernels.backend
for device in ("cpu", "cuda"):
    try:
        kernels.resolve_backend("triton", torch.device(device))
    except ValueError as e:
        print(e)
"""


@pytest.mark.slow
def test_the_cpu_engine_runs_without_triton():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TANDEM_KERNEL_BACKEND": "auto"})
    assert result.returncode == 0, result.stderr[-3000:]
    refusals = result.stdout.strip().splitlines()[-2:]
    assert len(refusals) == 2 and all("pip install 'tandem[gpu]'" in line for line in refusals), result.stdout


def test_the_wheel_carries_the_native_kernels_sources(tmp_path):
    """A non-editable install compiles the native kernels on first use: the wheel must hold their sources."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    import zipfile

    (wheel,) = tmp_path.glob("tandem-*.whl")
    names_in_wheel = set(zipfile.ZipFile(wheel).namelist())
    for name in ("cpu_native.c", "ops.cpp", "tandem_cpu.h"):
        assert f"runtime/kernels/csrc/{name}" in names_in_wheel
