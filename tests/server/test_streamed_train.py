"""A plaintext round folded as replies arrive (``StreamedTrain``) against the collect-then-aggregate
path it replaced: the same accepted and refused nodes with the same reasons, the same model within the
weighted mean's bound, the same monitoring verdicts; and it never holds more than ``BLOCK`` updates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.monitor import SKETCH, ChangeSketch, monitor_measured, monitor_updates
from quorumfl.aggregation.weighted import BLOCK
from quorumfl.protocol.wire import ARRAYS, METRICS, to_array_record
from quorumfl.server.replies import Robust, StreamedTrain, aggregate_train_replies
from quorumfl.server.strategies import FedAvg

pytestmark = pytest.mark.usefixtures("task_identity")


def _reply(node: int, arrays: dict[str, np.ndarray], examples: float, loss: float) -> tuple[int, Message]:
    request = Message(RecordDict(), dst_node_id=node, message_type="train")
    content = RecordDict({ARRAYS: to_array_record(arrays),
                          METRICS: MetricRecord({"num-examples": examples, "train-loss": loss})})
    return node, Message(content=content, reply_to=request)


def _round(seed: int, nodes: int, bad: set[int]) -> tuple[dict[str, np.ndarray], list[tuple[int, Message]]]:
    rng = np.random.default_rng(seed)
    model = {"w": rng.standard_normal((64, 80)).astype(np.float32), "b": rng.standard_normal(80).astype(np.float32)}
    replies = []
    for node in range(1, nodes + 1):
        arrays = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.items()}
        loss = float(rng.uniform(0.5, 1.0))
        if node == 2:  # a scaled update: monitoring flags it
            arrays = {k: model[k] + 50 * (arrays[k] - model[k]) for k in model}
        if node in bad:
            kind = node % 3
            if kind == 0:
                arrays["w"][3, 3] = np.nan
            elif kind == 1:
                arrays = {"w": arrays["w"]}  # a missing tensor
            else:
                arrays["b"] = arrays["b"][:10]  # a wrong shape
        replies.append(_reply(node, arrays, float(rng.integers(20, 200)), loss))
    return model, replies


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.integers(1, 2 * BLOCK + 7), data=st.data())
def test_streamed_round_equals_the_collected_one(seed: int, nodes: int, data: st.DataObject) -> None:
    bad = data.draw(st.sets(st.integers(1, nodes), max_size=min(nodes, 5)))
    model, replies = _round(seed, nodes, bad)
    strategy = FedAvg(fraction_train=1.0, min_nodes=1, seed=0)
    collected_failures: dict[int, tuple[str, str]] = {}
    collected = aggregate_train_replies(strategy, 1, [model], replies, collected_failures, robust=Robust())
    streamed_failures: dict[int, tuple[str, str]] = {}
    streamed = StreamedTrain(strategy, model, streamed_failures)
    for node, reply in replies:
        streamed.consume(node, reply)
        assert len(streamed.pending) < BLOCK and all(not p.update.arrays for p in streamed.parsed)
    phase = streamed.finish()
    assert phase.accepted == collected.accepted and streamed_failures == collected_failures
    assert set(phase.accepted) == set(range(1, nodes + 1)) - bad
    if not phase.accepted:
        assert phase.arrays is None and collected.arrays is None
        return
    assert phase.arrays is not None and collected.arrays is not None
    for key in model:
        np.testing.assert_allclose(phase.arrays[key], collected.arrays[key], rtol=0, atol=1e-5)
    # Norms and losses are exact, so are their flags; a cosine near the cut may fall either side of
    # it by the sketch's error (it is checked just below).
    def exact_flags(flags: dict[int, str]) -> dict[int, list[str]]:
        return {n: [r for r in why.split("; ") if not r.startswith("cosine")] for n, why in flags.items()}

    assert {n: r for n, r in exact_flags(phase.flags).items() if r} == {
        n: r for n, r in exact_flags(collected.flags).items() if r}
    if len(phase.accepted) >= 4 and 2 in phase.accepted:
        assert 2 in phase.flags  # the ×50 update
    assert math.isclose(phase.train_loss, collected.train_loss, rel_tol=1e-12)
    for node in phase.accepted:  # model of 5,200 values > SKETCH: cosines from sketches
        ours, theirs = phase.node_metrics[node], collected.node_metrics[node]
        assert ours["update-norm"] == pytest.approx(theirs["update-norm"], rel=1e-9)
        assert abs(ours["update-cosine"] - theirs["update-cosine"]) < 0.1


def test_sketched_cosines_are_exact_for_small_models_and_close_for_large_ones() -> None:
    rng = np.random.default_rng(0)
    for size, tolerance in ((SKETCH, 1e-9), (200_000, 0.05)):
        reference = {"w": rng.standard_normal(size)}
        updates = {n: {"w": reference["w"] + rng.standard_normal(size) * (1 + n) + (n % 3) * 0.5}
                   for n in range(8)}
        mean = {"w": np.mean([u["w"] for u in updates.values()], axis=0)}
        losses = {n: 1.0 for n in updates}
        exact = monitor_updates(reference, updates, mean, losses)
        sketch = ChangeSketch(reference)
        measured = monitor_measured({n: sketch.measure(u) for n, u in updates.items()}, sketch.measure(mean)[1], losses)
        for node in updates:
            assert measured[node].norm == pytest.approx(exact[node].norm, rel=1e-12)
            assert abs(measured[node].cosine - exact[node].cosine) <= tolerance
