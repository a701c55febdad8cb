"""The documentation tells the truth about the product: the generated reference pages match what
they are generated from, the metrics page names every series the endpoint serves, the README stays
a front page, and no page dates its measurements. (``mkdocs build --strict``, every link and anchor,
runs with the static checks.)"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from quorumfl.cli.reference_docs import cli_reference
from quorumfl.server.metrics_endpoint import StateCollector
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def test_the_cli_reference_is_the_cli() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    assert page == cli_reference(), "docs/reference/cli.md is out of date: run `python -m quorumfl.cli.reference_docs --write`"


def test_the_cli_reference_lists_every_sub_command() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    for command in ("quorumfl runs start", "quorumfl certs revoke", "quorumfl data import", "quorumfl tune run",
                    "quorumfl models rollback", "quorumfl edge keys rotate", "quorumfl db upgrade"):
        assert f"`{command}`" in page, command


def test_the_results_page_is_rendered_from_the_latest_results() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from render_results import PAGE, RESULTS, digest, render
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page, plots = render()
    stale = "is out of date: run `python benchmarks/render_results.py --write`"
    assert PAGE.read_text() == page, f"docs/results.md {stale}"
    for target, data in plots.items():  # a plot carries the digest of the figures it shows
        assert target.exists() and digest(data) in target.read_text(), f"{target.relative_to(ROOT)} {stale}"
        assert f"]({target.relative_to(DOCS)})" in page
    for path in RESULTS.glob("*.json"):
        assert f"\n## {path.stem}\n" in page
    assert "goal" not in page  # a benchmark's own targets stay in its JSON
    assert len(plots) >= 4


def served_series(tmp_path: Path) -> set[str]:
    """The series names the metrics endpoint serves (counters with their ``_total``), one run recorded."""
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=1, config={"dataset": "digits", "model": "mlp"}, strategy="fedavg",
                          num_rounds=1)
    repo.start_round(run.id, 1, [1])
    return {f.name + ("_total" if f.type == "counter" else "") for f in StateCollector(repo).collect()}


def test_the_metrics_page_names_every_series_the_endpoint_serves(tmp_path: Path) -> None:
    names = served_series(tmp_path)
    assert len(names) >= 10
    page = (DOCS / "reference" / "metrics.md").read_text()
    for name in names:
        assert f"`{name}`" in page, f"{name} is served but not in docs/reference/metrics.md"


def test_the_grafana_dashboard_reads_only_served_series(tmp_path: Path) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "quorumfl-federation.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"quorumfl_[a-z0-9_]+", expr)}
    served = served_series(tmp_path)
    assert used and used <= served, f"the dashboard reads series the endpoint does not serve: {used - served}"
    assert served <= used, f"series the dashboard does not show: {served - used}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_dates_its_measurements(page: Path) -> None:
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", page.read_text())
    assert not dates, f"{page.relative_to(ROOT)} dates what it says ({dates}): the docs describe the product as it is"


def test_the_changelog_names_the_installed_version_first() -> None:
    from importlib.metadata import version

    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", changelog, flags=re.MULTILINE)
    assert first is not None and first.group(1) == version("quorumfl"), (first and first.group(1), version("quorumfl"))


def test_every_command_help_points_at_the_exit_codes() -> None:
    from typer.testing import CliRunner

    from quorumfl.cli.main import COMMANDS, app, load_command
    from quorumfl.cli.reference_docs import walk

    paths = [path[1:] for name in COMMANDS for path, _ in walk(load_command(name), ["quorumfl", name])]
    assert len(paths) > 40
    runner = CliRunner()
    for args in [[], *paths]:
        result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "docs/reference/exit-codes.md" in result.output, (args, result.output[-300:])
