"""Run config: defaults, every problem reported at once, TOML files, and each key declared once (the
run-config reference table, the Flower app defaults and the node's train config derived from the declaration)."""

from __future__ import annotations

import shutil
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from quorumfl.deploy.control import app_pyproject
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import (
    DEFAULTS,
    RunConfig,
    StrategyName,
    derived_files,
    key,
    load_run_config_file,
    run_config_table,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_resolve() -> None:
    config = RunConfig.from_mapping({})
    assert config.strategy is StrategyName.FEDAVG and config.num_rounds == 5 and config.server_step() == (0.5, 1.0)
    assert config.resolved()["proximal-mu"] == DEFAULTS["proximal-mu"]


@pytest.mark.parametrize(("given", "expected"), [
    ({}, ("sgd", 0.05)),  # the image task's
    ({"optimizer": "adam"}, ("adam", 0.003)),  # another optimizer than the task's: its usual rate
    ({"optimizer": "adam", "learning-rate": 0.01}, ("adam", 0.01)),
    ({"learning-rate": 0.2}, ("sgd", 0.2)),
])
def test_the_optimizer_and_rate_are_the_tasks_unless_the_run_names_them(given: dict[str, Any],
                                                                         expected: tuple[str, float]) -> None:
    config = RunConfig.from_mapping(given)
    assert config.training() == expected
    settings = config.node_settings()
    assert (settings["optimizer"], settings["learning_rate"]) == expected  # what the nodes are told


def test_tables_and_texts_train_with_adam_by_default() -> None:
    from quorumfl.core.tasks import get_task, training_defaults

    assert training_defaults(get_task("tabular")) == ("adam", 0.003)
    assert training_defaults(get_task("text")) == ("adam", 0.01)
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        RunConfig.from_mapping({"optimizer": "rmsprop"})


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(
            {"strategy": "fedsgd", "num-rounds": 0, "model": "resnet", "learning-rate": -1, "colour": "red", "batch-size": 2.5}
        )
    text = str(info.value)
    for needle in ("strategy must be one of", "num-rounds must be >= 1", "model must be one of",
                   "learning-rate must be >= 0.0", "unknown key 'colour'", "batch-size must be a whole number"):
        assert needle in text
    assert len(info.value.problems) == 6


def test_an_unknown_key_names_the_closest_known_one_not_all_of_them() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"local-epoch": 3, "colour": "red"})
    assert "unknown key 'local-epoch': did you mean 'local-epochs'?" in str(info.value)
    assert "unknown key 'colour': docs/reference/run-config.md lists every key" in str(info.value)
    assert "proximal-mu" not in str(info.value)  # not a list of all the keys


def test_ints_accepted_for_floats() -> None:
    assert RunConfig.from_mapping({"round-timeout": 30}).round_timeout == 30.0


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[run]\nstrategy = "fedavg"\nnum-rounds = 3\n')
    assert load_run_config_file(path) == {"strategy": "fedavg", "num-rounds": 3}
    path.write_text("num-rounds = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config_file(tmp_path / "nope.toml")


def test_pyproject_app_config_matches_defaults() -> None:
    """`flwr run .` and `quorumfl runs start` must start the same run."""
    repo_defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert repo_defaults == DEFAULTS
    fab_defaults = tomllib.loads(app_pyproject().decode())["tool"]["flwr"]["app"]["config"]
    assert fab_defaults == DEFAULTS


def test_the_reference_table_and_pyproject_defaults_are_the_declarations() -> None:
    """Both are generated (`python -m quorumfl.server.config --write`); an edit by hand fails here."""
    for path, text in derived_files(ROOT).items():
        assert path.read_text() == text, f"{path.name} is out of date: run `python -m quorumfl.server.config --write`"


def test_a_key_declared_once_is_parsed_validated_defaulted_and_documented(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class Extended(RunConfig):
        patience: int = key(3, "rounds without a better loss before the run stops", low=1, high=100,
                            applies="fedavg, fedprox")

    assert Extended.from_mapping({}).patience == 3
    assert Extended.from_mapping({"patience": 7, "num-rounds": 2}).patience == 7
    with pytest.raises(ConfigError) as info:
        Extended.from_mapping({"patience": 0, "num-rounds": 0})
    assert str(info.value) == "num-rounds must be >= 1 and <= 10000, got 0; patience must be >= 1 and <= 100, got 0"
    with pytest.raises(ConfigError, match="patience must be a whole number, got 2.5"):
        Extended.from_mapping({"patience": 2.5})
    with pytest.raises(ConfigError, match="unknown key 'patience'"):
        RunConfig.from_mapping({"patience": 3})  # the base declaration does not have it
    assert Extended.from_mapping({"patience": 5}).resolved()["patience"] == 5  # stored with the run

    manifest = tomllib.loads(app_pyproject(Extended.defaults()).decode())  # the Flower app bundle
    assert manifest["tool"]["flwr"]["app"]["config"]["patience"] == 3
    assert "| `patience` | `3` | fedavg, fedprox | rounds without a better loss before the run stops |" in (
        run_config_table(Extended))
    for name in ("docs/reference/run-config.md", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    derived = {path.name: text for path, text in derived_files(tmp_path, Extended).items()}
    assert "| `patience` | `3` |" in derived["run-config.md"]
    assert tomllib.loads(derived["pyproject.toml"])["tool"]["flwr"]["app"]["config"] == Extended.defaults()


def test_node_settings_are_train_config_fields() -> None:
    """What the node's train config takes from the run config is derived from the declarations."""
    config = RunConfig.from_mapping({"compression": "randk", "dp": "local", "local-epochs": 2})
    settings = config.node_settings()
    assert set(settings) <= {f.name for f in fields(TrainConfig)}
    train = TrainConfig(server_round=1, proximal_mu=0.0, **settings)
    assert (train.local_epochs, train.compression, train.dp, train.model) == (2, "randk", "local", "mlp")


@pytest.mark.parametrize("strategy", ["ifca", "scaffold"])
def test_server_momentum_is_ignored_where_there_is_no_one_global_model(strategy: str) -> None:
    assert RunConfig.from_mapping({"strategy": strategy, "server-momentum": 0.9}).server_step() == (0.0, 1.0)
    with pytest.raises(ConfigError, match="server-momentum must be"):
        RunConfig.from_mapping({"server-momentum": 1.0})
    assert RunConfig.from_mapping({"strategy": "fedper", "server-momentum": 0.9, "server-lr": 0.5}).server_step() == (0.9, 0.5)
