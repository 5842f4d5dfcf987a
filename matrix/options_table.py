"""The engine options table of the offline-inference page, from EngineConfig's field metadata.

The same metadata gives every subcommand its options (runtime/options.py), so the table, the
`--help` texts and `LLM(...)`'s keywords cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matrix.cells import Column, cell, code
from runtime.config import EngineConfig
from runtime.options import flag_of, options_of


def engine_options(root: Path) -> dict[str, Any]:
    rows = []
    for f, opt in options_of(EngineConfig):
        flags = ", ".join(code(flag) for flag in (flag_of(f, opt), *opt.aliases))
        if f.type in (bool, "bool"):
            flags += f" / `--no-{flag_of(f, opt)[2:]}`"
        default = code(f'"{f.default}"' if isinstance(f.default, str) else repr(f.default))
        # argparse needs "%%" for a literal "%"; the docs show one.
        in_plan = "yes" if opt.plan else ""
        rows.append([code(f.name), flags, default, in_plan, cell(opt.help.replace("%%", "%"))])
    titles = ("`LLM(...)` keyword", "Command line", "Default", "`tandem plan`", "Meaning")
    columns = [Column(t, "---") for t in titles]
    return {"columns": columns, "rows": rows}
