"""`tuner report` end to end: a model-backend database, the page rendered by headless Chromium."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPES = "16,512 2048 1024 name=dense\n256 1024 512,4096 groups=2 name=seed000\n1024 2048 2048 held=16 name=held\n"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Appended to a copy of the page: once everything has loaded, every image's
# source and decoded width go into the DOM, which --dump-dom prints.
_PROBE = """<script>
window.addEventListener("load", () => {
  const out = document.createElement("pre");
  out.id = "image-probe";
  out.textContent = JSON.stringify([...document.images].map(i => [i.getAttribute("src"), i.naturalWidth]));
  document.body.appendChild(out);
});
</script>"""


def tuner(*args):
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def rendered_images(page: Path, extra: str = "") -> list[tuple[str, int]]:
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", extra + _PROBE + "</body>"))
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={page.parent / 'profile'}",
         "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    found = re.search(r'<pre id="image-probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"no probe output from Chromium:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return [tuple(x) for x in json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "s.txt").write_text(SHAPES)
    db = tmp / "t.db"
    tuner("tune", "--shapes", str(tmp / "s.txt"), "--backend", "model", "--trials", "8", "--db", str(db))
    out = tmp / "report"
    assert "index.html" in tuner("report", "--db", str(db), "-o", str(out))
    return out / "index.html"


def test_report_has_every_section_and_links_only_its_own_pngs(report):
    text = report.read_text()
    for title in ("Speedup over cuBLAS per key", "Best time per scheduler per key", "M map per family",
                  "Model-predicted against measured time"):
        assert title in text
    sources = re.findall(r'<img src="([^"]+)"', text)
    # speedup and scheduler pictures, one M map per family (3), the model's scatter
    assert len(sources) == 6
    assert sum(s.startswith("map-") for s in sources) == 3
    for src in sources:
        assert "/" not in src and (report.parent / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http" not in text


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_report_renders_in_chromium_with_every_image(report):
    images = rendered_images(report, extra='<img src="missing.png">')
    # The probe sees a missing image as such: the check can fail.
    assert images[-1] == ("missing.png", 0)
    images = images[:-1]
    assert len(images) == len(re.findall(r"<img ", report.read_text()))
    assert all(width > 0 for _, width in images), images
