"""bench/speculative.py at the smallest size: both workloads, one table row each, the same tokens."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench import speculative  # noqa: E402


def test_it_prints_a_row_per_workload(capsys):
    assert speculative.main(["--prompt-tokens", "48", "--max-tokens", "12", "--repeats", "1",
                             "--num-speculative-tokens", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| workload | prompt tokens | tokens/s without | tokens/s with | speedup | acceptance rate |"
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == ["fast apply", "no repeats"]
    assert all(re.fullmatch(r"\| .+ \| \d+ \| \d+ \| \d+ \| \d+\.\d\dx \| \d+% \|", row) for row in rows[1:])
