"""A department's own data, the defaults only: the federation against each department alone and one central model.

What a city gets on its first run, without tuning anything: real data from packages the project
does not tune on (``./setup.sh --city-data``), split by a natural key, masked, every run-config key
at its default except the task, its schema and its model.

- ``salaries``: Stack Overflow's developer survey sample (r-cran-modeldata ``stackoverflow``), tabular
  regression of ``Salary`` (MAE in dollars); departments are the 5 countries.
- ``credit``: credit applications (modeldata ``credit_data``), tabular classification of ``Status``
  (accuracy); departments are applicants' housing (``Home``: owner, rent, parents, the rest).
- ``reviews``: Amazon fine-food reviews (modeldata ``training_data`` + ``testing_data``), text
  classification of the score (great / other; accuracy); departments hold whole products, 4 of them.
- ``digits``: the embedded handwritten digits (8×8), image classification (accuracy); it has no
  natural key, so a Dirichlet(0.5) label skew over 4 departments.

Each department's file goes through the product's path (schema proposed from the pool,
``import_partition`` with its own train/test split) and an in-process masked federation runs the
real ClientApp and the server's round loop (``LoopbackGrid``, as the tests do). Per dataset and seed:
- ``federated``: each department's final model from the federation, the federation's model fine-tuned
  on its own data (``tuned-<metric>``, what it keeps), on its own test rows, example-weighted;
  ``federated_global``: the shared global model's figure;
- ``local_weighted`` / ``local_worst``: each department's model trained alone on its own data with the
  same budget (``alone-<metric>``), example-weighted mean and the worst department;
- ``central``: ridge (regression) or logistic regression on all departments' training rows pooled, the
  same encoded features (text: the hashed n-gram counts), measured on each department's test rows,
  example-weighted.
The figures are means over the seeds; goals per dataset: ``federated`` at least ``local_weighted``,
and within 3 points (accuracy) or 5 % (MAE) of ``central``.

    python benchmarks/own_data.py             # seeds 0, 1, 2
    python benchmarks/own_data.py --smoke     # one seed, 2 rounds, fewer rows: the path works
    python benchmarks/own_data.py --json      # last line: {"datasets": [...], ...}
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' in-process grid
from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from _cli import parser, peak_rss_mb, report  # noqa: E402
from quorumfl.core.data import import_partition, propose_schema, read_partition  # noqa: E402
from quorumfl.core.data.datasets import Dataset  # noqa: E402
from quorumfl.core.data.packaged import modeldata_rows, natural_groups  # noqa: E402
from quorumfl.core.data.store import prepare_partitions  # noqa: E402
from quorumfl.server.config import RunConfig  # noqa: E402
from quorumfl.server.model_store import ModelStore  # noqa: E402
from quorumfl.server.rounds import Federation  # noqa: E402
from quorumfl.server.services import run_view  # noqa: E402
from quorumfl.server.state.database import connect  # noqa: E402
from quorumfl.server.state.repository import Repository  # noqa: E402
from tests.server.test_rounds import LoopbackGrid  # noqa: E402

DATASETS: dict[str, dict[str, Any]] = {
    "salaries": {"task": "tabular", "frames": ["stackoverflow"], "key": "Country", "departments": 5,
                 "options": {"label": "Salary"}, "model": "mlp"},
    "credit": {"task": "tabular", "frames": ["credit_data"], "key": "Home", "departments": 4,
               "options": {"label": "Status"}, "model": "mlp"},
    "reviews": {"task": "text", "frames": ["training_data", "testing_data"], "key": "product", "departments": 4,
                "options": {"text": "review", "label": "score", "ignore": "product"}, "model": "fasttext"},
    "digits": {"task": "image", "departments": 4},
}


def _rows(spec: dict[str, Any], limit: int, seed: int) -> list[dict[str, Any]]:
    """The frames' rows, gaps included: the proposed schema marks a column with gaps ``missing`` (credit:
    415 of 4,454 rows have one), as ``data schema`` proposes it to a department."""
    rows = [r for frame in spec["frames"] for r in modeldata_rows(frame)]
    if limit and limit < len(rows):
        keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=limit, replace=False))
        rows = [rows[i] for i in keep]
    return rows


def _write(path: Path, rows: list[dict[str, Any]], text: bool) -> Path:
    if text:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return path


def partitions(name: str, root: Path, *, seed: int, limit: int) -> tuple[dict[str, Path], dict[str, Any]]:
    """Each department's partition (the product's import path) and the run settings it needs."""
    spec = DATASETS[name]
    if spec["task"] == "image":
        names = [f"department-{i + 1}" for i in range(spec["departments"])]
        return prepare_partitions(root / "parts", names, seed=seed, method="dirichlet", alpha=0.5), {}
    rows = _rows(spec, limit, seed)
    text = spec["task"] == "text"
    suffix = ".jsonl" if text else ".csv"
    groups = natural_groups([str(r[spec["key"]]) for r in rows], spec["departments"])
    root.mkdir(parents=True, exist_ok=True)
    pool = _write(root / f"pool{suffix}", rows, text)
    schema = propose_schema(pool, spec["task"], spec["options"])
    parts = {}
    for number, members in enumerate(groups, start=1):
        department = f"department-{number}"
        source = _write(root / f"{department}{suffix}", [rows[i] for i in members], text)
        parts[department] = import_partition(source, root / "parts" / department, department=department,
                                             schema=schema, seed=seed).directory
    (root / "schema.json").write_text(json.dumps(schema))
    return parts, {"task": spec["task"], "task-schema": str(root / "schema.json"), "model": spec["model"]}


def federate(parts: dict[str, Path], settings: dict[str, Any], root: Path, *, seed: int,
             rounds: int | None) -> dict[str, Any]:
    """One masked in-process federation with the defaults; the run's view (per department figures)."""
    os.environ["QUORUMFL_HOME"] = str(root / "home")
    contexts = {1000 + i: Context(run_id=99, node_id=1000 + i, node_config={"data-path": str(p), "department": d},
                                  state=RecordDict(), run_config={})
                for i, (d, p) in enumerate(parts.items())}
    values = {"secure-aggregation": "masking", "seed": seed, "start-from": "fresh", **settings}
    if rounds is not None:
        values["num-rounds"] = rounds
    config = RunConfig.from_mapping(values)
    repo = Repository(connect(f"sqlite:///{root / 'state.db'}", migrate=True))
    federation = Federation(LoopbackGrid(contexts), config, repo, ModelStore(root / "models"), flower_run_id=99)
    return run_view(repo, federation.run())


