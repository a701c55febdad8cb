"""Federation vs each department's own model: every department trains a model alone on its own data
beside the federation (``quorumfl.client.alone``), reports its figure at the end, and ``runs show``,
the report and the closing tables flag a department for whom joining did not pay.

Planted: one department's labels follow another rule than the rest of the city's (each digit shifted
by five), so the federation's model is worse for it than one it trains alone; the others gain."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from quorumfl.cli.cmd_runs import DEPARTMENT_OPTIONAL
from quorumfl.cli.output import table
from quorumfl.client.alone import KIND
from quorumfl.client.personal_store import PersonalStore, node_state_dir
from quorumfl.client.tuned import KIND as TUNED
from quorumfl.client.tuned import finetune_epochs
from quorumfl.core.data.store import prepare_partitions, read_partition, write_partition
from quorumfl.core.models import arrays_to_model
from quorumfl.core.tasks import ModelSpec, image_schema
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.joining import GAIN, VERDICT, alone_sentence, compare_alone
from quorumfl.server.report import render_html, report_data
from quorumfl.server.services import department_columns, run_view

from .test_rounds import LoopbackGrid, _contexts, _federation, task_identity  # noqa: F401

PLANTED = "parks-permits"


def _city(root: Path) -> dict[str, Path]:
    """Four small departments (a quarter of their digits each): alone, each learns from few examples."""
    parts = prepare_partitions(root, ["tax-office", "urban-planning", "public-works", PLANTED], seed=3, method="iid")
    for name, directory in parts.items():
        part = read_partition(directory)
        small = len(part.train) // 4
        shift = 5 if name == PLANTED else 0
        train = dataclasses.replace(part.train, x=part.train.x[:small],
                                    y=((part.train.y[:small] + shift) % 10).astype(part.train.y.dtype))
        test = dataclasses.replace(part.test, y=((part.test.y + shift) % 10).astype(part.test.y.dtype))
        write_partition(directory, dataclasses.replace(part, train=train, test=test))
    return parts


def _reference_accuracy(node_id: int, part_dir: Path, run_key: str, kind: str = KIND) -> float:
    """A stored model's (alone, or tuned) accuracy on the department's test split, by plain torch and numpy."""
    part = read_partition(part_dir)
    stored = PersonalStore(node_state_dir({}, node_id), kind=kind).load(run_key)
    assert stored is not None
    schema = image_schema(part.test.name, part.test.input_shape, part.test.num_classes)
    import json

    model = ModelSpec("image", "mlp", json.dumps(schema)).build(seed=0)
    arrays_to_model(model, stored)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(part.test.x)).argmax(dim=1).numpy()
    return float(np.mean(predicted == part.test.y))


def test_the_department_better_alone_is_flagged_and_its_figure_is_its_own_models(tmp_path: Path) -> None:
    parts = _city(tmp_path / "city")
    contexts = _contexts(parts)
    # the federation's one model against the alone model (no fine-tuning: that is the next test's)
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"num-rounds": 4, "local-epochs": 5, "batch-size": 8,
                                                                        "seed": 2, "finetune-epochs": 0})
    run_id = federation.run()
    view = run_view(repo, run_id)
    rows = {r["department"]: r for r in view["departments"]}
    assert set(rows) == set(parts)
    # the planted department: near chance with the city's model, most of its digits right alone
    assert rows[PLANTED][VERDICT] == "no" and rows[PLANTED][GAIN] < -0.5
    assert rows[PLANTED]["alone-accuracy"] > 0.6 > 0.2 > rows[PLANTED]["accuracy"]
    flagged = [d for d, r in sorted(rows.items()) if r[VERDICT] == "no"]
    assert view["joining"] is not None and f"{PLANTED} (accuracy" in view["joining"]
    assert view["joining"].startswith(f"Joining paid for {4 - len(flagged)} of 4 departments")
    assert all(f"{d} (accuracy" in view["joining"] for d in flagged)

    for node_id, context in contexts.items():  # the reported figure is the stored alone model's (reference)
        name = str(context.node_config["department"])
        assert rows[name]["alone-accuracy"] == pytest.approx(_reference_accuracy(node_id, parts[name], "99"))

    shown = io.StringIO()
    Console(file=shown, width=80).print(table("Final models", view["departments"],
                                              department_columns(view["departments"], "accuracy"),
                                              optional=DEPARTMENT_OPTIONAL))
    text = shown.getvalue()
    assert PLANTED in text and "joining-paid" in text and "alone-accuracy" in text  # whole at 80 columns
    assert max(len(line) for line in text.splitlines()) <= 80

    data = report_data(repo, run_id)
    assert data["joining"] == view["joining"] and "It did not pay for" in render_html(data)


def test_each_department_keeps_the_federations_model_fine_tuned_on_its_data(tmp_path: Path) -> None:
    parts = _city(tmp_path / "city")
    contexts = _contexts(parts)
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"num-rounds": 4, "local-epochs": 5, "batch-size": 8,
                                                                        "seed": 2, "finetune-epochs": 3})
    rows = {r["department"]: r for r in run_view(repo, federation.run())["departments"]}
    for node_id, context in contexts.items():  # the reported figure is the kept tuned model's (reference)
        name = str(context.node_config["department"])
        assert rows[name]["tuned-accuracy"] == pytest.approx(_reference_accuracy(node_id, parts[name], "99", TUNED))
    # fine-tuning adapts the city's model to the planted department's own rule
    assert rows[PLANTED]["tuned-accuracy"] > rows[PLANTED]["accuracy"] + 0.3


def test_the_signed_fine_tuning_epochs_bound_what_the_server_asks() -> None:
    asked = TrainConfig(server_round=1, model="mlp", local_epochs=1, batch_size=8, learning_rate=0.05, proximal_mu=0.0,
                        seed=0, finetune_epochs=500)
    assert finetune_epochs({"finetune-epochs": 2}, asked) == 2  # the admin signed 2: a server asking 500 gets 2
    assert finetune_epochs({"finetune-epochs": 0}, asked) == 0
    assert finetune_epochs({}, asked) == 500  # an unsigned in-process federation: the request's


def test_a_signed_run_that_turns_the_baseline_off_keeps_no_alone_model(tmp_path: Path) -> None:
    parts = prepare_partitions(tmp_path / "city", ["tax-office", "urban-planning"], seed=1, method="iid")
    contexts = _contexts(parts)
    for context in contexts.values():  # the admin's signed run config says no, whatever the server asks
        context.run_config["local-baseline"] = False
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"local-baseline": True})
    run_id = federation.run()
    view = run_view(repo, run_id)
    assert view["joining"] is None and all("alone-accuracy" not in r for r in view["departments"])
    assert not any(any(node_state_dir({}, n).glob(f"{KIND}-*")) for n in contexts)


def test_the_comparison_takes_the_better_of_global_and_personal_and_knows_which_way_mae_goes() -> None:
    rows = [{"department": "a", "accuracy": 0.7, "personal-accuracy": 0.9, "alone-accuracy": 0.8},
            {"department": "b", "accuracy": 0.6, "alone-accuracy": 0.6}]
    a, b = compare_alone(rows, "accuracy")
    assert a[GAIN] == pytest.approx(0.1) and a[VERDICT] == "yes"
    assert b[GAIN] == 0 and b[VERDICT] == "no"  # no gain: joining did not pay
    mae = compare_alone([{"department": "c", "mae": 900.0, "alone-mae": 1000.0}], "mae")[0]
    assert mae[GAIN] == pytest.approx(100.0) and mae[VERDICT] == "yes"
    assert alone_sentence([{"department": "d", "accuracy": 0.5}], "accuracy") is None
