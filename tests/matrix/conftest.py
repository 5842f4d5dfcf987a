"""Fixtures for the docs tooling: a scratch copy of the docs, the CLI in-process, a built site."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from matrix_helpers import ROOT, Ran, mkdocs_build

from matrix.cli import main


@pytest.fixture
def cli(capsys):
    """Runs `python -m matrix ARGS` in this process (so monkeypatched declarations count)."""

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse usage errors
            code = exit.code
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


@pytest.fixture
def root(tmp_path) -> Path:
    """A scratch repository root holding a copy of docs/ and tests/ (the proofs); the real ones are never edited."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The repository's own docs, built once with `mkdocs build --strict`."""
    site = tmp_path_factory.mktemp("site") / "site"
    result = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stdout + result.stderr
    return site
