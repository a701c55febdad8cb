"""The documentation's results page (``docs/results.md``), rendered from ``benchmarks/results/*.json``.

Each benchmark's latest result is a JSON file: ``benchmark``, ``command``, ``commit``, ``date``,
``machine`` and ``result`` (the ``--json`` line the benchmark printed). The page shows, per file, what
the benchmark measures (the first paragraph of its module docstring), how the result was obtained,
and its figures: scalars in a table, per-seed and per-round lists inline, lists of records (a
benchmark's ``datasets``) as tables of their own, and a plot of the headline figures where the
benchmark compares methods or modes (SVG under ``docs/results/``, written with matplotlib's fixed
hash salt and no date; each carries a digest of the figures it shows). ``python
benchmarks/render_results.py --write`` rewrites the page and the plots; a test fails while the page
or a plot's digest is out of date with the files. Keys that hold a benchmark's own pass/fail flags (``goal…``) stay in
the JSON and are not shown.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE.parent / "docs" / "results.md"
PLOTS = PAGE.parent / "results"

# benchmark → (title, y label, {bar label: key}) of the figures worth a plot
BARS: dict[str, tuple[str, str, dict[str, str]]] = {
    "heterogeneity": ("mean accuracy of each department's model on its own test data", "accuracy", {
        "FedAvg": "fedavg_mean_acc", "FedProx": "fedprox_mean_acc", "IFCA": "ifca_mean_acc",
        "FedPer": "fedper_mean_acc", "Ditto": "ditto_mean_acc", "FedAvg + fine-tuning": "fedavg_finetune_mean_acc",
        "local only": "local_only_mean_acc"}),
    "round_overhead": ("seconds per round, 10 SuperNodes", "s", {
        "Flower app, stock nodes": "flower_round_s", "Flower app, QuorumFL nodes": "flower_warm_round_s",
        "plaintext": "plain_round_s", "masking": "masked_round_s", "threshold CKKS": "ckks_round_s"}),
    "secagg": ("seconds per round, 10 SuperNodes", "s", {
        "plaintext": "plain_round_s", "QuorumFL masking": "masked_round_s",
        "Flower SecAgg+": "flower_secaggplus_round_s"}),
}
# benchmark → the per-data-set figures plotted side by side (its ``datasets`` records)
GROUPED: dict[str, tuple[str, tuple[str, ...]]] = {
    "own_data": ("each department's tuned federated model, alone, and a central linear model (seed means)",
                 ("federated", "local_weighted", "central")),
    "tuning": ("the best trial's accuracy: defaults, random search, TPE (seed means)", ("default", "random", "tpe")),
}

HEADER = """# Results

<!-- generated from benchmarks/results/*.json by `python benchmarks/render_results.py --write`; do not edit -->

The latest result of each benchmark in `benchmarks/`, as its `--json` line recorded it, with the
command, the commit and the machine it ran on. Run a benchmark with `--smoke` to check that it works
(the tests do), and without to measure; `benchmarks/README.md` describes each one and its keys.
Timings compare only within one result: each was measured in one run on one machine.
"""


def _summary(name: str) -> str:
    """The first paragraph of the benchmark module's docstring."""
    source = HERE / f"{name}.py"
    if not source.exists():
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(v, (int, float)) or v is None for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(", ", ": "))
        return text if len(text) <= 160 else text[:157] + "…"
    return str(value).replace("|", "\\|")


def _goal(key: str) -> bool:
    """A benchmark's own pass/fail flag or target, not a measured figure."""
    return key.startswith("goal") or "_goal" in key


def _records(key: str, rows: list[dict[str, Any]]) -> list[str]:
    columns = [c for c in rows[0] if all(not isinstance(r.get(c), (list, dict)) for r in rows) and not _goal(c)]
    lines = [f"`{key}`:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_value(r.get(c)) for c in columns) + " |" for r in rows]
    return [*lines, ""]


def plot_data(name: str, result: dict[str, Any]) -> dict[str, Any] | None:
    """What the plot of this result shows (title, unit, one panel per data set), or None: no plot."""
    if name in BARS:
        title, unit, keys = BARS[name]
        bars = {label: result[key] for label, key in keys.items() if isinstance(result.get(key), (int, float))}
        return {"title": title, "unit": unit, "kind": "barh", "panels": [{"name": "", "bars": bars}]}
    if name in GROUPED and isinstance(result.get("datasets"), list):
        title, wanted = GROUPED[name]
        panels = [{"name": f"{row['name']} ({row.get('metric', 'accuracy')})",
                   "bars": {k: row[k] for k in wanted if isinstance(row.get(k), (int, float))}}
                  for row in result["datasets"]]
        return {"title": title, "unit": "", "kind": "bar", "panels": panels}
    return None


def digest(data: dict[str, Any]) -> str:
    """The fingerprint a plot carries of the figures it shows (its SVG's description)."""
    return "figures sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def draw(data: dict[str, Any]) -> bytes:
    """The SVG of a plot, carrying its figures' digest, with no date (the same figures, the same file)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "quorumfl-results"
    import matplotlib.pyplot as plt

    panels = data["panels"]
    if data["kind"] == "barh":
        fig, ax = plt.subplots(figsize=(7, 3.2))
        bars = panels[0]["bars"]
        ax.barh(list(bars)[::-1], list(bars.values())[::-1], color="tab:blue")
        ax.set_xlabel(data["unit"])
    else:
        fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            ax.bar(list(panel["bars"]), list(panel["bars"].values()),
                   color=["tab:blue", "tab:gray", "tab:orange"][: len(panel["bars"])])
            ax.set_title(panel["name"], fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="svg", metadata={"Date": None, "Description": digest(data)})
    plt.close(fig)
    return out.getvalue()


def section(path: Path, plots: dict[Path, dict[str, Any]]) -> list[str]:
    data = json.loads(path.read_text())
    name = data.get("benchmark", path.stem)
    lines = [f"## {name}", ""]
    if summary := _summary(name):
        lines += [summary, ""]
    lines += [f"- command: `{data.get('command', '')}`", f"- commit: `{data.get('commit', '')}`",
              f"- machine: {data.get('machine', '')}", ""]
    result: dict[str, Any] = {k: v for k, v in data["result"].items() if not _goal(k)}
    if (plot := plot_data(name, result)) is not None:
        plots[PLOTS / f"{name}.svg"] = plot
        lines += [f"![{name}](results/{name}.svg)", ""]
    scalars = {k: v for k, v in result.items()
               if not (isinstance(v, list) and v and all(isinstance(r, dict) for r in v))}
    if scalars:
        lines += ["| key | value |", "|---|---|"] + [f"| `{k}` | {_value(v)} |" for k, v in scalars.items()] + [""]
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            lines += _records(key, value)
    return lines


def render() -> tuple[str, dict[Path, dict[str, Any]]]:
    """The page's text and what each of its plots shows."""
    lines: list[str] = [HEADER]
    plots: dict[Path, dict[str, Any]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        lines += section(path, plots)
    return "\n".join(lines).rstrip() + "\n", plots


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print("usage: python benchmarks/render_results.py --write", file=sys.stderr)
        sys.exit(64)
    page, plots = render()
    PLOTS.mkdir(exist_ok=True)
    files = {PAGE: page.encode(), **{target: draw(data) for target, data in plots.items()}}
    for target, content in files.items():
        if not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)
            print(f"rewrote {target}")
