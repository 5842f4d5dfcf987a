"""The heap keeps a step's freed activations: the next step reuses their pages instead of faulting in new ones.

Each case runs in a fresh interpreter, since glibc's thresholds are process-wide and any engine built in
this process has set them already.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import heap

ROOT = Path(__file__).parents[2]
# One step's activation freed, then a smaller one of the next step: glibc on its own maps the first and
# unmaps it on free (its mmap threshold is 128 KiB until then), then takes the second from fresh heap pages.
STEP = """
import resource
import torch
from runtime.heap import keep_freed_memory
tuned = keep_freed_memory()
first = torch.ones(16 * 2**20, dtype=torch.uint8)
del first
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = torch.ones(12 * 2**20, dtype=torch.uint8)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_step(env_value: str | None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != heap.ENV_VAR}
    if env_value is not None:
        env[heap.ENV_VAR] = env_value
    out = subprocess.run([sys.executable, "-c", STEP], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.skipif(heap.glibc() is None, reason="not glibc: the C allocator's settings are left alone")
def test_the_next_step_reuses_the_pages_of_the_last():
    pages = 12 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    tuned, faults = second_step(None)
    assert tuned
    assert faults < pages // 10, f"{faults} page faults for {pages} pages of memory freed just before"
    # The opt-out leaves glibc as it is, which maps and unmaps such blocks every time.
    tuned, faults = second_step("0")
    assert not tuned
    assert faults > pages // 2