def _features(data: Dataset, task: str, buckets: int) -> Any:
    """The encoded features as a matrix for the central baseline: text ids as a sparse count matrix."""
    if task != "text":
        return np.asarray(data.x, dtype=np.float64).reshape(len(data.x), -1)
    from scipy.sparse import csr_matrix

    ids = np.asarray(data.x)
    rows = np.repeat(np.arange(len(ids)), ids.shape[1])
    flat = ids.reshape(-1)
    kept = flat > 0  # 0 pads
    return csr_matrix((np.ones(int(kept.sum())), (rows[kept], flat[kept])), shape=(len(ids), buckets))


def central(parts: dict[str, Path], task: str, schema: dict[str, Any] | None) -> tuple[float, dict[str, float]]:
    """Ridge or logistic regression on every department's training rows pooled; each department's
    metric on its own test rows, and their example-weighted mean."""
    from scipy.sparse import vstack
    from sklearn.linear_model import LogisticRegression, Ridge

    buckets = int(schema["buckets"]) if task == "text" and schema else 0
    data = {d: read_partition(p) for d, p in parts.items()}
    x = [_features(part.train, task, buckets) for part in data.values()]
    y = np.concatenate([part.train.y for part in data.values()])
    pooled = vstack(x) if task == "text" else np.vstack(x)
    regression = next(iter(data.values())).test.objective.primary == "mae"
    model: Any = Ridge(alpha=1.0) if regression else LogisticRegression(max_iter=2000)
    model.fit(pooled, y)
    figures, weights = {}, {}
    for department, part in data.items():
        predicted = model.predict(_features(part.test, task, buckets))
        if regression:
            figures[department] = float(np.mean(np.abs(predicted - part.test.y)) * part.test.objective.unit)
        else:
            figures[department] = float(np.mean(predicted == part.test.y))
        weights[department] = len(part.test.y)
    mean = float(np.average([figures[d] for d in data], weights=[weights[d] for d in data]))
    return mean, figures


def one(name: str, seed: int, *, rounds: int | None, limit: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"quorumfl-own-{name}-") as tmp:
        root = Path(tmp)
        parts, settings = partitions(name, root / "data", seed=seed, limit=limit)
        schema = json.loads(Path(settings["task-schema"]).read_text()) if settings else None
        began = time.perf_counter()
        view = federate(parts, settings, root, seed=seed, rounds=rounds)
        seconds = time.perf_counter() - began
        primary = view["primary_metric"]
        rows = view["departments"]
        weights = [r["num-examples"] for r in rows]
        alone = [r[f"alone-{primary}"] for r in rows]
        worst = min(alone) if primary == "accuracy" else max(alone)
        central_mean, _ = central(parts, DATASETS[name]["task"], schema)
        return {"metric": primary, "federated": float(np.average([r[f"tuned-{primary}"] for r in rows], weights=weights)),
                "federated_global": float(np.average([r[primary] for r in rows], weights=weights)),
                "local_weighted": float(np.average(alone, weights=weights)), "local_worst": float(worst),
                "central": central_mean, "departments": len(rows), "status": view["status"],
                "rounds": view["rounds_completed"], "run_seconds": seconds}


def summarise(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    metric = runs[0]["metric"]
    higher = metric == "accuracy"
    mean = {k: float(np.mean([r[k] for r in runs])) for k in ("federated", "federated_global", "local_weighted",
                                                              "local_worst", "central", "run_seconds")}
    beats_local = mean["federated"] >= mean["local_weighted"] if higher else mean["federated"] <= mean["local_weighted"]
    near_central = (mean["federated"] >= mean["central"] - 0.03 if higher
                    else mean["federated"] <= mean["central"] * 1.05)
    return {"name": name, "metric": metric, "higher_is_better": higher, **mean,
            "seeds": len(runs), "per_seed": [{k: r[k] for k in ("federated", "local_weighted", "central")} for r in runs],
            "statuses": sorted({r["status"] for r in runs}), "departments": runs[0]["departments"],
            "goal_beats_local": bool(beats_local), "goal_near_central": bool(near_central)}


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 99, 0, 1  # outside a SuperNode
    seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
    rounds, limit = (2, 600) if args.smoke else (None, 0)
    began = time.perf_counter()
    datasets = [summarise(name, [one(name, seed, rounds=rounds, limit=limit) for seed in seeds])
                for name in args.datasets.split(",")]
    report({"datasets": datasets, "seeds": seeds, "defaults": True, "secure_aggregation": "masking",
            "goals_met": all(d["goal_beats_local"] and d["goal_near_central"] for d in datasets),
            "seconds": time.perf_counter() - began, "peak_rss_mb": peak_rss_mb()}, as_json=args.json)


if __name__ == "__main__":
    main()
