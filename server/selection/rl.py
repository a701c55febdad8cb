"""``RLSelector``: a small torch policy that scores each candidate node from its features
(``stats.FEATURES``), draws K nodes without replacement from the Plackett–Luce distribution of those
scores (Gumbel top-k) and a number of local epochs per node from a small set, and learns online by
policy-gradient with a moving baseline on ``base.round_reward`` (the fall of the server's validation
loss per minute, minus the share of chosen nodes that were late or failed): PPO's clipped surrogate over the
last ``memory`` rounds, ``steps`` passes per round (a round is one sample, so reusing a few recent
ones, with the ratio keeping the steps near the policy that chose them, learns much faster than
one REINFORCE step per round).

No FL framework ships a learned selector, so this is written here. Two choices go beyond textbook
policy gradients and are stated plainly: each chosen node's log-probability is weighted by the round's
advantage minus a shaping term for that node (missed the deadline or failed: one standard
deviation; finished much later than the round's median: up to one more), which assigns blame to
the node that cost the time; and rounds chosen by the heuristic also train the policy, weighted by
their advantage (advantage-weighted imitation; no importance ratio, so it is biased towards what the
heuristic does well, which is the intent).

The heuristic's rankings are also demonstrations: on its rounds the selection term carries an
extra constant weight ``imitation`` (behaviour cloning of Oort's ranking, so the agent starts from
what works and RL improves on it, notably the epochs, which Oort does not choose).

A ``Guard`` keeps a moving average of the reward under each policy. The heuristic (Oort) chooses
the first ``warmup`` rounds while the agent watches, then the agent gets one round; from then on
the agent leads while its average is within ``margin`` of the heuristic's and the heuristic leads
while the agent lags, with the other one given a probe round every ``probe_every`` rounds so both
averages stay current.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from quorumfl.errors import SelectionError
from quorumfl.server.selection.base import Selection, round_reward
from quorumfl.server.selection.oort import OortSelector
from quorumfl.server.selection.stats import FEATURES, NodeBook, Outcome, RoundFeedback, features

__all__ = ["Guard", "Policy", "RLSelector", "plackett_luce_log_prob"]

AGENT, HEURISTIC = "rl", "oort"


class Policy(nn.Module):
    """Node features → (selection score, logits over the epoch choices).

    The epoch logits also see what each choice costs: ``cost[i, e]``, node i's expected seconds at
    choice e over the typical node's at the run's epochs, weighted by a learned ``time_weight``
    (softplus, starts at 1), so a choice's time is known to the policy rather than learned from
    noise; the learned part decides how much more training is worth it."""

    def __init__(self, n_features: int, n_epochs: int, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh())
        self.score = nn.Linear(hidden, 1)
        self.epochs = nn.Linear(hidden, n_epochs)
        self.time_weight = nn.Parameter(torch.tensor(0.5413))  # softplus(0.5413) = 1

    def forward(self, x: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.score(h).squeeze(-1), self.epochs(h) - nn.functional.softplus(self.time_weight) * cost


def plackett_luce_log_prob(scores: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """log P(order) under Plackett–Luce, one term per position: s[π_i] − logsumexp(s over the not yet chosen)."""
    remaining = torch.ones_like(scores, dtype=torch.bool)
    terms = []
    for index in order:
        terms.append(scores[index] - torch.logsumexp(scores[remaining], dim=0))
        remaining = remaining.clone()
        remaining[index] = False
    return torch.stack(terms)


@dataclass
class Guard:
    """Which policy chooses the next round: see the module docstring."""

    margin: float = 0.1
    probe_every: int = 5
    smoothing: float = 0.3
    warmup: int = 5
    agent_avg: float | None = None
    heuristic_avg: float | None = None
    agent_rounds: int = 0
    heuristic_rounds: int = 0
    active: str = HEURISTIC
    since_probe: int = 0

    def choose(self) -> str:
        if self.heuristic_rounds < self.warmup:  # the agent first watches the heuristic (imitation)
            return HEURISTIC
        if self.agent_rounds < 1:
            return AGENT
        if self.since_probe >= self.probe_every:
            return HEURISTIC if self.active == AGENT else AGENT
        return self.active

    def record(self, who: str, reward: float) -> None:
        if who == AGENT:
            self.agent_avg = reward if self.agent_avg is None else self.smoothing * reward + (1 - self.smoothing) * self.agent_avg
            self.agent_rounds += 1
        else:
            self.heuristic_avg = (reward if self.heuristic_avg is None
                                  else self.smoothing * reward + (1 - self.smoothing) * self.heuristic_avg)
            self.heuristic_rounds += 1
        self.since_probe = 0 if who != self.active else self.since_probe + 1
        if self.agent_avg is not None and self.heuristic_avg is not None:
            lag = self.heuristic_avg - self.agent_avg
            self.active = HEURISTIC if lag > self.margin * abs(self.heuristic_avg) else AGENT


@dataclass
class _Sample:
    """One round to learn from: who chose, the candidates' features, the choice, and (once the round
    is over) each chosen node's weight; ``old_*`` are the agent's log-probabilities when it chose."""

    who: str
    nodes: list[int]
    x: np.ndarray
    cost: np.ndarray
    order: list[int]  # positions in ``nodes`` of the chosen, in choice order
    epoch_index: list[int]
    old_select: list[float]
    old_epochs: list[float]
    weights: list[float] | None = None

    def to_state(self) -> dict[str, Any]:
        return {"who": self.who, "x": self.x.tolist(), "cost": self.cost.tolist(), "order": self.order, "epoch-index": self.epoch_index,
                "old-select": self.old_select, "old-epochs": self.old_epochs, "weights": self.weights}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _Sample:
        x = np.asarray(state["x"], dtype=np.float32).reshape(-1, len(FEATURES))
        cost = np.asarray(state["cost"], dtype=np.float32).reshape(len(x), -1)
        return cls(str(state["who"]), list(range(len(x))), x, cost, [int(i) for i in state["order"]],
                   [int(i) for i in state["epoch-index"]], [float(v) for v in state["old-select"]],
                   [float(v) for v in state["old-epochs"]],
                   None if state["weights"] is None else [float(w) for w in state["weights"]])


class RLSelector:
    """Learned selection with an Oort fallback (``Guard``); ``epoch_choices`` are the local epochs it may give."""

    name = "rl"

    def __init__(
        self,
        *,
        seed: int,
        epochs: int,
        epoch_choices: Sequence[int],
        clusters: int = 1,
        learning_rate: float = 0.02,
        late_penalty: float = 1.0,
        entropy: float = 0.003,
        imitation: float = 1.0,
        memory: int = 16,
        steps: int = 4,
        clip: float = 0.2,
        guard: Guard | None = None,
    ) -> None:
        choices = sorted({int(e) for e in epoch_choices})
        if not choices or choices[0] < 1:
            raise SelectionError(f"epoch choices must be whole numbers >= 1, got {list(epoch_choices)}")
        if epochs not in choices:
            raise SelectionError(f"the run's local-epochs {epochs} must be one of the epoch choices {choices}")
        self.seed, self.epochs, self.epoch_choices, self.clusters = seed, epochs, choices, clusters
        self.late_penalty, self.entropy, self.imitation = late_penalty, entropy, imitation
        self.memory_size, self.steps, self.clip = memory, steps, clip
        self.memory: list[_Sample] = []
        self.book = NodeBook()
        self.heuristic = OortSelector(seed=seed, epochs=epochs, book=self.book, late_penalty=late_penalty)
        self.guard = guard or Guard()
        torch.manual_seed(seed)  # the initial weights; sampling uses its own per-round generator
        self.policy = Policy(len(FEATURES), len(choices))
        with torch.no_grad():  # prior: the configured epochs are the likeliest choice (p ≈ 0.6 with three)
            self.policy.epochs.bias[choices.index(epochs)] += 1.0
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=learning_rate)
        self.baseline: float | None = None
        self.spread = 1.0  # running standard deviation of the reward
        self.pending: _Sample | None = None
        self.updates = 0

    def select(self, number: int, available: Sequence[int], count: int) -> Selection:
        pool = sorted(int(n) for n in available)
        if not pool:
            raise SelectionError("no node is available to select")
        count = min(count, len(pool))
        x = features(self.book, pool, number, clusters=self.clusters)
        cost = self._costs(pool)
        who = self.guard.choose()
        if who == HEURISTIC:
            chosen = self.heuristic.select(number, pool, count)
            order = [pool.index(n) for n in chosen.nodes]
            epoch_index = [self.epoch_choices.index(chosen.epochs[n]) for n in chosen.nodes]
        else:
            rng = np.random.default_rng([self.seed, number, 2])
            with torch.no_grad():
                scores, logits = self.policy(torch.from_numpy(x), torch.from_numpy(cost))
            keys = scores.numpy().astype(np.float64) + rng.gumbel(size=len(pool))
            order = [int(i) for i in np.argsort(-keys, kind="stable")[:count]]
            probs = torch.softmax(logits, dim=-1).numpy().astype(np.float64)
            epoch_index = [int(rng.choice(len(self.epoch_choices), p=probs[i] / probs[i].sum())) for i in order]
        with torch.no_grad():
            old_select, old_epochs = self._log_probs(x, cost, order, epoch_index)
        self.pending = _Sample(who, pool, x, cost, order, epoch_index, old_select.tolist(), old_epochs.tolist())
        nodes = [pool[i] for i in order]
        epochs = {pool[i]: self.epoch_choices[e] for i, e in zip(order, epoch_index, strict=True)}
        return Selection(nodes=nodes, epochs=epochs, policy=who)

    def observe(self, feedback: RoundFeedback) -> float:
        self.book.observe(feedback)
        self.heuristic.learn(feedback)
        reward = round_reward(feedback, late_penalty=self.late_penalty)
        pending, self.pending = self.pending, None
        if pending is None:  # chosen before a restart: nothing to learn from
            return reward
        self.guard.record(pending.who, reward)
        if self.baseline is None:
            self.baseline = reward
            return reward
        advantage = (reward - self.baseline) / max(self.spread, 1e-6)
        self.spread = math.sqrt(0.9 * self.spread**2 + 0.1 * (reward - self.baseline) ** 2)
        self.baseline = 0.8 * self.baseline + 0.2 * reward
        self._learn(pending, feedback, float(np.clip(advantage, -3.0, 3.0)))
        return reward

    def _costs(self, pool: Sequence[int]) -> np.ndarray:
        """Expected seconds of each node at each epoch choice over the typical node's at the run's epochs."""
        typical = self.book.typical_seconds_per_epoch(pool)
        per_epoch = np.array([s.seconds_per_epoch if (s := self.book.nodes.get(n)) and s.seconds_per_epoch else typical
                              for n in pool])
        cost = per_epoch[:, None] * np.array(self.epoch_choices)[None, :] / (typical * self.epochs)
        return np.asarray(cost, dtype=np.float32)

    def _log_probs(self, x: np.ndarray, cost: np.ndarray, order: Sequence[int],
                   epoch_index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chosen node: log P(its place in the ranking) and log P(its epochs) under the current policy."""
        scores, logits = self.policy(torch.from_numpy(x), torch.from_numpy(cost))
        log_epochs = torch.log_softmax(logits[list(order)], dim=-1)
        return plackett_luce_log_prob(scores, order), log_epochs[torch.arange(len(order)), torch.tensor(epoch_index)]

    def _weights(self, sample: _Sample, feedback: RoundFeedback, advantage: float) -> list[float]:
        """The round's advantage per chosen node, minus its own share of the blame (module docstring)."""
        chosen = [sample.nodes[i] for i in sample.order]
        on_time = [r.seconds for n in chosen if (r := feedback.results.get(n)) and r.outcome is Outcome.OK and r.seconds]
        median = float(np.median(on_time)) if on_time else 0.0
        weights = []
        for node in chosen:
            result = feedback.results.get(node)
            shaped = advantage
            if result is None or result.outcome is not Outcome.OK:
                shaped -= 1.0
            elif result.seconds and feedback.seconds > 0:
                shaped -= min(1.0, max(0.0, (result.seconds - median) / feedback.seconds))
            weights.append(shaped)
        return weights

    def _learn(self, sample: _Sample, feedback: RoundFeedback, advantage: float) -> None:
        """PPO over the last ``memory`` rounds: ``steps`` passes of the clipped surrogate on the agent's
        own rounds (ratio to the probabilities it chose with), and advantage-weighted imitation on
        the heuristic's."""
        sample.weights = self._weights(sample, feedback, advantage)
        self.memory = [*self.memory, sample][-self.memory_size:]
        low, high = 1.0 - self.clip, 1.0 + self.clip
        for _ in range(self.steps):
            losses = []
            for past in self.memory:
                assert past.weights is not None
                weights = torch.tensor(past.weights, dtype=torch.float32)
                log_select, log_epochs = self._log_probs(past.x, past.cost, past.order, past.epoch_index)
                if past.who == AGENT:
                    objective = torch.zeros(())
                    for new, old in ((log_select, past.old_select), (log_epochs, past.old_epochs)):
                        ratio = torch.exp(new - torch.tensor(old, dtype=torch.float32))
                        objective = objective + torch.minimum(ratio * weights,
                                                              ratio.clamp(low, high) * weights).mean()
                    losses.append(-objective)
                else:  # the heuristic's epochs are fixed, so only its ranking is imitated
                    losses.append(-((weights + self.imitation) * log_select).mean() - (weights * log_epochs).mean())
            _, logits = self.policy(torch.from_numpy(sample.x), torch.from_numpy(sample.cost))
            log_all = torch.log_softmax(logits, dim=-1)
            entropy = -(log_all.exp() * log_all).sum(-1).mean()
            loss = torch.stack(losses).mean() - self.entropy * entropy
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()
        self.updates += 1

    # ---- persistence ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save({"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer)
        return {
            "book": self.book.to_state(),
            "pacer": self.heuristic.state(),
            "guard": asdict(self.guard),
            "baseline": self.baseline,
            "spread": self.spread,
            "updates": self.updates,
            "memory": [m.to_state() for m in self.memory],
            "features": list(FEATURES),
            "epoch-choices": self.epoch_choices,
            "weights": base64.b64encode(buffer.getvalue()).decode("ascii"),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        if list(state.get("features", [])) != list(FEATURES) or list(state.get("epoch-choices", [])) != self.epoch_choices:
            raise SelectionError(
                f"the stored RL agent was trained with features {state.get('features')} and epoch choices "
                f"{state.get('epoch-choices')}, this run uses {list(FEATURES)} and {self.epoch_choices}; keep "
                "'selection-epochs' as it was, or start a new agent with another 'selection-key'"
            )
        try:
            saved = torch.load(io.BytesIO(base64.b64decode(state["weights"])), weights_only=True)
            self.policy.load_state_dict(saved["policy"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.book = NodeBook.from_state(state["book"])
            self.heuristic.book = self.book
            self.heuristic.restore_pacer(state["pacer"])
            self.guard = Guard(**state["guard"])
            self.baseline = None if state["baseline"] is None else float(state["baseline"])
            self.spread = float(state["spread"])
            self.updates = int(state["updates"])
            self.memory = [_Sample.from_state(m) for m in state["memory"]]
        except SelectionError:
            raise
        except Exception as exc:  # a corrupt row must not start a silently different agent
            raise SelectionError(f"the stored RL agent cannot be restored ({exc.__class__.__name__}: {exc}); "
                                 "'quorumfl selection reset KEY' starts it afresh") from exc
