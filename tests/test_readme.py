"""The README keeps exactly two set-up commands, and CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_exactly_two_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in command for command in commands)


def test_ci_runs_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    assert test_command in ci_lines
