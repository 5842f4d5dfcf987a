"""Every shell command and Python snippet in docs/ runs as written after the README's set-up.

The docs' one convention: commands are spelled as the README's set-up leaves them,
`.venv/bin/tandem ...`, `.venv/bin/python ...`, `.venv/bin/mkdocs ...`, so they work without
activating the environment. Each ```bash and ```python block runs in a scratch copy of the
repository (whose `.venv` is the environment running these tests), in page order. An HTML
comment on the line before a block changes what happens to it:

- `<!-- snippet: skip REASON -->`: not run; the reason is printed (pytest -ra shows it);
- `<!-- snippet: gpu-only REASON -->`: run only where CUDA is available, else skipped with the reason;
- `<!-- snippet: tiny ARGS -->`: long-running; each command line runs with ARGS appended;
- `<!-- snippet: server -->`: started in the background; the page's later blocks run against it,
  and it is stopped after the page. It listens on a free port: `127.0.0.1:8000` in later blocks
  is rewritten to that port (other test runs may hold 8000).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from matrix_helpers import ROOT

FENCE = re.compile(r"^```(\w+)\s*$")
MARKER = re.compile(r"^<!-- snippet: ([\w-]+)\s*(.*?)\s*-->$")
RUNNABLE = ("bash", "python")
KINDS = ("skip", "gpu-only", "tiny", "server")
# Nothing is timed: this only keeps a hung snippet from hanging the suite.
GUARD_S = 600


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    language: str
    code: str
    kind: str | None = None
    argument: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets_in(page: Path) -> list[Snippet]:
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous.strip())
        if fence.group(1) in RUNNABLE:
            kind, argument = (marker.group(1), marker.group(2)) if marker else (None, "")
            assert kind in (None, *KINDS), f"{page}:{i + 1}: unknown snippet marker {kind!r}; use one of {KINDS}"
            found.append(Snippet(str(page.relative_to(ROOT)), i + 1, fence.group(1), "\n".join(lines[i + 1:end]),
                                 kind, argument))
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for page in sorted((ROOT / "docs").rglob("*.md")) for s in snippets_in(page)]


SNIPPETS = all_snippets()


def test_the_docs_have_snippets_of_each_kind():
    assert {s.language for s in SNIPPETS} == set(RUNNABLE)
    assert {"skip", "server"} <= {s.kind for s in SNIPPETS}


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_commands_use_the_set_up_environment(snippet):
    """Bare `tandem`, `python` or `mkdocs` fails after the README's set-up ("command not found", or a
    Python without torch): the docs call them from .venv/bin."""
    if snippet.language != "bash":
        return
    for number, line in enumerate(snippet.code.splitlines(), snippet.line + 1):
        command = line.strip().split(" ", 1)[0]
        assert command not in ("tandem", "python", "mkdocs", "pip", "pytest"), (
            f"{snippet.page}:{number}: `{command}` is not on the PATH after the README's set-up; "
            f"write `.venv/bin/{command}`")


def with_tiny_arguments(line: str, arguments: str) -> str:
    """`cmd --x  # comment` -> `cmd --x ARGS`; blank and continued lines stay as they are."""
    command = re.sub(r"\s+#.*$", "", line)
    return line if not command.strip() or command.rstrip().endswith("\\") else f"{command} {arguments}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the repository to run snippets in (they may write files); its .venv is this one."""
    root = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", "site", "*.egg-info")
    for name in ("docs", "runtime", "matrix", "templates", "bench", "tests"):
        shutil.copytree(ROOT / name, root / name, ignore=ignore)
    for name in ("mkdocs.yml", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return root


@pytest.fixture(scope="module")
def servers():
    """Background servers started by `server` snippets, by page: (process, port)."""
    running: dict[str, tuple[subprocess.Popen, int]] = {}
    yield running
    for proc, _ in running.values():
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def start_server(snippet: Snippet, root: Path, env: dict) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = f"{snippet.code.strip()} --port {port}"
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # until the server says it is ready
        seen.append(line)
        if f"127.0.0.1:{port}" in line:
            return proc, port
    proc.wait()
    pytest.fail(f"{snippet.id}: the server did not start:\n{''.join(seen)}")


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS], ids=lambda s: s.id)
def test_snippet_runs_as_written(snippet, scratch, servers, tmp_path):
    if snippet.kind == "skip":
        pytest.skip(f"{snippet.id}: {snippet.argument}")
    if snippet.kind == "gpu-only" and not cuda_available():
        pytest.skip(f"{snippet.id}: GPU only: {snippet.argument}")
    env = {**os.environ, "PYTHONPATH": ""}
    if snippet.kind == "server":
        assert snippet.page not in servers
        servers[snippet.page] = start_server(snippet, scratch, env)
        return
    code = snippet.code
    if snippet.page in servers:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{servers[snippet.page][1]}")
    if snippet.kind == "tiny":
        code = "\n".join(with_tiny_arguments(line, snippet.argument) for line in code.splitlines())
    if snippet.language == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code, encoding="utf-8")
        command = [str(scratch / ".venv/bin/python"), str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    result = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=GUARD_S)
    assert result.returncode == 0, f"{snippet.id} failed ({result.returncode}):\n{code}\n{result.stdout}{result.stderr}"
    # curl exits 0 on an HTTP error; the server's error body is OpenAI's {"error": {...}}.
    assert '"error":' not in result.stdout, f"{snippet.id}: the server refused it:\n{result.stdout}"
