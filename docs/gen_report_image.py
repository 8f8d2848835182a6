"""Regenerate docs/img/report-html.png, the README's picture of the HTML report of
`ampdoctor triage sample_models/forward_overflow.py` (headless Chromium, 1200x1500).

The PNG carries the run it shows as text (its `ampdoctor-run` chunk: the verdict and GradScaler
lines), and tests/test_readme_sample.py checks that they are what the command prints today.

    python docs/gen_report_image.py        # needs chromium (Debian: apt-get install chromium)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "docs" / "img" / "report-html.png"
SAMPLE = "sample_models/forward_overflow.py"


def run_lines(report: dict) -> str:
    """What the picture must show: verdict, module, step, and the amp stage's skips and final scale."""
    v = report["verdict"]
    amp = next(s for s in report["stages"] if s["name"] == "amp")
    return (f"{v['cause']} module={v['first_module']} step={v['first_step']} "
            f"amp skips={len(amp['skipped_steps'])} final_scale={amp['final_scale']}")


def main() -> None:
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if chromium is None:
        sys.exit("no chromium binary (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        subprocess.run([sys.executable, "-m", "ampdoctor", "triage", SAMPLE, "--report", str(t / "r.html"),
                        "--json", str(t / "r.json"), "-q"], cwd=ROOT, check=False, capture_output=True)
        shot = t / "shot.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                        "--disable-extensions", f"--user-data-dir={t / 'profile'}", f"--screenshot={shot}",
                        "--window-size=1200,1500", (t / "r.html").as_uri()], check=True, capture_output=True, timeout=120)
        info = PngInfo()
        info.add_text("ampdoctor-run", run_lines(json.loads((t / "r.json").read_text())))
        Image.open(shot).save(IMAGE, pnginfo=info)
    print(f"{IMAGE.relative_to(ROOT)} regenerated: {Image.open(IMAGE).text['ampdoctor-run']}")


if __name__ == "__main__":
    main()
