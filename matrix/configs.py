"""Tables and examples computed from the published configs kept in docs/configs.

Every number comes from `EngineConfig`, the resolver the runtime uses, and every
example output from running `tandem plan` itself; nothing here is typed by hand.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.cells import Column, Footnotes, code
from matrix.errors import BadDeclaration
from matrix.vocabulary import NOT_APPLICABLE
from runtime.cli import build_parser
from runtime.config import EngineConfig
from runtime.hf_config import load_raw_config

CONFIGS_DIR = Path("docs") / "configs"

# Kept configs that state no dtype although the checkpoint is published in bfloat16: without
# this the table would show transformers' float32 default. Remove an entry once its config
# states a dtype (collecting fails until then, so the table cannot silently disagree).
PUBLISHED_DTYPES = {
    "ibm-ai-platform__Bamba-9B": "bfloat16",
    "Zyphra__Zamba2-2.7B-Instruct-v2": "bfloat16",
}
NOT_APPLICABLE_MEANS = (
    "an attention-free model has no attention block or page, and a model without recurrent layers "
    "has no Mamba page; padding exists only where both do."
)
DTYPE_NOTE = (
    "The kept config.json states no dtype; the checkpoint is published in {dtype}, so the row uses `--dtype {dtype}`."
)


def config_dirs(root: Path) -> list[Path]:
    dirs = [p.parent for p in (root / CONFIGS_DIR).glob("*/config.json")]
    return sorted(dirs, key=lambda p: (p.name.casefold(), p.name))


def model_id(config_dir: Path) -> str:
    org, sep, name = config_dir.name.partition("__")
    if not sep:
        raise BadDeclaration(f"{CONFIGS_DIR / config_dir.name}: name the directory <org>__<model>")
    return f"{org}/{name}"


def dtype_for(config_dir: Path) -> str:
    dtype = PUBLISHED_DTYPES.get(config_dir.name, "auto")
    raw = load_raw_config(config_dir)
    if dtype != "auto" and (raw.get("dtype") or raw.get("torch_dtype")):
        raise BadDeclaration(
            f"{CONFIGS_DIR / config_dir.name}/config.json now states its dtype; "
            "remove its entry from PUBLISHED_DTYPES in matrix/configs.py"
        )
    return dtype


def engine_config(config_dir: Path) -> EngineConfig:
    """The config resolved as the runtime would resolve it; a config it refuses stops the render."""
    try:
        return EngineConfig(model=str(config_dir), dtype=dtype_for(config_dir))
    except ValueError as err:
        raise BadDeclaration(f"{CONFIGS_DIR / config_dir.name}: {err}") from None


def number(value: int | None) -> str:
    return NOT_APPLICABLE.char if value is None else f"{value:,}"


def layout_row(config_dir: Path, footnotes: Footnotes) -> list[str]:
    config = engine_config(config_dir)
    layout = config.cache
    note = DTYPE_NOTE.format(dtype=config.dtype) if config.dtype != "auto" else None
    mamba_page = layout.mamba.unpadded_page_size_bytes if layout.mamba else None
    attention_page = layout.attention.page_size_bytes if layout.attention else None
    # Padding exists only where a Mamba page is padded up to an attention page.
    hybrid = layout.attention is not None and layout.mamba is not None
    return [
        code(model_id(config_dir)),
        code(config.declaration.architecture),
        footnotes.mark(config.model_dtype, [note]),
        number(layout.block_size),
        number(mamba_page),
        number(attention_page),
        f"{layout.mamba.padding_pct:.2f} %" if hybrid else NOT_APPLICABLE.char,
    ]


def cache_layout(root: Path) -> dict[str, Any]:
    stale = sorted(set(PUBLISHED_DTYPES) - {d.name for d in config_dirs(root)})
    if stale:
        raise BadDeclaration(f"PUBLISHED_DTYPES in matrix/configs.py names configs not in {CONFIGS_DIR}: {stale}")
    footnotes = Footnotes()
    rows = [layout_row(config_dir, footnotes) for config_dir in config_dirs(root)]
    columns = [Column(t, "---") for t in ("Model", "Architecture", "dtype")]
    columns += [Column(t, "--:") for t in (
        "Attention block (tokens)", "Mamba page (bytes)", "Attention page (bytes)", "Padding"
    )]
    return {
        "columns": columns,
        "rows": rows,
        "notes": footnotes.notes,
        "not_applicable": NOT_APPLICABLE,
        "not_applicable_means": NOT_APPLICABLE_MEANS,
    }


@dataclass(frozen=True)
class PlanExample:
    """`tandem plan ARGS`, run at render time; the first argument is a path relative to the root."""

    args: tuple[str, ...]

    def collect(self, root: Path) -> dict[str, Any]:
        path, *options = self.args
        # The real command line and the real command, so the docs show exactly what users see.
        args = build_parser(only="plan").parse_args(["plan", str(root / path), *options])
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                args.run(args)
        except ValueError as err:
            raise BadDeclaration(f"tandem plan {shlex.join(self.args)}: {err}") from None
        return {"command": f".venv/bin/tandem plan {shlex.join(self.args)}", "output": out.getvalue().rstrip("\n")}
