"""bench/lora.py at toy sizes: it makes its adapters with peft and prints one table row per case, with a ratio."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench import lora  # noqa: E402


def test_it_prints_a_row_per_case(tiny_checkpoint, capsys):
    directory, _ = tiny_checkpoint("bamba")
    assert lora.main(["--model", str(directory), "--seqs", "3", "--adapters", "2", "--rank", "4", "--steps", "2",
                      "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| case | base | LoRA | ratio |"
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == ["3 seqs, 2 adapters", "1 seq, 1 adapter"]
    assert all(re.fullmatch(r"\| .+ \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\dx \|", row) for row in rows[1:])
    assert "machine before: load average" in out and "machine after: load average" in out
