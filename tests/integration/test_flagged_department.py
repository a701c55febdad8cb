"""Update monitoring and the run report on Flower's deployment engine: four departments as real
SuperNodes under masking, one of them with a broken export (its images scaled ×50, as when pixels
arrive as 0–255 instead of 0–1).

The server sees no single update, yet the secure sum's norm histogram counts one department far
above the others in each round, from the first. The run's report, rendered by headless Chromium
(Debian's ``chromium``; that test is skipped, saying so, where it is missing), draws every figure
the page embeds pixel for pixel and fits every section."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.store import read_partition, write_partition
from quorumfl.deploy.local import local_federation
from quorumfl.server.report import render_html, report_data
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

DEPARTMENTS = ["tax-office", "urban-planning", "public-works", "parks"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass(frozen=True)
class Recorded:
    folder: Path
    data: dict[str, object]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    tmp = tmp_path_factory.mktemp("flagged")
    home = tmp / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp / "data", DEPARTMENTS, seed=0, method="iid")
    broken = read_partition(parts["parks"])
    write_partition(parts["parks"], replace(broken, train=replace(broken.train, x=broken.train.x * 50),
                                            test=replace(broken.test, x=broken.test.x * 50)))
    with local_federation(home, parts, db_url=db_url) as federation:
        flower_run_id = federation.control.start_run({
            "state-url": db_url, "model-dir": str(home / "models"), "start-from": "fresh", "num-rounds": 2,
            "local-epochs": 1, "strategy": "fedavg", "secure-aggregation": "masking", "secagg-threshold": 0.6,
            "round-timeout": 300.0})
        run = follow_run(repo, flower_run_id, timeout=600, alive=lambda: federation.alive(flower_run_id))
        assert run.status == RunStatus.COMPLETED, f"{run.error}\n{federation.logs()}"
    yield Recorded(tmp, report_data(repo, run.id))


@pytest.mark.slow
def test_a_broken_department_is_counted_in_the_masked_round_it_starts(recorded: Recorded) -> None:
    """Round 1 counts it; round 2 counts it only while its own norm or loss is still ≥ 10× the
    median's (the loopback test checks every round's count against each node's own figures)."""
    data = recorded.data
    flagged = [r["metrics"]["flagged-nodes"] for r in data["rounds"]]  # type: ignore[index]
    assert flagged[0] == 1.0 and flagged[1] in (0.0, 1.0)
    assert data["monitoring"] == []  # no single update, no department named: only the histograms
    assert [(h["round"], h["flagged"], sum(h["norm"].values())) for h in data["histograms"]] == [  # type: ignore[attr-defined]
        (1, 1, 4), (2, flagged[1], 4)]


def _find(screen: np.ndarray, figure: np.ndarray) -> bool:
    """Whether ``figure`` appears in ``screen`` unchanged: its busiest row is searched for in every
    screen row, then the whole figure is compared where that row was found."""
    busy = int(np.argmax((figure < 250).any(axis=2).sum(axis=1)))
    needle = figure[busy].tobytes()
    h, w = figure.shape[:2]
    for y in range(busy, screen.shape[0] - (h - busy) + 1):
        row = screen[y].tobytes()
        at = row.find(needle)
        while at >= 0:
            if at % 3 == 0 and np.array_equal(screen[y - busy:y - busy + h, at // 3:at // 3 + w], figure):
                return True
            at = row.find(needle, at + 1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt install chromium)")
def test_the_report_renders_every_figure_in_chromium(recorded: Recorded) -> None:
    page = recorded.folder / "run.html"
    html = render_html(recorded.data)
    page.write_text(html, encoding="utf-8")
    sections = re.findall(r'<section id="([a-z]+)">', html)
    assert sections == ["summary", "metric", "departments", "stages", "participation", "bytes", "privacy", "monitoring",
                        "versions"]
    shot = recorded.folder / "shot.png"
    rendered = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--force-device-scale-factor=1", "--window-size=1000,6000", f"--screenshot={shot}",
                               page.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert rendered.returncode == 0 and shot.exists(), rendered.stderr
    with Image.open(shot) as image:
        screen = np.asarray(image.convert("RGB"))
    figures = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(figures) == 4  # metric, stages, participation, bytes (masked: no update norms; no DP: no ε)
    for encoded in figures:
        with Image.open(io.BytesIO(base64.b64decode(encoded))) as image:
            figure = np.asarray(image.convert("RGB"))
        assert _find(screen, figure), "a figure of the report is not on the rendered page"
    drawn = np.nonzero((screen < 250).any(axis=(1, 2)))[0]
    assert drawn.max() < screen.shape[0] - 10  # the whole page fitted: the last section is on screen
