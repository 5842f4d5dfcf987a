"""Running `tandem serve` in a subprocess on 127.0.0.1 for the tests, and reading what it reports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).parents[2]
MODEL = "tiny-bamba"
MAX_MODEL_LEN = 512
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL)
STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """{(metric name, frozenset of label pairs): value}; every sample must follow a TYPE line for its metric."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name, labels, value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in typed else name
        assert family in typed, f"{name} has no TYPE line before its samples"
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             **{"timeout": 120.0, **options})

    def metrics(self) -> dict[str, float]:
        """Samples by metric name, model label dropped; keyed "name:label" by finish reason, histogram bound
        (`le`) or "name:METHOD route status" for http_requests_total."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for (name, labels), value in parse_prometheus(text).items():
            labels = dict(labels)
            if "status" in labels:
                out[f"{name}:{labels['method']} {labels['handler']} {labels['status']}"] = value
                continue
            label = labels.get("finish_reason", labels.get("le"))
            out[f"{name}:{label}" if label else name] = value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["tandem_num_requests_running"] == 0 and metrics["tandem_num_requests_waiting"] == 0:
                return metrics
            assert time.monotonic() < deadline, f"the server is still busy after {timeout} s: {metrics}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def serve_command(model_dir: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "runtime", "serve", str(model_dir), "--port", str(port), *args]


@contextmanager
def serve(model_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`tandem serve MODEL --port 0 *args` until the block ends (then SIGTERM); the server reports the port
    the system chose, so no two servers can race for one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    with open(log, "w") as out:
        # Output goes to a file: a pipe nobody reads would fill up and stall the server.
        proc = subprocess.Popen(serve_command(model_dir, 0, *args), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    server = Server(proc, "", log)
    try:
        server.url = _wait_serving(server)
        yield server
    finally:
        server.stop()


def _wait_serving(server: Server) -> str:
    """The URL from the server's "serving on http://HOST:PORT" line, once it is there."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(r"serving on (http://\S+)", server.log.read_text())
        if match:
            return match.group(1)
        assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}:\n{server.log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log.read_text()}")
