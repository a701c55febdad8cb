"""Run config: defaults, every problem reported at once, TOML files, pyproject defaults in sync."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from quorumfl.deploy.control import app_pyproject
from quorumfl.errors import ConfigError
from quorumfl.server.config import DEFAULTS, RunConfig, StrategyName, load_run_config_file

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_resolve() -> None:
    config = RunConfig.from_mapping({})
    assert config.strategy is StrategyName.FEDPROX and config.num_rounds == 5
    assert config.resolved()["proximal-mu"] == DEFAULTS["proximal-mu"]


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(
            {"strategy": "fedsgd", "num-rounds": 0, "model": "resnet", "learning-rate": -1, "colour": "red", "batch-size": 2.5}
        )
    text = str(info.value)
    for needle in ("strategy must be one of", "num-rounds must be >= 1", "model must be one of",
                   "learning-rate must be > 0.0", "unknown key 'colour'", "batch-size must be a whole number"):
        assert needle in text
    assert len(info.value.problems) == 6


def test_an_unknown_key_names_the_closest_known_one_not_all_of_them() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"local-epoch": 3, "colour": "red"})
    assert "unknown key 'local-epoch': did you mean 'local-epochs'?" in str(info.value)
    assert "unknown key 'colour': the README's run-config table lists every key" in str(info.value)
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
