"""The page pool drawn as SVG, from the declarations and the example configs in docs/configs.

Each picture shows one model's layers and how they are grouped, what one page holds (an
attention block, or a Mamba state plus its padding: the same number of bytes), and the pages
one sequence takes from the pool. Every number comes from `EngineConfig.cache`, the layout the
runtime uses. `tandem matrix render` writes the files; `tandem matrix check` and the strict
docs build fail when one is stale, as for the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path

from matrix.configs import CONFIGS_DIR, engine_config, model_id
from runtime.cache.layout import CacheLayout, cdiv
from runtime.options import plural

# The example configs drawn (directory names under docs/configs) and the sequence length shown.
EXAMPLES = ("ibm-ai-platform__Bamba-9B", "ai21labs__Jamba-v0.1", "tiiuae__Falcon-H1-0.5B-Instruct")
SEQUENCE_TOKENS = 4096
IMAGES_DIR = Path("docs") / "images" / "page_pool"

WIDTH = 860
ATTENTION, STATE, BOTH, NONE, PADDING = "#3f7fd1", "#e8913a", "#8a6cc9", "#c9ccd1", "#ffffff"
FONT = 'font-family="DejaVu Sans, Verdana, sans-serif"'


@dataclass(frozen=True)
class Picture:
    path: Path  # relative to the repository root
    svg: str


def image_path(config_name: str) -> Path:
    return IMAGES_DIR / f"{config_name}.svg"


def pictures(root: Path) -> list[Picture]:
    return [Picture(image_path(name), draw(root / CONFIGS_DIR / name)) for name in EXAMPLES]


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _text(x: float, y: float, text: str, size: int = 12, anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'{FONT}>{escape(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, label: str = "", extra: str = "") -> str:
    title = f"<title>{escape(label)}</title>" if label else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h:.1f}" fill="{fill}" '
            f'stroke="#333" stroke-width="0.6"{extra}>{title}</rect>')


def _colour(layout: CacheLayout, i: int) -> str:
    kind = layout.layers[i]
    return BOTH if kind.has_attention and kind.has_state else ATTENTION if kind.has_attention else (
        STATE if kind.has_state else NONE)


def draw_layers(layout: CacheLayout, y: float) -> tuple[list[str], float]:
    n = len(layout.layers)
    cell = min(24.0, (WIDTH - 40) / n)
    out = [_text(20, y, f"{n} layers, grouped {layout.group_size} per page id", 13, weight="bold")]
    y += 10
    for i in range(n):
        out.append(_rect(20 + i * cell, y, cell - 2, 18, _colour(layout, i), f"layer {i}: {layout.layers[i].value}"))
    y += 26
    for name, members, colour in (("attention", layout.attention_layers, ATTENTION),
                                  ("state", layout.state_layers, STATE)):
        groups = [members[k:k + layout.group_size] for k in range(0, len(members), layout.group_size)]
        for g, group in enumerate(groups):
            x0, x1 = 20 + group[0] * cell + 1, 20 + group[-1] * cell + cell - 3
            out.append(f'<path d="M{x0:.1f} {y - 6:.1f}v5H{x1:.1f}v-5" fill="none" stroke="{colour}" '
                       f'stroke-width="1.5"><title>{name} group {g}: layers {", ".join(map(str, group))}</title>'
                       '</path>')
        if groups:
            out.append(_text(20, y + 13, f"{plural(len(groups), name + ' group')}: each bracket is one group", 11))
            y += 30
    return out, y + 10


def draw_page(layout: CacheLayout, y: float) -> tuple[list[str], float]:
    page = layout.page_size_bytes
    span = WIDTH - 330
    out = [_text(20, y, f"One page: {page:,} B ({_bytes(page)}) per layer of its group", 13, weight="bold")]
    y += 12
    if layout.attention is not None:
        spec = layout.attention
        used = spec.block_size * spec.bytes_per_token
        out.append(_text(20, y + 14, "attention", 12))
        out.append(_rect(110, y, span * used / page, 20, ATTENTION,
                         f"K and V of {spec.block_size} tokens x {spec.bytes_per_token:,} B"))
        out.append(_text(120 + span, y + 14, f"{spec.block_size} tokens x {spec.bytes_per_token:,} B", 11))
        y += 28
    if layout.mamba is not None:
        spec = layout.mamba
        out.append(_text(20, y + 14, "Mamba state", 12))
        x = 110.0
        for shape, dtype, size in zip(spec.shapes, spec.dtypes, spec.state_bytes):
            w = span * size / page
            out.append(_rect(x, y, w, 20, STATE, f"state {tuple(shape)} {dtype}: {size:,} B"))
            x += w
        padding = page - spec.unpadded_page_size_bytes
        if padding > 0:
            out.append(_rect(x, y, span * padding / page, 20, "url(#hatch)", f"padding: {padding:,} B"))
        out.append(_text(120 + span, y + 14, f"padding {padding:,} B ({spec.padding_pct:.2f} %)"
                         if layout.attention is not None else f"{spec.unpadded_page_size_bytes:,} B", 11))
        y += 28
    return out, y + 12


def draw_sequence(layout: CacheLayout, y: float) -> tuple[list[str], float]:
    blocks = cdiv(SEQUENCE_TOKENS, layout.block_size) if layout.attention is not None else 0
    pages = layout.pages_per_sequence(SEQUENCE_TOKENS)
    out = [_text(20, y, f"One sequence of {SEQUENCE_TOKENS:,} tokens takes {pages} page ids", 13, weight="bold")]
    y += 10
    row = [(ATTENTION, f"attention group {g}, block {b}") for g in range(layout.num_attention_groups)
           for b in range(blocks)] + [(STATE, f"state group {g}") for g in range(layout.num_state_groups)]
    assert len(row) == pages, "the drawing counts the pages as the layout does"
    cell = min(28.0, (WIDTH - 40) / max(len(row), 1))
    for i, (colour, label) in enumerate(row):
        out.append(_rect(20 + i * cell, y, cell - 3, 18, colour, label))
    y += 34
    out.append(_text(20, y, f"each page id spans {layout.group_size} layers: {layout.bytes_per_page_id:,} B "
                            f"({_bytes(layout.bytes_per_page_id)})", 11))
    return out, y + 12


def legend(y: float) -> tuple[list[str], float]:
    out, x = [], 20.0
    for colour, name in ((ATTENTION, "attention"), (STATE, "Mamba state"), (BOTH, "both"), (NONE, "no cache"),
                         ("url(#hatch)", "padding")):
        out += [_rect(x, y - 10, 12, 12, colour), _text(x + 16, y, name, 11)]
        x += 28 + 7 * len(name)
    return out, y + 16


def draw(config_dir: Path) -> str:
    config = engine_config(config_dir)
    layout = config.cache
    title = f"{model_id(config_dir)} ({config.declaration.architecture}, {config.model_dtype}): its page pool"
    parts, y = [_text(20, 24, title, 14, weight="bold")], 52.0
    for section in (draw_layers, draw_page, draw_sequence):
        drawn, y = section(layout, y)
        parts += drawn
    drawn, y = legend(y + 4)
    parts += drawn
    height = int(y + 8)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
        f'height="{height}" role="img" aria-label="{escape(title)}">\n'
        f"<!-- generated by `tandem matrix render` from {CONFIGS_DIR / config_dir.name}; do not edit -->\n"
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/></pattern></defs>\n'
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>\n'
        + "\n".join(parts) + "\n</svg>\n"
    )
