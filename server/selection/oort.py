"""``OortSelector``: guided participant selection after Oort (Lai et al., OSDI 2021), the strongest
heuristic we know of; FedScale ships it for simulation only, so it is written here against our node
statistics.

Utility of an explored node = statistical utility (samples × recent training loss, scaled to the
best node, plus a staleness bonus √(0.1·ln t / last round chosen)) × system utility ((T / d)^α when
its expected duration d exceeds the preferred round time T) × (1 − its late/failure rate). T is a
percentile of the known durations (30th to start, as in Oort's code). A share ε of the places goes
to unexplored nodes (ε decays from 0.9 to ``min_exploration``); the rest is sampled, proportionally
to utility, among nodes within ``cutoff`` of the K-th best. The pacer raises T's percentile by
``pacer_step`` points when the utility collected over the last ``pacer_window`` rounds fell.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import SelectionError
from quorumfl.server.selection.base import Selection, round_reward
from quorumfl.server.selection.stats import NodeBook, Outcome, RoundFeedback

__all__ = ["OortSelector"]


class OortSelector:
    name = "oort"

    def __init__(
        self,
        *,
        seed: int,
        epochs: int,
        book: NodeBook | None = None,
        exploration: float = 0.9,
        exploration_decay: float = 0.95,
        min_exploration: float = 0.1,
        straggler_penalty: float = 2.0,
        cutoff: float = 0.95,
        pacer_window: int = 5,
        pacer_step: float = 10.0,
        late_penalty: float = 1.0,
    ) -> None:
        if not 0.0 <= min_exploration <= exploration <= 1.0:
            raise SelectionError(f"Oort exploration must satisfy 0 <= min ({min_exploration}) <= start ({exploration}) <= 1")
        if not 0.0 < cutoff <= 1.0 or pacer_window < 1 or pacer_step < 0 or straggler_penalty < 0:
            raise SelectionError("Oort needs 0 < cutoff <= 1, pacer_window >= 1, pacer_step >= 0, straggler_penalty >= 0")
        self.seed = seed
        self.epochs = epochs
        self.book = book if book is not None else NodeBook()
        self.exploration, self.exploration_decay, self.min_exploration = exploration, exploration_decay, min_exploration
        self.straggler_penalty, self.cutoff = straggler_penalty, cutoff
        self.pacer_window, self.pacer_step, self.late_penalty = pacer_window, pacer_step, late_penalty
        self.percentile = 30.0  # T is this percentile of the known durations
        self.collected: list[float] = []  # statistical utility gathered per round (the pacer's signal)

    def epsilon(self) -> float:
        return max(self.min_exploration, self.exploration * self.exploration_decay ** self.book.rounds)

    def preferred_seconds(self) -> float | None:
        """T: the pacer's percentile of every known node's duration at the configured epochs."""
        known = [s.seconds_per_epoch * self.epochs for s in self.book.nodes.values() if s.seconds_per_epoch]
        return float(np.percentile(known, self.percentile)) if known else None

    def utilities(self, number: int, nodes: Sequence[int]) -> NDArray[np.float64]:
        """Oort's utility of each (explored) node for round ``number``."""
        stats = [self.book.get(n) for n in nodes]
        losses = [s.loss for s in stats if s.loss is not None]
        floor = min(losses) if losses else 1.0
        stat = np.array([(s.samples or 1.0) * (s.loss if s.loss is not None else floor) for s in stats])
        stat = stat / stat.max() if stat.max() > 0 else np.ones_like(stat)
        bonus = np.array([math.sqrt(0.1 * math.log(max(number, 2)) / max(s.last_selected, 1)) for s in stats])
        utility = stat + bonus
        durations = np.array([(s.seconds_per_epoch or 0.0) * self.epochs for s in stats])
        preferred = self.preferred_seconds()
        if preferred:
            slow = durations > preferred
            utility[slow] *= (preferred / durations[slow]) ** self.straggler_penalty
        utility *= np.array([1.0 - s.failure_rate() for s in stats])
        return np.asarray(np.maximum(utility, 1e-12), dtype=np.float64)

    def select(self, number: int, available: Sequence[int], count: int) -> Selection:
        pool = sorted(int(n) for n in available)
        if not pool:
            raise SelectionError("no node is available to select")
        count = min(count, len(pool))
        rng = np.random.default_rng([self.seed, number, 1])
        explored = [n for n in pool if self.book.get(n).explored]
        fresh = [n for n in pool if not self.book.get(n).explored]
        n_explore = min(len(fresh), round(self.epsilon() * count))
        n_explore = max(n_explore, count - len(explored))  # too few explored nodes: explore the rest
        n_exploit = count - n_explore
        chosen: list[int] = []
        if n_exploit:
            utility = self.utilities(number, explored)
            ranked = np.argsort(-utility, kind="stable")
            bar = self.cutoff * utility[ranked[n_exploit - 1]]
            candidates = [i for i in ranked if utility[i] >= bar]
            weights = utility[candidates] / utility[candidates].sum()
            picks = rng.choice(len(candidates), size=n_exploit, replace=False, p=weights)
            chosen = [explored[candidates[int(i)]] for i in sorted(picks, key=lambda i: -utility[candidates[int(i)]])]
        if n_explore:
            chosen += [fresh[int(i)] for i in rng.choice(len(fresh), size=n_explore, replace=False)]
        return Selection(nodes=chosen, epochs={n: self.epochs for n in chosen}, policy=self.name)

    def learn(self, feedback: RoundFeedback) -> None:
        """The pacer: relax T when the statistical utility collected per window has fallen."""
        self.collected.append(sum((r.samples or 1.0) * (r.loss or 0.0) for r in feedback.results.values()
                                  if r.outcome is Outcome.OK))
        w = self.pacer_window
        if len(self.collected) >= 2 * w and len(self.collected) % w == 0:
            if sum(self.collected[-w:]) < sum(self.collected[-2 * w:-w]):
                self.percentile = min(100.0, self.percentile + self.pacer_step)
        del self.collected[:-2 * w]

    def observe(self, feedback: RoundFeedback) -> float:
        self.book.observe(feedback)
        self.learn(feedback)
        return round_reward(feedback, late_penalty=self.late_penalty)

    def state(self) -> dict[str, Any]:
        return {"book": self.book.to_state(), "percentile": self.percentile, "collected": self.collected}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.restore_pacer(state)
        if "book" not in state:
            raise SelectionError("stored Oort state has no 'book'")
        self.book = NodeBook.from_state(state["book"])

    def restore_pacer(self, state: Mapping[str, Any]) -> None:
        try:
            self.percentile = float(state["percentile"])
            self.collected = [float(v) for v in state["collected"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SelectionError(f"stored Oort pacer state is unusable ({exc})") from exc
