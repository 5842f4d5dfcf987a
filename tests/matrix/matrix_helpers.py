"""Helpers shared by the docs-tooling tests (fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "matrix" / "mkdocs_hook.py"


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) >= count, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count), encoding="utf-8")


def add_proof(root: Path, *names: str) -> Path:
    """A test file under root/tests marked as proving `names` (architectures and claims)."""
    path = root / "tests" / f"test_proof_{len(list((root / 'tests').glob('test_proof_*.py')))}.py"
    arguments = ", ".join(f'"{name}"' for name in names)
    path.write_text(f"import pytest\n\n\n@pytest.mark.proves({arguments})\ndef test_it():\n    pass\n")
    return path


def site_config(root: Path) -> Path:
    """ROOT's mkdocs.yml pointed at root/docs, for building a scratch copy."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(root / "docs")
    config["hooks"] = [str(HOOK)]
    config_file = root / "mkdocs.yml"
    config_file.write_text(yaml.safe_dump(config))
    return config_file


def mkdocs_build(config_file: Path, site: Path, strict: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "-f", str(config_file), "-d", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the hook finds matrix/ and runtime/ by itself
    return subprocess.run(command + (["--strict"] if strict else []), capture_output=True, text=True, env=env, cwd=ROOT)
