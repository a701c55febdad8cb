"""What a hyper-parameter search may try, in run-config terms, and what it may spend of privacy.

A search space is a ``[search]`` table of run-config keys (``quorumfl tune``'s config file)::

    [search]
    learning-rate = { low = 0.0005, high = 0.05, log = true }   # a float key: a range
    local-epochs = { low = 1, high = 4 }                        # an int key: a range of integers
    strategy = ["fedavg", "fedprox"]                            # any key: a list of choices

Each dimension becomes an Optuna distribution (float, int, categorical); every value a trial could
draw (both ends of a range, each choice) is checked against the key's declaration before the first
trial, so a search never starts a run the run config would refuse. Only training hyper-parameters
may be searched (``SEARCHABLE``): privacy, security, data and deployment settings stay as the admin
set them, for every trial.

The privacy plan: every trial is a federated run whose DP rounds each department's node charges to
its ε ledger, and the search releases every trial's figures (the best is chosen from them), so the
search spends, per department, the sum of its trials' ε (each trial's target ``dp-epsilon``; a pruned
trial spends less). ``privacy_plan`` gives that total; ``check_budget`` refuses a search whose total,
with what the departments have spent already, would pass their budget, before its first trial.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
    json_to_distribution,
)

from quorumfl.errors import ConfigError, PrivacyBudgetError
from quorumfl.server.config import DpMode, RunConfig, read_config_toml

__all__ = ["SEARCHABLE", "SearchSpace", "check_budget", "load_search_file", "privacy_plan"]

# The keys a search may vary: how nodes train and how the server combines. Everything else (secure
# aggregation, DP, the data, timeouts, the number of rounds) is the same for every trial.
SEARCHABLE = frozenset({
    "strategy", "proximal-mu", "clusters", "ifca-merge-distance", "ifca-reseed-noise", "ditto-lambda",
    "personal-layers", "server-momentum", "server-lr", "model", "local-epochs", "batch-size", "optimizer",
    "learning-rate", "clip-norm", "warmup-steps", "finetune-epochs", "fraction-train", "dp-clip",
    "compression-fraction",
})


@dataclass(frozen=True)
class SearchSpace:
    """Run-config key → the Optuna distribution its trials draw from."""

    dimensions: Mapping[str, BaseDistribution]

    @classmethod
    def parse(cls, table: Mapping[str, Any], base: Mapping[str, Any]) -> SearchSpace:
        """The ``[search]`` table, checked against the run-config declarations and ``base`` (the values
        every trial shares); every problem is reported at once."""
        if not table:
            raise ConfigError("the search space is empty: give a [search] table of run-config keys, e.g. "
                              "learning-rate = { low = 0.001, high = 0.1, log = true }")
        declared = RunConfig.declared()
        problems: list[str] = []
        dimensions: dict[str, BaseDistribution] = {}
        for name, spec in table.items():
            if name not in declared:
                problems.append(f"[search] {name}: not a run-config key ('quorumfl runs start --help' lists them)")
            elif name not in SEARCHABLE:
                problems.append(f"[search] {name}: cannot be searched (privacy, security, data and deployment "
                                f"settings stay as set for every trial); searchable: {', '.join(sorted(SEARCHABLE))}")
            else:
                dimension = _dimension(name, declared[name][1], spec, problems)
                if dimension is not None and _admissible(name, dimension, base, problems):
                    dimensions[name] = dimension
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(dimensions)

    def to_record(self) -> dict[str, str]:
        """The space as stored with each trial (Optuna's JSON of each distribution)."""
        return {name: distribution_to_json(d) for name, d in sorted(self.dimensions.items())}

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> SearchSpace:
        return cls({name: json_to_distribution(text) for name, text in record.items()})

    def describe(self) -> dict[str, str]:
        """Each dimension in words, for people: ``0.0005 … 0.05 (log)``, ``fedavg | fedprox``."""
        words: dict[str, str] = {}
        for name, d in sorted(self.dimensions.items()):
            if isinstance(d, CategoricalDistribution):
                words[name] = " | ".join(str(c) for c in d.choices)
            elif isinstance(d, FloatDistribution | IntDistribution):
                words[name] = f"{d.low:g} … {d.high:g}" + (" (log)" if d.log else "")
        return words


def load_search_file(path: Path) -> tuple[dict[str, Any], SearchSpace]:
    """A search's config file: the run config every trial shares (``[run]``) and its ``[search]``."""
    data = read_config_toml(path)
    run, table = data.get("run", {}), data.get("search")
    if not isinstance(run, dict) or not isinstance(table, dict) or set(data) - {"run", "search"}:
        raise ConfigError(f"{path}: a search config has two tables, [run] (the run config every trial shares) and "
                          "[search] (the run-config keys to vary, with their ranges or choices)")
    RunConfig.from_mapping(run)  # every problem of the shared config before the space's
    return run, SearchSpace.parse(table, run)


def _dimension(name: str, kind: Any, spec: Any, problems: list[str]) -> BaseDistribution | None:
    """One key's distribution from its ``[search]`` entry: a list of choices, or a range."""
    if isinstance(spec, list):
        if not spec or len(set(map(json.dumps, spec))) != len(spec):
            problems.append(f"[search] {name}: give a list of distinct choices, e.g. {name} = [a, b]")
            return None
        return CategoricalDistribution(spec)
    numeric = kind in (int, float)
    if not isinstance(spec, Mapping) or not numeric or set(spec) - {"low", "high", "log"} or not {"low", "high"} <= set(spec):
        example = "{ low = 0.001, high = 0.1, log = true }" if numeric else "[\"a\", \"b\"]"
        problems.append(f"[search] {name}: give {'a range ' if numeric else 'a list of choices '}{example}")
        return None
    low, high, log = spec["low"], spec["high"], spec.get("log", False)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not isinstance(log, bool) or not low < high or (log and low <= 0):
        problems.append(f"[search] {name}: low and high must be numbers with low < high (and low > 0 with "
                        f"log = true), got low = {low!r}, high = {high!r}, log = {log!r}")
        return None
    if kind is int:
        if not all(isinstance(v, int) for v in (low, high)):
            problems.append(f"[search] {name}: is an integer key; give whole-number low and high")
            return None
        return IntDistribution(int(low), int(high), log=log)
    return FloatDistribution(float(low), float(high), log=log)


def _admissible(name: str, dimension: BaseDistribution, base: Mapping[str, Any], problems: list[str]) -> bool:
    """Whether every value the dimension can give makes a valid run config with ``base``."""
    if isinstance(dimension, CategoricalDistribution):
        values: list[Any] = list(dimension.choices)
    elif isinstance(dimension, FloatDistribution | IntDistribution):
        values = [dimension.low, dimension.high]
    else:  # not made by _dimension
        raise AssertionError(dimension)
    fine = True
    for value in values:
        try:
            RunConfig.from_mapping({**base, name: _plain(value)})
        except ConfigError as exc:
            problems.append(f"[search] {name} = {value!r} would make an invalid run: {exc}")
            fine = False
    return fine


def _plain(value: Any) -> Any:
    """A drawn value as a run-config value (StrEnum members never occur: choices come from TOML)."""
    return value.value if isinstance(value, StrEnum) else value


def privacy_plan(base: RunConfig, trials: int) -> float | None:
    """The ε per department that ``trials`` runs of ``base`` may spend in all (None: no DP)."""
    if base.dp is DpMode.NONE:
        return None
    if base.dp_epsilon <= 0:
        raise ConfigError("a search under DP needs each trial's target ε before it starts: set dp-epsilon "
                          "(and dp-noise-multiplier = 0)")
    return trials * base.dp_epsilon


def check_budget(planned: float | None, spent: float, budget: float) -> None:
    """Refuse a search that would take a department past ``budget`` (``spent``: the most any
    department has spent already)."""
    if planned is None:
        return
    if spent + planned > budget:
        raise PrivacyBudgetError(
            f"the search would spend up to ε = {planned:g} per department (its trials' dp-epsilon, added up) on "
            f"top of ε = {spent:.3g} already spent, past the budget ε = {budget:g}; run fewer trials or lower "
            "dp-epsilon")
