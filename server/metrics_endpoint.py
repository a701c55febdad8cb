"""The live metrics endpoint of ``quorumfl server start --metrics-port``: Prometheus text format,
served by ``prometheus_client``'s HTTP server from a collector that reads the state DB at each scrape.

The rounds run in ServerApp processes that Flower starts; the one place that knows what all of them
did is the state DB, so the collector asks it (``server.state.totals``: a few aggregate queries per
scrape) instead of keeping counters in the server process. Series (``prometheus_client``
conventions: ``_total`` counters, base units, labels for kinds):

- ``quorumfl_runs{status}``, ``quorumfl_rounds_total{status}``: runs and round attempts by status;
- ``quorumfl_last_run_info{run, status, secure_aggregation, dp, threshold, task}``: the newest run and
  its privacy (masked, ckks or plaintext), value 1;
- ``quorumfl_stage_seconds_total{stage}``: seconds spent per stage over every completed round;
- ``quorumfl_last_round_stage_seconds{stage}``, ``quorumfl_last_round_nodes{state}`` (selected,
  trained, failed) and ``quorumfl_last_round_number``: the most recently started round;
- ``quorumfl_nodes{state}``: nodes known to the server (``known``), enabled for selection
  (``enabled``), and seen connected in the last five minutes (``seen_5m``: every round records the
  nodes connected when it selects);
- ``quorumfl_bytes_total{direction}``: arrays sent up by departments and down by the server;
- ``quorumfl_department_epsilon{department}``: the ε each department's ledger last reported.

It listens on 127.0.0.1 unless ``--metrics-host`` says otherwise: department names and ε are for the
federation's operators, and the endpoint has no credential check of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from quorumfl.server.run_labels import privacy_view, task_label
from quorumfl.server.state.repository import Repository

__all__ = ["StateCollector", "serve_metrics"]

NOT_STAGES = ("local_train_max",)


class StateCollector(Collector):
    """Reads the state DB's totals at every scrape."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo

    def collect(self) -> Iterator[Metric]:
        repo = self.repo
        runs = GaugeMetricFamily("quorumfl_runs", "Runs by status.", labels=["status"])
        for status, count in sorted(repo.run_counts().items()):
            runs.add_metric([status], count)
        yield runs
        last = repo.last_run()
        if last is not None:
            privacy = privacy_view(last.config)
            info = GaugeMetricFamily("quorumfl_last_run_info", "The newest run: its status, secure-aggregation mode "
                                     "(masked, ckks, plaintext), DP and threshold.",
                                     labels=["run", "status", "secure_aggregation", "dp", "threshold", "task"])
            info.add_metric([str(last.id), last.status, privacy["mode"], privacy["dp"], privacy["threshold"],
                             task_label(last.config)], 1)
            yield info
        rounds = CounterMetricFamily("quorumfl_rounds", "Round attempts by status.", labels=["status"])
        for status, count in sorted(repo.round_counts().items()):
            rounds.add_metric([status], count)
        yield rounds
        stages = CounterMetricFamily("quorumfl_stage_seconds", "Seconds per stage over all completed rounds.",
                                     labels=["stage"])
        for stage, seconds in sorted(repo.stage_totals().items()):
            if stage not in NOT_STAGES:
                stages.add_metric([stage], seconds)
        yield stages
        yield from self._last_round()
        nodes = GaugeMetricFamily("quorumfl_nodes", "Nodes known to the server, enabled for selection, and seen "
                                  "connected in the last five minutes.", labels=["state"])
        for state, count in repo.node_counts().items():
            nodes.add_metric([state], count)
        yield nodes
        sums = repo.metric_sums(("uplink-bytes", "downlink-bytes"))
        sent = CounterMetricFamily("quorumfl_bytes", "Bytes of arrays sent, by direction.", labels=["direction"])
        sent.add_metric(["up"], sums.get("uplink-bytes", 0.0))
        sent.add_metric(["down"], sums.get("downlink-bytes", 0.0))
        yield sent
        epsilon = GaugeMetricFamily("quorumfl_department_epsilon", "ε each department's ledger last reported.",
                                    labels=["department"])
        for department, value in sorted(repo.latest_node_metric("dp-epsilon").items()):
            epsilon.add_metric([department], value)
        yield epsilon

    def _last_round(self) -> Iterator[Metric]:
        rnd = self.repo.last_round()
        number = GaugeMetricFamily("quorumfl_last_round_number", "Number of the most recently started round.")
        stage = GaugeMetricFamily("quorumfl_last_round_stage_seconds", "Seconds per stage of that round.",
                                  labels=["stage"])
        nodes = GaugeMetricFamily("quorumfl_last_round_nodes", "Nodes of that round: selected, trained, failed.",
                                  labels=["state"])
        if rnd is not None:
            number.add_metric([], rnd.number)
            for name, seconds in sorted((rnd.timings or {}).items()):
                if name not in NOT_STAGES:
                    stage.add_metric([name], seconds)
            nodes.add_metric(["selected"], len(rnd.selected))
            nodes.add_metric(["trained"], len(rnd.participants))
            failed = self.repo.round_failure_count(rnd.id)
            nodes.add_metric(["failed"], failed)
        yield number
        yield stage
        yield nodes


def serve_metrics(repo: Repository, *, port: int, host: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
    """Start the endpoint on a daemon thread (``prometheus_client.start_http_server``) with only the
    state collector registered; returns the HTTP server (``shutdown()`` stops it) and its thread."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(repo))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread
