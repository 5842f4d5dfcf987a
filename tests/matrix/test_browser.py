"""A real browser (Debian's chromium, headless) opens the built supported-models page.

It checks that the table is laid out and visible, and that every status cell holds exactly
one canonical glyph with no variation selector. Skips with a message where chromium is absent;
CI installs it (.ci/run).
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
from matrix.vocabulary import MATRIX

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1800", "--virtual-time-budget=5000", "--dump-dom",
]

# Runs in the page after load: measures the supported-models table and reads its cells as rendered.
PROBE = """
<script>
window.addEventListener("load", () => {
  const table = Array.from(document.querySelectorAll("article table"))
    .find(t => t.querySelector("th") && t.querySelector("th").textContent.trim() === "Architecture");
  const result = {found: Boolean(table)};
  if (table) {
    const box = table.getBoundingClientRect();
    const style = getComputedStyle(table);
    result.box = [box.width, box.height];
    result.visible = style.display !== "none" && style.visibility !== "hidden";
    result.headers = Array.from(table.querySelectorAll("thead th")).map(th => th.textContent.trim());
    result.rows = Array.from(table.querySelectorAll("tbody tr")).map(tr => Array.from(tr.cells).map(td => {
      const glyph = td.cloneNode(true);
      glyph.querySelectorAll("sup").forEach(sup => sup.remove());
      return {glyph: glyph.textContent.trim(), width: td.getBoundingClientRect().width};
    }));
  }
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


class ProbeReader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.probe = None

    def handle_starttag(self, tag, attrs):
        if tag == "html":
            self.probe = dict(attrs).get("data-probe")


def open_in_chromium(page: Path) -> dict:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", page.as_uri()],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    reader = ProbeReader()
    reader.feed(result.stdout)
    assert reader.probe, f"the probe did not run; chromium said: {result.stderr[-2000:]}"
    return json.loads(reader.probe)


def test_the_supported_models_table_renders_with_canonical_glyphs(built_site):
    built = built_site / "models/supported_models.html"
    probe_page = built.with_name("browser_probe.html")  # next to the page, so its assets resolve
    probe_page.write_text(built.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")

    probe = open_in_chromium(probe_page)
    assert probe["found"], "no table headed Architecture on the supported-models page"
    assert probe["visible"] and min(probe["box"]) > 0
    status_columns = ["V1", *(FEATURE_LABELS[f] for f in MODEL_TABLE_FEATURES)]
    assert probe["headers"][-len(status_columns):] == status_columns

    decls = declarations()
    assert len(probe["rows"]) == len(decls)
    canonical = {glyph.char for glyph in MATRIX.values()}
    for decl, row in zip(decls, probe["rows"]):
        assert row[0]["glyph"] == decl.architecture
        cells = row[-len(status_columns):]
        for cell in cells:
            assert cell["glyph"] in canonical, f"{decl.architecture}: {cell['glyph']!r} is not one canonical glyph"
            assert len(cell["glyph"]) == 1 and cell["width"] > 0
        assert cells[0]["glyph"] == MATRIX[decl.capabilities.engine.status].char
