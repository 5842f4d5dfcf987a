"""A real browser (Debian's chromium, headless) opens the built site as a newcomer's server would show it.

Chromium runs with a fontconfig that lists only the DejaVu fonts, so it draws the page the way a
Linux server or CI image without a colour emoji font does. The supported-models page is read back
twice: its DOM (status cells, their glyphs and boxes, whether anything is clipped) and a screenshot,
in which each status cell must show its glyph's own colours, not an empty box. The pages with wide
tables and long code are also laid out at a phone's width (390 px) and a desktop's (1280 px) and
measured: no code token broken across lines, no note number apart from its glyph, every table inside
the page or scrolling in its own box. Skips with a message where chromium is absent; CI installs it
(.ci/run).
"""

import json
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from matrix.collect import FEATURE_LABELS, MODEL_TABLE_FEATURES, declarations
from matrix.glyph_svg import DRAWINGS
from matrix.vocabulary import MATRIX

WIDTH = 1280  # the narrowest desktop the tables must be readable at
PHONE = 390  # a phone's CSS width; headless chromium's window is at least 500 wide, so an iframe gives it
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--force-device-scale-factor=1", "--virtual-time-budget=5000",
]

# Runs in the page after load: the supported-models table and its cells as rendered, each status
# glyph's box (the drawn glyph where there is one, else the glyph's text), and anything clipped.
PROBE = """
<script>
window.addEventListener("load", () => {
  const table = Array.from(document.querySelectorAll("article table"))
    .find(t => t.querySelector("th") && t.querySelector("th").textContent.trim() === "Architecture");
  const result = {found: Boolean(table), height: document.documentElement.scrollHeight};
  const boxOf = (node) => {
    const drawn = node.querySelector(".status-glyph");
    let rect;
    if (drawn) {
      rect = drawn.getBoundingClientRect();
    } else {
      const text = Array.from(node.childNodes).find(n => n.nodeType === 3 && n.textContent.trim());
      if (!text) return null;
      const range = document.createRange();
      range.selectNodeContents(text);
      rect = range.getBoundingClientRect();
    }
    return [rect.left + window.scrollX, rect.top + window.scrollY, rect.width, rect.height];
  };
  const glyphOf = (node) => {
    const drawn = node.querySelector(".status-glyph");
    if (drawn) return {glyph: drawn.dataset.glyph, label: drawn.getAttribute("aria-label")};
    const copy = node.cloneNode(true);
    copy.querySelectorAll("sup").forEach(sup => sup.remove());
    return {glyph: copy.textContent.trim(), label: null};
  };
  if (table) {
    const box = table.getBoundingClientRect();
    const style = getComputedStyle(table);
    result.box = [box.width, box.height];
    result.visible = style.display !== "none" && style.visibility !== "hidden";
    result.headers = Array.from(table.querySelectorAll("thead th")).map(th => th.textContent.trim());
    result.rows = Array.from(table.querySelectorAll("tbody tr")).map(tr => Array.from(tr.cells).map(td =>
      Object.assign(glyphOf(td), {text: td.textContent.trim(), width: td.getBoundingClientRect().width,
                                  box: boxOf(td)})));
  }
  // A table or code block is clipped when its content is wider than what the page shows of it.
  const article = document.querySelector("article").getBoundingClientRect();
  result.clipped = Array.from(document.querySelectorAll("article table, article pre > code"))
    .filter(el => el.scrollWidth > el.clientWidth + 1 || el.getBoundingClientRect().right > article.right + 1)
    .map(el => el.textContent.trim().slice(0, 60));
  document.documentElement.setAttribute("data-probe", JSON.stringify(result));
});
</script>
"""


