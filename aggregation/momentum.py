"""The server's optimiser step over rounds: FedAvgM (Hsu, Qi & Brown, 2019) and FedOpt's server rate.

A round's aggregate is the weighted mean ``w̄`` of the nodes' models. Plain FedAvg takes it as the new
global model. With server momentum β and server rate η (Reddi et al., 2021, "Adaptive Federated
Optimization", server SGD with momentum), the round's mean change ``Δ = w̄ − w`` is a pseudo-gradient:

    m ← β·m + Δ        w ← w + η·m

β = 0 and η = 1 is plain FedAvg, exactly (the step returns the mean itself). Nodes train with local
SGD averaged over K departments, which behaves like one large batch; the momentum over rounds gives
back the steps that averaging takes away (measured on hashed-n-gram text in ``benchmarks/tasks.py``).

The step runs on the mean the round reveals, after secure aggregation and after distributed DP noise,
so it needs no single department's update and is post-processing for DP. Only the model's trainable
parameters move this way (``names``); buffers — the tabular task's federated statistics, batch-norm
counts — take the round's mean as they are, so a statistics round never enters the momentum.

Flower's ``FedAvgM`` strategy does this inside Flower's own aggregation; QuorumFL's round modes
reveal the mean themselves (masked or encrypted sums), so the step is applied to what they reveal.
Pure math: no I/O. The buffer is float64, one per moved array (memory: one model's float64 size).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import AggregationError

__all__ = ["ServerMomentum"]

Arrays = dict[str, NDArray[np.generic]]


class ServerMomentum:
    """The server's momentum buffer for one global model and the step it takes each round."""

    def __init__(self, *, momentum: float, learning_rate: float, names: Collection[str]) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"server momentum must be in [0, 1), got {momentum}")
        if not learning_rate > 0.0:
            raise ValueError(f"server learning rate must be > 0, got {learning_rate}")
        self.momentum = momentum
        self.learning_rate = learning_rate
        self.names = frozenset(names)
        self.buffer: dict[str, NDArray[np.float64]] = {}

    @property
    def plain(self) -> bool:
        """Whether the step is plain FedAvg (the mean is the new model)."""
        return self.momentum == 0.0 and self.learning_rate == 1.0

    def step(self, current: Mapping[str, NDArray[np.generic]], mean: Mapping[str, NDArray[np.generic]]) -> Arrays:
        """The new global model from the current one and the round's weighted mean."""
        if set(current) != set(mean):
            raise AggregationError(f"the round's mean has arrays {sorted(mean)}, the server model {sorted(current)}")
        if self.plain:
            return dict(mean)
        out: Arrays = {}
        for name, average in mean.items():
            if name not in self.names or not np.issubdtype(average.dtype, np.floating):
                out[name] = average
                continue
            old = np.asarray(current[name])
            if old.shape != average.shape:
                raise AggregationError(f"array '{name}' has shape {average.shape}, the server model {old.shape}")
            change = average.astype(np.float64) - old.astype(np.float64)
            buffer = self.buffer.get(name)
            buffer = change if buffer is None else self.momentum * buffer + change
            self.buffer[name] = buffer
            out[name] = (old.astype(np.float64) + self.learning_rate * buffer).astype(average.dtype)
        return out
