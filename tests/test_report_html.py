"""The HTML report opened in headless Chromium: it must render and show its plots."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ampdoctor.render import html as html_render
from tests.report_fixtures import make_report

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; .ci/run does)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--disable-extensions"]


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("html")
    p = tmp / "report.html"
    p.write_text(html_render.render(make_report()))
    return p


def test_dom_has_verdict_and_plots(page: Path) -> None:
    res = _chromium("--dump-dom", page.as_uri(), tmp=page.parent)
    dom = res.stdout
    assert "FP16 forward overflow" in dom, f"the page did not render: {res.stderr[-500:]}"
    imgs = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert len(imgs) == 4, "expected the loss, scale, heatmap and headroom plots"
    assert all(len(b) > 5000 for b in imgs), "a plot is suspiciously small"


def test_screenshot_is_not_blank(page: Path) -> None:
    np = pytest.importorskip("numpy")
    from matplotlib.image import imread

    shot = page.parent / "shot.png"
    _chromium(f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri(), tmp=page.parent)
    assert shot.exists() and shot.stat().st_size > 10_000, "chromium made no screenshot"
    img = np.asarray(imread(str(shot)))[..., :3]
    # a rendered report has many colours (text, red verdict bar, plot colormaps), a blank page has one
    colours = np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200, f"screenshot looks blank ({len(colours)} colours)"
    red = (img[..., 0] > 0.7) & (img[..., 1] < 0.3) & (img[..., 2] < 0.3)
    assert red.sum() > 500, "the verdict's red bar is not visible"
