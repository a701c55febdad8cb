"""Client selection: which enabled, connected nodes train in a round, and for how many local epochs.

``RandomSelector`` (seeded uniform), ``OortSelector`` (Oort's utility heuristic) and ``RLSelector``
(a learned Plackett–Luce policy with an Oort fallback) share one contract (``Selector``): choose
for a round, then learn from its ``RoundFeedback``. The selectors are pure; the federation loop
(``server.rounds``) feeds them and keeps their state in the state DB (``selector_states``).
"""

from __future__ import annotations

from collections.abc import Sequence

from quorumfl.server.selection.base import (
    RandomSelector,
    Selection,
    Selector,
    check_selection,
    round_reward,
)
from quorumfl.server.selection.oort import OortSelector
from quorumfl.server.selection.rl import Guard, RLSelector
from quorumfl.server.selection.stats import (
    FEATURES,
    NodeBook,
    NodeResult,
    NodeStats,
    Outcome,
    RoundFeedback,
    features,
)

__all__ = [
    "FEATURES", "Guard", "NodeBook", "NodeResult", "NodeStats", "OortSelector", "Outcome", "RLSelector",
    "RandomSelector", "RoundFeedback", "SELECTORS", "Selection", "Selector", "build_selector", "check_selection",
    "features", "round_reward",
]

SELECTORS = ("random", "oort", "rl")


def build_selector(name: str, *, seed: int, epochs: int, epoch_choices: Sequence[int] = (), clusters: int = 1,
                   late_penalty: float = 1.0) -> Selector:
    """The selector called ``name`` (one of ``SELECTORS``); ``epoch_choices`` only matter to ``rl``."""
    if name == "random":
        return RandomSelector(seed=seed, epochs=epochs)
    if name == "oort":
        return OortSelector(seed=seed, epochs=epochs, late_penalty=late_penalty)
    if name == "rl":
        return RLSelector(seed=seed, epochs=epochs, epoch_choices=list(epoch_choices) or [epochs], clusters=clusters,
                          late_penalty=late_penalty)
    from quorumfl.errors import ConfigError

    raise ConfigError(f"selector must be one of {list(SELECTORS)}, got {name!r}")
