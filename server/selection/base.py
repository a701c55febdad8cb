"""The selector contract (choose nodes and their local epochs; learn from the outcome), the reward
every learning selector uses, and ``RandomSelector``, the seeded uniform baseline."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from quorumfl.errors import SelectionError
from quorumfl.server.selection.stats import NodeBook, Outcome, RoundFeedback

__all__ = ["RandomSelector", "Selection", "Selector", "check_selection", "round_reward"]


@dataclass(frozen=True)
class Selection:
    """The nodes chosen for a round, in the selector's order of preference, with local epochs each;
    ``policy`` names what chose them (``random``, ``oort``, ``rl``)."""

    nodes: list[int]
    epochs: dict[int, int]
    policy: str


class Selector(Protocol):
    name: str
    book: NodeBook

    def select(self, number: int, available: Sequence[int], count: int) -> Selection:
        """``count`` distinct nodes of ``available`` (fewer only if fewer are available)."""
        ...

    def observe(self, feedback: RoundFeedback) -> float:
        """Learn from a finished round; returns the round's reward."""
        ...

    def state(self) -> dict[str, Any]:
        """Everything needed to continue after a restart, as JSON-compatible values."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        ...


def check_selection(selection: Selection, available: Sequence[int], count: int, epoch_choices: Sequence[int]) -> None:
    """Fail closed when a selector breaks its contract: a node that is not available (disabled,
    offline), a repeated node, the wrong count, or epochs outside the allowed set."""
    pool = set(available)
    wanted = min(count, len(pool))
    problems = []
    if len(selection.nodes) != wanted:
        problems.append(f"chose {len(selection.nodes)} node(s), the round asks for {wanted}")
    if len(set(selection.nodes)) != len(selection.nodes):
        problems.append("chose a node twice")
    if outside := sorted(set(selection.nodes) - pool):
        problems.append(f"chose unavailable node(s) {outside}")
    if set(selection.epochs) != set(selection.nodes) or any(e not in epoch_choices for e in selection.epochs.values()):
        problems.append(f"epochs {selection.epochs} are not one of {list(epoch_choices)} per chosen node")
    if problems:
        raise SelectionError(f"selector '{selection.policy}': " + "; ".join(problems))


def round_reward(feedback: RoundFeedback, *, late_penalty: float) -> float:
    """The round's progress per minute, minus ``late_penalty`` times the share of chosen nodes that
    missed the deadline or failed. Progress is the fall of the server's validation loss (×100) when
    the feedback has it, else the validation-accuracy gain in points: the loss moves much more
    smoothly from round to round, so the agent and the guard learn from less noise."""
    minutes = max(feedback.seconds, 1e-3) / 60.0
    before, after = feedback.loss_before, feedback.loss_after
    if before is not None and after is not None and math.isfinite(before) and math.isfinite(after):
        gain = 100.0 * (before - after) / minutes
    else:
        gain = 100.0 * (feedback.accuracy_after - feedback.accuracy_before) / minutes
    chosen = len(feedback.results)
    missed = sum(1 for r in feedback.results.values() if r.outcome is not Outcome.OK)
    return float(gain - late_penalty * (missed / chosen if chosen else 0.0))


class RandomSelector:
    """Uniform sample without replacement, seeded per round (the same nodes for the same seed,
    round and pool), every node with the configured local epochs."""

    name = "random"

    def __init__(self, *, seed: int, epochs: int) -> None:
        self.seed = seed
        self.epochs = epochs
        self.book = NodeBook()

    def select(self, number: int, available: Sequence[int], count: int) -> Selection:
        pool = sorted(int(n) for n in available)
        if not pool:
            raise SelectionError("no node is available to select")
        rng = np.random.default_rng([self.seed, number])
        # Sample positions, not ids: Flower's ids are uint64 and would lose precision in a float array.
        nodes = [pool[int(i)] for i in rng.choice(len(pool), size=min(count, len(pool)), replace=False)]
        return Selection(nodes=nodes, epochs={n: self.epochs for n in nodes}, policy=self.name)

    def observe(self, feedback: RoundFeedback) -> float:
        self.book.observe(feedback)
        return round_reward(feedback, late_penalty=0.0)

    def state(self) -> dict[str, Any]:
        return {"book": self.book.to_state()}

    def restore(self, state: Mapping[str, Any]) -> None:
        if "book" not in state:
            raise SelectionError("stored random-selector state has no 'book'")
        self.book = NodeBook.from_state(state["book"])
