"""A hyper-parameter search for people and scripts: its trials as rows, the best one, and a page
with the plot of the search (``quorumfl tune show`` / ``tune report``)."""

from __future__ import annotations

from typing import Any

from quorumfl.errors import NotFoundError
from quorumfl.server.pages import figure, page, png, table
from quorumfl.server.search import best_trial
from quorumfl.server.search_space import SearchSpace
from quorumfl.server.state.orm import SearchTrial
from quorumfl.server.state.repository import Repository

__all__ = ["render_search", "search_view"]


def search_view(repo: Repository, study: str) -> dict[str, Any]:
    """The study: its space, every trial (values tried, run, state, rounds seen, final figure), the best."""
    trials = repo.trials(study)
    if not trials:
        known = ", ".join(name for name, _ in repo.studies()) or "none yet"
        raise NotFoundError(f"no search named '{study}' (searches: {known}); 'quorumfl tune run' starts one")
    best = best_trial(trials)
    metric = next((t.metric for t in trials if t.metric), None)
    return {
        "study": study,
        "metric": metric,
        "higher_is_better": trials[0].higher_is_better if metric else None,
        "space": SearchSpace.from_record(trials[-1].space).describe(),
        "trials": [_row(t) for t in trials],
        "best": _row(best) if best is not None else None,
        "rounds_run": sum(len(t.figures) for t in trials),
    }


def _row(trial: SearchTrial) -> dict[str, Any]:
    return {"trial": trial.number, "state": trial.state, "run": trial.run_id, "params": dict(trial.params),
            "rounds": len(trial.figures), "value": trial.value,
            "last_round_figure": trial.figures[max(trial.figures, key=int)] if trial.figures else None}


def render_search(view: dict[str, Any]) -> str:
    """The search as one HTML page: what it varied, each trial, and the plot of the search."""
    rows = [{**{k: v for k, v in r.items() if k != "params"}, **r["params"]} for r in view["trials"]]
    keys = sorted(view["space"])
    best = view["best"]
    summary = (f"best: trial {best['trial']} ({view['metric']} {best['value']:.4g}) with "
               + ", ".join(f"{k} = {best['params'][k]!r}" for k in keys) if best else "no trial completed yet")
    sections = [
        ("space", "What was searched", table([{"key": k, "range": v} for k, v in view["space"].items()],
                                              ["key", "range"])),
        ("best", "Best", f"<p>{summary}</p>"),
        ("plot", "The search", _plot(view)),
        ("trials", "Trials", table(rows, ["trial", "state", "run", *keys, "rounds", "last_round_figure", "value"])),
    ]
    return page(f"Search '{view['study']}'", sections)


def _plot(view: dict[str, Any]) -> str:
    """Each complete trial's final figure, the best so far, and where pruned trials stopped."""
    fig, ax = figure(figsize=(7, 3.5))
    higher = view["higher_is_better"] is not False
    best, xs, ys = None, [], []
    for row in view["trials"]:
        if row["state"] == "complete" and row["value"] is not None:
            ax.plot(row["trial"], row["value"], "o", color="tab:blue")
            value = row["value"]
            best = value if best is None or (value > best if higher else value < best) else best
        elif row["state"] == "pruned" and row["last_round_figure"] is not None:
            ax.plot(row["trial"], row["last_round_figure"], "x", color="tab:gray")
        if best is not None:
            xs.append(row["trial"])
            ys.append(best)
    ax.step(xs, ys, where="post", color="tab:orange", label="best so far")
    ax.set_xlabel("trial (o: final figure, x: pruned at its last round)")
    ax.set_ylabel(view["metric"] or "figure")
    ax.legend(loc="best")
    return png(fig)
