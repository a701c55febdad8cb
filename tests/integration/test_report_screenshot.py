"""The report of a real demo run, rendered by headless Chromium: every figure the page embeds is
drawn on screen pixel for pixel, and the page is long enough to hold every section.

Needs Debian's ``chromium`` (``apt install chromium``); where it is missing the test says so and is
skipped. A slow test: it runs ``quorumfl demo`` (real SuperLink and SuperNodes)."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _find(screen: np.ndarray, figure: np.ndarray) -> bool:
    """Whether ``figure`` appears in ``screen`` unchanged: its busiest row is searched for in every
    screen row, then the whole figure is compared where that row was found."""
    busy = int(np.argmax((figure < 250).any(axis=2).sum(axis=1)))
    needle = figure[busy].tobytes()
    h, w = figure.shape[:2]
    for y in range(busy, screen.shape[0] - (h - busy) + 1):
        at = screen[y].tobytes().find(needle)
        while at >= 0:
            if at % 3 == 0:
                x = at // 3
                top = y - busy
                if np.array_equal(screen[top:top + h, x:x + w], figure):
                    return True
            at = screen[y].tobytes().find(needle, at + 1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt install chromium)")
def test_a_demo_report_renders_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "QUORUMFL_HOME": str(tmp_path / "home")}
    demo = subprocess.run([sys.executable, "-m", "quorumfl.cli", "demo", "--rounds", "2"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    made = subprocess.run([sys.executable, "-m", "quorumfl.cli", "runs", "report", "1", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stderr
    page = tmp_path / "run-1.html"
    html = page.read_text(encoding="utf-8")
    sections = re.findall(r'<section id="([a-z]+)">', html)
    assert sections == ["summary", "metric", "departments", "stages", "participation", "bytes", "privacy", "monitoring",
                        "versions"]
    shot = tmp_path / "shot.png"
    rendered = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--force-device-scale-factor=1", "--window-size=1000,6000", f"--screenshot={shot}",
                               page.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert rendered.returncode == 0 and shot.exists(), rendered.stderr
    with Image.open(shot) as image:
        screen = np.asarray(image.convert("RGB"))
    drawn = np.nonzero((screen < 250).any(axis=(1, 2)))[0]
    figures = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(figures) == 4  # metric, stages, participation, bytes (the demo masks: no update norms; no DP: no ε)
    for encoded in figures:
        with Image.open(io.BytesIO(base64.b64decode(encoded))) as image:
            figure = np.asarray(image.convert("RGB"))
        assert _find(screen, figure), "a figure of the report is not on the rendered page"
    assert drawn.max() < screen.shape[0] - 10  # the whole page fitted: the last section is on screen