def chromium() -> str:
    for name in (os.environ.get("TANDEM_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium not found: the browser test needs Debian's chromium (apt-get install -y chromium); "
                "CI installs it, set TANDEM_CHROMIUM to use another binary")


@pytest.fixture(scope="module")
def no_emoji_fonts(tmp_path_factory) -> dict:
    """The environment of a server without emoji fonts: a fontconfig that knows only DejaVu."""
    listed = subprocess.run(["fc-list", ":", "file"], capture_output=True, text=True).stdout if shutil.which(
        "fc-list") else ""
    dirs = sorted({str(Path(line.split(":")[0]).parent) for line in listed.splitlines() if "DejaVu" in line})
    if not dirs:
        pytest.skip("no DejaVu fonts found (fc-list): install fonts-dejavu-core for the browser test")
    home = tmp_path_factory.mktemp("fontconfig")
    (home / "fonts.conf").write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
        + "".join(f"  <dir>{d}</dir>\n" for d in dirs)
        + f"  <cachedir>{home / 'cache'}</cachedir>\n</fontconfig>\n")
    env = {**os.environ, "FONTCONFIG_FILE": str(home / "fonts.conf")}
    fonts = subprocess.run(["fc-list"], capture_output=True, text=True, env=env).stdout
    assert "emoji" not in fonts.lower(), fonts
    return env


class ProbeReader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.probe = None

    def handle_starttag(self, tag, attrs):
        if tag == "html":
            self.probe = dict(attrs).get("data-probe")


