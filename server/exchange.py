"""The server's round trips on Flower's Grid: send requests, pull replies as they arrive, record who
failed and why.

``Exchange`` is what every stage of a round (train, the secure-aggregation stages, evaluation) sends
its messages through; the secure sessions get it as their ``exchange``. It matches replies to
requests (a replayed or unsolicited reply is refused and recorded), asks a node whose ClientApp
crashed again while the deadline allows, stops the train stage at the over-selection quota, names
a reply's department from the roster, and records the running stage for ``runs start --follow``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from numpy.typing import NDArray

from quorumfl.aggregation.secagg.identity import Roster, department_message
from quorumfl.errors import SecureAggregationError, StateError
from quorumfl.protocol.wire import (
    ARRAYS,
    CONFIG,
    NODE,
    TrainConfig,
    array_bytes,
    cluster_key,
    to_array_record,
)
from quorumfl.server.pulling import ReplyPuller
from quorumfl.server.state.repository import Repository

__all__ = ["REPLY_POLL_SECONDS", "Exchange", "requests"]

log = logging.getLogger(__name__)
REPLY_POLL_SECONDS = 0.1  # how often the ServerApp asks the SuperLink for replies (at most)
Arrays = dict[str, NDArray[np.generic]]


def requests(kind: str, models: Sequence[Arrays], configs: Mapping[int, TrainConfig]) -> list[Message]:
    """One request per node carrying the model (or every cluster model, as ``cluster-k``)."""
    if len(models) == 1:
        records = {ARRAYS: to_array_record(models[0])}
    else:
        records = {cluster_key(k): to_array_record(m) for k, m in enumerate(models)}
    return [
        Message(
            content=RecordDict({**records, CONFIG: cfg.to_record()}),
            dst_node_id=node,
            message_type=kind,
        )
        for node, cfg in configs.items()
    ]


class Exchange:
    """Round trips of one run (see the module docstring)."""

    def __init__(self, grid: Grid, repo: Repository, *, roster: Roster | None, flower_run_id: int | None,
                 round_deadline: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.grid = grid
        self.repo = repo
        self.roster = roster
        self.flower_run_id = flower_run_id
        self.round_deadline = round_deadline  # set: a node silent in the train stage is recorded 'deadline'
        self.clock = clock
        self.round_id: int | None = None  # the running round, whose progress is recorded
        self.round_number: int | None = None  # its number: each request's Flower group_id, as Flower's strategies set it
        self.progress_written = -math.inf  # clock of the last progress write
        self.progress_interval = 1.0  # seconds between progress writes within a stage
        self.quota: int | None = None  # over-selection: the train stage stops after this many good replies
        self.arrivals: dict[int, float] = {}  # seconds from sending the train request to each reply
        self.cut_at: float | None = None  # when the train stage stopped waiting for the over-selected
        self.stray: list[tuple[int, str]] = []  # replies this round refused as answering no request
        self.sent_bytes = 0  # bytes of arrays in every request sent so far (the report's downlink)

    def start_train_stage(self, quota: int | None) -> None:
        """A new round's train stage: stop after ``quota`` good replies (None: wait for all)."""
        self.quota, self.arrivals, self.cut_at = quota, {}, None

    def name_from_roster(self, node: int, reply: Message) -> None:
        """In a signed federation a reply's department is the roster name its node key signed for this
        run and node; an unsigned or mis-signed claim is dropped (the node then has no name), so a node
        cannot pass itself off as another department."""
        roster = self.roster
        if roster is None or NODE not in reply.content.config_records:
            return
        record = reply.content.config_records[NODE]
        claimed, signature = record.get("department"), record.get("department-signature")
        try:
            if not isinstance(claimed, str) or not isinstance(signature, bytes):
                raise SecureAggregationError("the reply's department is not signed")
            binding = b"run:" + str(self.flower_run_id or 0).encode()
            roster.check(claimed, department_message(binding=binding, node=node, department=claimed), signature, node=node)
        except SecureAggregationError as exc:
            log.warning("node %s: department %r not taken (%s)", node, claimed, exc)
            reply.content.config_records[NODE] = ConfigRecord({"department": ""})

    def __call__(
        self,
        messages: list[Message],
        failures: dict[int, tuple[str, str]],
        stage: str,
        timeout: float,
        consume: Callable[[int, Message], None] | None = None,
        retries: int = 0,
        retried: dict[int, int] | None = None,
        enough: Callable[[], bool] | None = None,
    ) -> list[tuple[int, Message]]:
        """Send, wait up to ``timeout`` seconds, and record error replies and missing nodes.

        Replies are matched to requests by ``reply_to_message_id``: an error reply that the SuperLink
        writes for an unreachable node carries the SuperLink's own id as its source. With ``consume``
        each good reply is handed over as soon as it is pulled and not kept (a running sum then
        holds one aggregate, not every node's reply); without it the good replies are returned.

        A node whose ClientApp crashed (Flower's ``CLIENT_APP_CRASHED``: killed, out of memory) is
        sent the same request again, up to ``retries`` times while the deadline allows; the same
        job resumes from the node's training checkpoint. ``retried`` counts the re-sends per node.
        Other errors (the app raised, the node is gone) are final: asking again would fail again.

        With ``enough`` (asked after each batch of pulled replies) the stage stops waiting as soon as
        it holds: a stage that asks spare nodes (the unmask stage asks t + spare) then ends with the
        first replies that suffice instead of the slowest one, or the deadline when a spare hangs. The
        nodes still waiting are not failures: their answers were not needed.
        """
        if self.round_number is not None:  # SuperNodes log "[RUN r, ROUND n]" with each message
            for m in messages:
                m.metadata.group_id = m.metadata.group_id or str(self.round_number)
        expected = {int(m.metadata.dst_node_id) for m in messages}
        request = {int(m.metadata.dst_node_id): m for m in messages}
        message_ids = list(self.grid.push_messages(messages))  # Flower sends an object shared by messages once
        self.sent_bytes += sum(array_bytes(m.content) for m in messages)  # what each node downloads
        destination = {mid: int(m.metadata.dst_node_id) for mid, m in zip(message_ids, messages, strict=True)}
        good: list[tuple[int, Message]] = []
        attempts: dict[int, int] = retried if retried is not None else {}
        again: list[int] = []
        train = stage == "train"
        quota = self.quota if train else None
        received = 0
        started = self.clock()
        asked = len(expected)
        since = time.time()

        def report(*, force: bool = False) -> None:
            waiting_nodes = len(expected)
            self.report_progress({
                "stage": stage, "asked": asked, "replied": received,
                "failed": asked - waiting_nodes - received, "waiting": waiting_nodes,
                "started": round(since, 3), "deadline": round(since + timeout, 3),
            }, force=force)

        report(force=True)

        def take(reply: Message) -> None:
            node = destination.get(reply.metadata.reply_to_message_id)
            if node is None or node not in expected:
                reason = "reply answers no open request of this stage (replayed, duplicated or unsolicited)"
                log.warning("refusing a reply from node %s: %s", reply.metadata.src_node_id, reason)
                self.stray.append((int(reply.metadata.src_node_id), f"{stage}: {reason}"))
                return
            if (reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED
                    and attempts.get(node, 0) < retries and self.clock() < deadline):
                attempts[node] = attempts.get(node, 0) + 1
                log.warning("node %s: its ClientApp crashed during %s (%s); asking again (%d of %d)",
                            node, stage, reply.error.reason, attempts[node], retries)
                again.append(node)
                return
            expected.discard(node)
            if reply.has_error():
                failures[node] = (stage, f"node error {reply.error.code}: {reply.error.reason}"
                                  + (f" (after {attempts[node]} retries)" if attempts.get(node) else ""))
            elif reply.metadata.src_node_id != node:
                failures[node] = (stage, f"reply came from node {reply.metadata.src_node_id}, not {node}")
            else:
                self.name_from_roster(node, reply)
                nonlocal received
                received += 1
                if train:
                    self.arrivals[node] = self.clock() - started
                if consume is not None:
                    consume(node, reply)
                else:
                    good.append((node, reply))

        # Grid.send_and_receive sleeps 3 s between pulls; every round trip would pay up to that again.
        # ``ReplyPuller`` lists the arrived replies in one request per poll and pulls each one's objects
        # on a few threads: a reply whose arrays are still uploading over a slow link then holds up
        # neither the others nor the deadline.
        waiting = set(message_ids)
        deadline = self.clock() + timeout
        with ReplyPuller(self.grid) as puller:
            while waiting:
                pulled = puller.poll(sorted(waiting))
                for reply in pulled:
                    waiting.discard(reply.metadata.reply_to_message_id)
                    if quota is None or received < quota:  # a reply after the cut leaves its node late
                        take(reply)
                if pulled:
                    report()
                    if enough is not None and enough():
                        return good
                if again:
                    copies = [Message(content=request[n].content, dst_node_id=n,
                                      message_type=request[n].metadata.message_type,
                                      group_id=request[n].metadata.group_id) for n in again]
                    self.sent_bytes += sum(array_bytes(m.content) for m in copies)
                    for mid, node in zip(self.grid.push_messages(copies), again, strict=True):
                        destination[mid] = node
                        waiting.add(mid)
                    again.clear()
                if quota is not None and received >= quota:
                    self.cut_at = self.clock() - started
                    for node in expected:  # over-selection: the first ``quota`` replies are the round's
                        failures[node] = ("late", f"not among the first {quota} replies (over-selection); "
                                                  f"the round stopped waiting after {self.cut_at:.1f}s")
                    return good
                if not waiting or self.clock() >= deadline:
                    break
                puller.wait(REPLY_POLL_SECONDS)  # woken early when a reply's pull finishes
        for node in expected:
            if train and self.round_deadline:
                failures[node] = ("deadline", f"no reply within the round deadline ({timeout:.0f}s)")
            else:
                failures[node] = (stage, f"no reply within the {stage} deadline ({timeout:.0f}s)")
        return good

    def report_progress(self, progress: dict[str, Any], *, force: bool) -> None:
        """Record the running round's stage for `runs start --follow` and the demo (at most once per
        ``progress_interval``, except at a stage's start). Only a display: a failed write is logged,
        not raised."""
        now = self.clock()
        if self.round_id is None or (not force and now - self.progress_written < self.progress_interval):
            return
        self.progress_written = now
        try:
            self.repo.set_round_progress(self.round_id, progress)
        except StateError as exc:
            log.warning("could not record the round's progress: %s", exc)
