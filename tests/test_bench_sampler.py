"""bench/sampler.py at toy sizes: it times every case and prints one table row each."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench import sampler  # noqa: E402


def test_it_prints_a_row_per_case(capsys):
    assert sampler.main(["--batch", "1", "3", "--vocab", "1200", "--prompt-len", "8", "--output-len", "4",
                         "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| parameters | batch 1 | batch 3 |"
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == list(sampler.CASES)
    assert all(re.fullmatch(r"\| .+ \| \d+\.\d\d \| \d+\.\d\d \|", row) for row in rows[1:])