def run_chromium(page: Path, env: dict, height: int, *flags: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [chromium(), *FLAGS, f"--window-size={WIDTH},{height}", f"--user-data-dir={profile}", *flags,
             page.as_uri()],
            capture_output=True, text=True, timeout=120, env=env,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def probe(page: Path, env: dict, height: int = 1800) -> dict:
    result = run_chromium(page, env, height, "--dump-dom")
    reader = ProbeReader()
    reader.feed(result.stdout)
    assert reader.probe, f"the probe did not run; chromium said: {result.stderr[-2000:]}"
    return json.loads(reader.probe)


def with_probe(built: Path) -> Path:
    probe_page = built.with_name(f"probe_{built.name}")  # next to the page, so its assets resolve
    probe_page.write_text(built.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    return probe_page


@pytest.fixture(scope="module")
def supported_models(built_site, no_emoji_fonts, tmp_path_factory):
    """(probe, screenshot) of the supported-models page, at the same size and with the same fonts."""
    from PIL import Image

    page = with_probe(built_site / "models/supported_models.html")
    first = probe(page, no_emoji_fonts)
    height = min(int(first["height"]) + 10, 8000)
    found = probe(page, no_emoji_fonts, height)
    shot = tmp_path_factory.mktemp("shot") / "supported_models.png"
    run_chromium(page, no_emoji_fonts, height, f"--screenshot={shot}")
    return found, Image.open(shot).convert("RGB")


def status_columns() -> list[str]:
    return ["V1", *(FEATURE_LABELS[f] for f in MODEL_TABLE_FEATURES)]


def status_cells(found, row):
    """The status cells of a row: from the V1 column on, one per status column (text columns may follow)."""
    start = found["headers"].index("V1")
    return row[start:start + len(status_columns())]


def test_the_supported_models_table_renders_with_canonical_glyphs(supported_models):
    found, _ = supported_models
    assert found["found"], "no table headed Architecture on the supported-models page"
    assert found["visible"] and min(found["box"]) > 0
    columns = status_columns()
    start = found["headers"].index("V1")
    assert found["headers"][start:start + len(columns)] == columns

    decls = declarations()
    assert len(found["rows"]) == len(decls)
    canonical = {glyph.char for glyph in MATRIX.values()}
    for decl, row in zip(decls, found["rows"]):
        assert row[0]["text"] == decl.architecture
        cells = status_cells(found, row)
        for cell in cells:
            assert cell["glyph"] in canonical, f"{decl.architecture}: {cell['glyph']!r} is not one canonical glyph"
            assert len(cell["glyph"]) == 1 and cell["width"] > 0
            assert cell["label"], f"{decl.architecture}: the {cell['glyph']} has no accessible label"
        assert cells[0]["glyph"] == MATRIX[decl.capabilities.engine.status].char


def share_of_colour(image, box, rgb, tolerance: int = 60) -> float:
    """The share of the pixels in `box` (x, y, width, height) within `tolerance` of `rgb`."""
    x, y, w, h = (round(v) for v in box)
    region = image.crop((x, y, x + max(w, 1), y + max(h, 1)))
    pixels = list(region.get_flattened_data())
    close = sum(1 for p in pixels if sum(abs(a - b) for a, b in zip(p, rgb)) <= tolerance)
    return close / len(pixels)


def test_every_status_cell_shows_its_glyphs_colours_without_emoji_fonts(supported_models):
    """On a machine without a colour emoji font, a bare ✅ is an empty box: no green in the cell."""
    found, image = supported_models
    missing = []
    for row in found["rows"]:
        for cell in status_cells(found, row):
            assert cell["box"], f"{row[0]['text']}: a status cell has no glyph"
            share = share_of_colour(image, cell["box"], DRAWINGS[cell["glyph"]].rgb)
            if share < 0.08:
                colour = DRAWINGS[cell["glyph"]].colour
                missing.append(f"{row[0]['text']}: {cell['glyph']} shows {share:.0%} of {colour}")
    assert not missing, "glyphs drawn without their colours (an empty box?):\n" + "\n".join(missing)


# Runs in the page after load: how its code, status notes and tables are laid out (see LAYOUT_PAGES).
LAYOUT_PROBE = r"""
<script>
window.addEventListener("load", () => {
  const article = document.querySelector("article");
  // Material lets tables and code blocks bleed into the article's side padding, up to .md-content's edges.
  const bounds = document.querySelector(".md-content").getBoundingClientRect();
  const short = (el) => el.textContent.trim().replace(/\s+/g, " ").slice(0, 70);
  const result = {width: window.innerWidth, page_scroll: document.documentElement.scrollWidth - window.innerWidth,
                  broken_tokens: [], broken_lines: [], split_notes: [], unreadable: [], code_blocks: 0,
                  inline_codes: 0, notes: 0, tables: 0};
  // Visual lines of a text node's range: distinct tops of its rects.
  const tops = (range) => new Set(Array.from(range.getClientRects()).filter(r => r.width > 0)
                                      .map(r => Math.round(r.top)));
  // A code block: each of its source lines on one visual line.
  for (const code of article.querySelectorAll("pre > code")) {
    result.code_blocks += 1;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    let line = "", lineTops = new Set(), node;
    const flush = () => {
      if (line.trim() && lineTops.size > 1) result.broken_lines.push(line.trim().slice(0, 70));
      line = ""; lineTops = new Set();
    };
    while ((node = walker.nextNode())) {
      const text = node.textContent;
      let start = 0;
      for (let i = 0; i <= text.length; i++) {
        if (i === text.length || text[i] === "\n") {
          if (i > start) {
            const range = document.createRange();
            range.setStart(node, start); range.setEnd(node, i);
            tops(range).forEach(t => lineTops.add(t));
            line += text.slice(start, i);
          }
          if (i < text.length) flush();
          start = i + 1;
        }
      }
    }
    flush();
  }
  // Inline code: every whitespace-free token on one line.
  for (const code of article.querySelectorAll(":not(pre) > code")) {
    result.inline_codes += 1;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    let node;
    while ((node = walker.nextNode())) {
      for (const match of node.textContent.matchAll(/\S+/g)) {
        const range = document.createRange();
        range.setStart(node, match.index); range.setEnd(node, match.index + match[0].length);
        if (tops(range).size > 1) result.broken_tokens.push(match[0]);
      }
    }
    const box = code.getBoundingClientRect();
    if (!code.closest("table") && (box.right > bounds.right + 1 || box.left < bounds.left - 1)) {
      result.broken_tokens.push(`${short(code)} (past the page's edge)`);
    }
  }
  // A status glyph and the note number right after it: on one line, the number after the glyph.
  for (const glyph of article.querySelectorAll(".status-glyph")) {
    const note = glyph.nextElementSibling;
    if (!note || note.tagName !== "SUP" || glyph.nextSibling !== note) continue;
    result.notes += 1;
    const g = glyph.getBoundingClientRect(), n = note.getBoundingClientRect();
    if (n.top >= g.bottom || n.bottom <= g.top || n.left < g.right - 1) {
      result.split_notes.push(glyph.dataset.glyph + note.textContent + " in " + short(glyph.closest("tr, li, p")));
    }
  }
  // A table is readable when it lies inside the article or scrolls inside a box that does, and no
  // cell clips its own text.
  for (const table of article.querySelectorAll("table")) {
    result.tables += 1;
    const box = table.getBoundingClientRect();
    let scroller = table.parentElement;
    while (scroller !== article && !["auto", "scroll"].includes(getComputedStyle(scroller).overflowX)) {
      scroller = scroller.parentElement;
    }
    const inside = (r) => r.left >= bounds.left - 1 && r.right <= bounds.right + 1;
    const ok = inside(box) || (scroller !== article && inside(scroller.getBoundingClientRect()));
    const clipped = Array.from(table.querySelectorAll("td, th")).filter(c => c.scrollWidth > c.clientWidth + 1);
    if (!ok || clipped.length) {
      result.unreadable.push(short(table.querySelector("tr")) + (clipped.length ? ` (clips ${short(clipped[0])})` : ""));
    }
  }
  const message = JSON.stringify(result);
  document.documentElement.setAttribute("data-probe", message);
  if (window.parent !== window) window.parent.postMessage(message, "*");
});
</script>
"""

LAYOUT_PAGES = ["models/supported_models.html", "usage/v1_guide.html", "cache_layout.html", "performance.html",
                "index.html", "models/evidence.html"]


def layout(built: Path, env: dict, width: int) -> dict:
    """LAYOUT_PROBE's findings for `built` at `width` CSS pixels: the page itself at a desktop width, the
    page in an iframe that wide below chromium's smallest window (its media queries see the iframe)."""
    page = built.with_name(f"layout_{built.name}")
    page.write_text(built.read_text(encoding="utf-8").replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    if width < 500:
        host = built.with_name(f"frame_{width}_{built.name}")
        host.write_text(
            f'<html><body style="margin:0"><iframe src="{page.name}" style="border:0;width:{width}px;height:4000px">'
            '</iframe><script>addEventListener("message", e => '
            'document.documentElement.setAttribute("data-probe", e.data));</script></body></html>', encoding="utf-8")
        page = host
    found = probe(page, env, height=1000)
    assert found["width"] == width, f"the page was laid out {found['width']} px wide, not {width}"
    return found


@pytest.mark.parametrize("width", [PHONE, WIDTH])
@pytest.mark.parametrize("page", LAYOUT_PAGES)
def test_code_notes_and_tables_stay_readable(built_site, no_emoji_fonts, page, width):
    found = layout(built_site / page, no_emoji_fonts, width)
    assert found["code_blocks"] + found["inline_codes"] > 0, found
    assert found["broken_lines"] == [], f"{page} at {width} px wraps code lines: {found['broken_lines']}"
    assert found["broken_tokens"] == [], f"{page} at {width} px breaks code tokens: {found['broken_tokens']}"
    assert found["split_notes"] == [], f"{page} at {width} px puts notes apart from glyphs: {found['split_notes']}"
    assert found["unreadable"] == [], f"{page} at {width} px has unreadable tables: {found['unreadable']}"
    assert found["page_scroll"] <= 1, f"{page} at {width} px scrolls sideways by {found['page_scroll']} px"
