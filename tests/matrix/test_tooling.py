"""CI and pre-commit run the docs checks."""

import yaml
from matrix_helpers import ROOT


def test_ci_installs_chromium_before_running_the_tests():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    install = next(i for i, line in enumerate(lines) if "apt-get install -y chromium" in line)
    tests = next(i for i, line in enumerate(lines) if "python -m pytest" in line)
    assert install < tests
    assert any("command -v chromium" in line for line in lines[:install]), "the install is skipped when present"


def test_pre_commit_runs_the_check():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    [repo] = config["repos"]
    [hook] = repo["hooks"]
    assert repo["repo"] == "local"
    assert hook["entry"] == "python -m matrix check"
    assert hook["language"] == "system" and hook["pass_filenames"] is False
