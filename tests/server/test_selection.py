"""Client selectors: the contract (only available nodes, K respected, epochs from the allowed set),
the Plackett–Luce likelihood against brute-force enumeration, the guard's switching, Oort's
preference for fast nodes, the RL agent learning to avoid slow ones, and state round trips."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.errors import ConfigError, SelectionError
from quorumfl.server.config import RunConfig
from quorumfl.server.selection import (
    SELECTORS,
    Guard,
    NodeBook,
    NodeResult,
    OortSelector,
    Outcome,
    RandomSelector,
    RLSelector,
    RoundFeedback,
    Selection,
    build_selector,
    check_selection,
    features,
    round_reward,
)
from quorumfl.server.selection.rl import plackett_luce_log_prob
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

CHOICES = (1, 2, 4)


def _selector(name: str, seed: int = 0) -> object:
    return build_selector(name, seed=seed, epochs=2, epoch_choices=CHOICES)


def _feedback(number: int, selection: Selection, speed: dict[int, float], *, deadline: float | None = None,
              gain: float = 0.01) -> RoundFeedback:
    """Node n takes epochs / speed[n] seconds; past the deadline it is late; the round lasts until
    the slowest on-time node (or the deadline)."""
    results: dict[int, NodeResult] = {}
    for node in selection.nodes:
        seconds = selection.epochs[node] / speed[node]
        late = deadline is not None and seconds > deadline
        results[node] = NodeResult(Outcome.LATE if late else Outcome.OK, selection.epochs[node],
                                   seconds=None if late else seconds, loss=1.0, samples=100.0)
    on_time = [r.seconds for r in results.values() if r.seconds is not None]
    length = deadline if deadline is not None and len(on_time) < len(results) else max(on_time, default=1.0)
    return RoundFeedback(number, results, length, 0.5, 0.5 + gain, deadline=deadline)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(SELECTORS), pool=st.sets(st.integers(1, 2**63), min_size=1, max_size=30),
       offline=st.data(), count=st.integers(1, 12), rounds=st.integers(1, 4), seed=st.integers(0, 5))
def test_selectors_choose_only_available_nodes_and_respect_k(name: str, pool: set[int], offline: st.DataObject,
                                                            count: int, rounds: int, seed: int) -> None:
    selector = _selector(name, seed)
    nodes = sorted(pool)
    speed = {n: 0.5 + (n % 7) for n in nodes}
    for number in range(1, rounds + 1):
        # Disabled or offline nodes are simply not offered; they must never come back.
        available = offline.draw(st.lists(st.sampled_from(nodes), min_size=1, unique=True))
        selection = selector.select(number, available, count)  # type: ignore[attr-defined]
        check_selection(selection, available, count, CHOICES)
        assert set(selection.nodes) <= set(available)
        assert len(selection.nodes) == min(count, len(available))
        selector.observe(_feedback(number, selection, speed))  # type: ignore[attr-defined]


def test_check_selection_fails_closed() -> None:
    ok = Selection(nodes=[1, 2], epochs={1: 2, 2: 2}, policy="rl")
    check_selection(ok, [1, 2, 3], 2, CHOICES)
    with pytest.raises(SelectionError, match=r"unavailable node\(s\) \[9\]"):
        check_selection(Selection(nodes=[1, 9], epochs={1: 2, 9: 2}, policy="rl"), [1, 2, 3], 2, CHOICES)
    with pytest.raises(SelectionError, match="asks for 2"):
        check_selection(Selection(nodes=[1, 2, 3], epochs={1: 2, 2: 2, 3: 2}, policy="rl"), [1, 2, 3], 2, CHOICES)
    with pytest.raises(SelectionError, match="twice"):
        check_selection(Selection(nodes=[1, 1], epochs={1: 2}, policy="rl"), [1, 2, 3], 2, CHOICES)
    with pytest.raises(SelectionError, match="epochs"):
        check_selection(Selection(nodes=[1, 2], epochs={1: 3, 2: 2}, policy="rl"), [1, 2, 3], 2, CHOICES)


def test_selector_names_agree_with_the_config() -> None:
    assert tuple(SELECTORS) == RunConfig.declared()["selector"][2].choices


def test_random_selection_is_seeded_per_round() -> None:
    a, b = RandomSelector(seed=3, epochs=1), RandomSelector(seed=3, epochs=1)
    pool = list(range(100, 120))
    assert a.select(4, pool, 5) == b.select(4, pool, 5)
    assert a.select(4, pool, 5).nodes != a.select(5, pool, 5).nodes


def test_plackett_luce_probabilities_sum_to_one_over_all_orderings() -> None:
    scores = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7])
    for k in (1, 2, 3):
        total = sum(math.exp(float(plackett_luce_log_prob(scores, order).sum()))
                    for order in itertools.permutations(range(5), k))
        assert total == pytest.approx(1.0, abs=1e-5)
    # One position: the softmax itself.
    first = plackett_luce_log_prob(scores, [2]).exp()
    assert float(first) == pytest.approx(float(torch.softmax(scores, 0)[2]), rel=1e-6)


def test_guard_falls_back_while_the_agent_lags_and_returns() -> None:
    guard = Guard(margin=0.1, probe_every=3, warmup=3)
    # Warm-up: the heuristic leads while the agent watches, then the agent gets a round.
    warm = []
    for _ in range(4):
        who = guard.choose()
        warm.append(who)
        guard.record(who, 1.0 if who == "rl" else 5.0)
    assert warm == ["oort", "oort", "oort", "rl"]
    assert guard.active == "oort"  # the agent lags the heuristic
    chosen = []
    for _ in range(8):
        who = guard.choose()
        chosen.append(who)
        guard.record(who, 1.0 if who == "rl" else 5.0)
    assert chosen.count("oort") >= 6 and "rl" in chosen  # fallback, with probe rounds for the agent
    for _ in range(20):  # the agent now does better: it takes over again
        who = guard.choose()
        guard.record(who, 10.0 if who == "rl" else 5.0)
    assert guard.active == "rl"


def test_rl_selector_switches_to_oort_when_its_choices_earn_less() -> None:
    selector = RLSelector(seed=0, epochs=2, epoch_choices=CHOICES)
    pool = list(range(1, 21))
    speed = {n: 1.0 for n in pool}
    policies = []
    for number in range(1, 30):
        selection = selector.select(number, pool, 4)
        policies.append(selection.policy)
        gain = 0.0 if selection.policy == "rl" else 0.02  # an agent that never helps
        selector.observe(_feedback(number, selection, speed, gain=gain))
    assert selector.guard.active == "oort"
    assert policies[-10:].count("oort") >= 7


def test_oort_prefers_fast_nodes_once_explored() -> None:
    oort = OortSelector(seed=0, epochs=2, exploration=0.9, min_exploration=0.0, exploration_decay=0.5)
    pool = list(range(20))
    speed = {n: (10.0 if n < 10 else 0.1) for n in pool}
    for number in range(1, 16):
        oort.observe(_feedback(number, oort.select(number, pool, 5), speed))
    late_rounds = [oort.select(number, pool, 5).nodes for number in range(16, 26)]
    fast = sum(n < 10 for nodes in late_rounds for n in nodes)
    assert fast / (5 * len(late_rounds)) >= 0.8


def test_rl_agent_learns_to_avoid_nodes_that_miss_the_deadline() -> None:
    """Half the nodes are 50x slower and always miss the deadline; with the guard kept on the agent
    (margin so large it never falls back) the policy itself must learn to leave them out."""
    pool = list(range(30))
    speed = {n: (5.0 if n % 2 == 0 else 0.1) for n in pool}
    selector = RLSelector(seed=1, epochs=2, epoch_choices=CHOICES,
                          guard=Guard(margin=1e9, probe_every=10**6, warmup=0, active="rl"))
    slow_share = []
    for number in range(1, 61):
        selection = selector.select(number, pool, 6)
        if selection.policy == "rl":
            slow_share.append(sum(n % 2 for n in selection.nodes) / 6)
        selector.observe(_feedback(number, selection, speed, deadline=2.0))
    assert len(slow_share) == 60  # the agent chose every round
    assert np.mean(slow_share[:2]) > 0.3  # it starts near random (half slow)
    assert np.mean(slow_share[-10:]) < 0.15


def _trained_rl() -> tuple[RLSelector, list[int]]:
    selector = RLSelector(seed=4, epochs=2, epoch_choices=CHOICES)
    pool = [2**40 + i for i in range(12)]  # Flower ids are large
    speed = {n: 1.0 + i for i, n in enumerate(pool)}
    for number in range(1, 9):
        selector.observe(_feedback(number, selector.select(number, pool, 3), speed, deadline=1.5))
    return selector, pool


def test_rl_state_round_trips_through_json() -> None:
    selector, pool = _trained_rl()
    state = json.loads(json.dumps(selector.state()))
    again = RLSelector(seed=4, epochs=2, epoch_choices=CHOICES)
    again.restore(state)
    for a, b in zip(selector.policy.parameters(), again.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    assert again.guard == selector.guard and again.book == selector.book
    assert again.select(9, pool, 3) == selector.select(9, pool, 3)


def test_rl_state_round_trips_through_the_state_db(db_url: str) -> None:
    repo = Repository(connect(db_url, migrate=True))
    selector, pool = _trained_rl()
    repo.save_selector_state("rl:test", kind="rl", rounds=selector.book.rounds, state=selector.state())
    row = repo.selector_state("rl:test")
    assert row is not None and row.rounds == 8 and row.kind == "rl"
    again = RLSelector(seed=4, epochs=2, epoch_choices=CHOICES)
    again.restore(row.state)
    assert again.select(9, pool, 3) == selector.select(9, pool, 3)
    with pytest.raises(ConfigError, match="holds a 'rl' selector"):
        repo.save_selector_state("rl:test", kind="oort", rounds=1, state={})
    repo.delete_selector_state("rl:test")
    assert repo.selector_state("rl:test") is None


def test_unusable_stored_state_fails_closed() -> None:
    selector, _ = _trained_rl()
    state = selector.state()
    with pytest.raises(SelectionError, match="epoch choices"):
        RLSelector(seed=4, epochs=2, epoch_choices=(1, 2)).restore(state)
    with pytest.raises(SelectionError, match="cannot be restored"):
        RLSelector(seed=4, epochs=2, epoch_choices=CHOICES).restore({**state, "weights": "bm90IHRvcmNo"})
    with pytest.raises(SelectionError, match="node statistics"):
        NodeBook.from_state({"rounds": 1, "nodes": {"5": {"speed": 3}}})


def test_features_are_scaled_within_the_round_and_fill_unknowns() -> None:
    book = NodeBook()
    pool = [10, 11, 12, 13]
    for node, seconds in zip(pool[:3], (1.0, 2.0, 40.0), strict=True):
        book.get(node).observe(1, NodeResult(Outcome.OK, 2, seconds=seconds, loss=1.0, samples=50.0), None)
    x = features(book, pool, 2)
    assert x.shape == (4, 8) and np.isfinite(x).all()
    speed = x[:, 2]
    assert speed[2] == speed.max() and speed[3] == pytest.approx(speed[1])  # unknown: the median
    assert list(x[:, 5]) == [0.0, 0.0, 0.0, 1.0]  # never selected


def test_reward_is_accuracy_per_minute_minus_the_late_share() -> None:
    results = {1: NodeResult(Outcome.OK, 1, seconds=10), 2: NodeResult(Outcome.LATE, 1)}
    feedback = RoundFeedback(3, results, 30.0, 0.50, 0.51, deadline=20.0)
    assert round_reward(feedback, late_penalty=2.0) == pytest.approx(100 * 0.01 / 0.5 - 2.0 * 0.5)


def test_reward_uses_the_validation_loss_when_there_is_one() -> None:
    results = {1: NodeResult(Outcome.OK, 1, seconds=10)}
    feedback = RoundFeedback(3, results, 60.0, 0.50, 0.40, loss_before=0.9, loss_after=0.7)
    assert round_reward(feedback, late_penalty=1.0) == pytest.approx(100 * 0.2)  # not the accuracy drop
    nan = RoundFeedback(3, results, 60.0, 0.50, 0.51, loss_before=float("nan"), loss_after=0.7)
    assert round_reward(nan, late_penalty=1.0) == pytest.approx(1.0)  # no usable loss: accuracy


def test_selection_config_is_validated_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"selector": "greedy", "selection-epochs": "0,x", "round-deadline": 500.0,
                                "round-timeout": 300.0})
    text = str(info.value)
    assert "selector must be one of" in text and "selection-epochs" in text and "round-deadline" in text
    with pytest.raises(ConfigError, match="must include local-epochs"):
        RunConfig.from_mapping({"selector": "rl", "selection-epochs": "1,4", "local-epochs": 2})
    config = RunConfig.from_mapping({"selector": "rl", "selection-epochs": "4, 1,2", "local-epochs": 2})
    assert config.epoch_choices() == (1, 2, 4) and config.resolved()["selection-epochs"] == "1,2,4"
    assert RunConfig.from_mapping(config.resolved()) == config
