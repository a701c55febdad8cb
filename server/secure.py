"""The server's half of masking secure aggregation, carried over Flower messages.

``MaskingSession`` keeps one key epoch across rounds and re-keys (two message round trips:
advertise, share) only when it must: first round, slots used up, a selected node outside the
epoch's cohort (or too few of it left for its threshold), or a node that lost its keys (a restarted
SuperNode says so in its error reply). A round is then the train round trip,
whose replies carry masked vectors added into a running sum, plus one unmask round trip (and, in a
signed epoch where a node dropped, one consistency round trip before it: every survivor signs the
same view of who survived, and nodes unmask only for a view enough of them signed; a round without
dropouts on the complete graph skips it, since its view reveals no slot key). Each stage
has its own deadline; a node that misses one is recorded as a round failure at that stage. Fewer
than t survivors: the unmask request is never sent and the round fails with nothing revealed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from numpy.typing import NDArray

from quorumfl.aggregation.compression import shared_positions
from quorumfl.aggregation.secagg import (
    HEADER,
    CoordinatorEpoch,
    MaskingParams,
    SecureMean,
    flatten,
    read_payload,
    resolve_threshold,
)
from quorumfl.errors import (
    EmptyAggregationError,
    QuorumError,
    QuorumNotMetError,
    SecureAggregationError,
)
from quorumfl.protocol.secure_wire import (
    ADVERTISE,
    CONFIRM,
    MASKED,
    MISSING_KEYS,
    SECAGG,
    SHARE,
    UNMASK,
    decode_advertisement,
    decode_bundles,
    decode_confirmation,
    decode_masked,
    decode_unmask_reply,
    encode_announcement,
    encode_directory,
    encode_mask_request,
    encode_unmask_request,
)
from quorumfl.protocol.wire import (
    ARRAYS,
    CONFIG,
    REFUSAL,
    TrainConfig,
    to_array_record,
)
from quorumfl.server.config import RunConfig
from quorumfl.server.phase import TrainPhase, cluster_groups

__all__ = ["MaskingSession"]

log = logging.getLogger(__name__)
Arrays = dict[str, NDArray[np.generic]]
Failures = dict[int, tuple[str, str]]


class Exchange(Protocol):
    """``server.exchange.Exchange``: send, wait up to ``timeout`` s, fill ``failures``; the good replies
    are returned, or handed to ``consume`` one by one as they are pulled and not kept. A node whose
    ClientApp crashed is asked again up to ``retries`` times (``retried`` counts them). With
    ``enough``, the wait ends as soon as it holds."""

    def __call__(self, messages: list[Message], failures: Failures, stage: str, timeout: float,
                 consume: Callable[[int, Message], None] | None = None, *, retries: int = 0,
                 retried: dict[int, int] | None = None,
                 enough: Callable[[], bool] | None = None) -> list[tuple[int, Message]]: ...


def _with_noise_share(config: TrainConfig, quorum: int) -> TrainConfig:
    """Distributed DP: each node adds N(0, σ²C²/quorum), so any revealed sum (≥ quorum inputs) carries σC."""
    return replace(config, dp_noise_share=quorum) if config.dp == "distributed" else config


def _secagg(reply: Message) -> ConfigRecord:
    if SECAGG not in reply.content.config_records:
        raise SecureAggregationError("reply has no 'secagg' record")
    return reply.content.config_records[SECAGG]


class MaskingSession:
    """Masked rounds of one run against a Flower Grid (through the Federation's exchange)."""

    def __init__(self, config: RunConfig, exchange: Exchange, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.exchange = exchange
        self.clock = clock
        self.epoch: CoordinatorEpoch | None = None
        self.epochs_started = 0
        self.stale = False  # a participant lost its keys: re-key before the next round

    def _message(self, kind: str, node: int, record: ConfigRecord) -> Message:
        return Message(content=RecordDict({SECAGG: record}), dst_node_id=node, message_type=kind)

    def _needs_new_epoch(self, selected: Sequence[int]) -> bool:
        epoch = self.epoch
        return (
            epoch is None
            or self.stale
            or epoch.slots_left < 1
            or not set(selected) <= set(epoch.ready)
            or len(selected) < epoch.params.threshold
        )

    def _setup(self, cohort: Sequence[int], failures: Failures, *, rounds_left: int) -> CoordinatorEpoch:
        """Key epoch: advertise, then share (two round trips). Raises when fewer than t finish.

        The epoch has a slot for each round it may serve: ``secagg-epoch-rounds``, or fewer when the
        run has fewer rounds left. Every slot costs each node a key pair and a seed, each pair of
        neighbours two shares per slot, and the server relays and keeps commitments to all of them, so
        slots no round will use would only make the set-up slower and its messages larger (at 1,000
        departments they are most of the server's memory)."""
        self.epoch = None
        config = self.config
        params = MaskingParams(
            threshold=resolve_threshold(config.secagg_threshold, len(cohort)),
            slots=max(1, min(config.secagg_epoch_rounds, rounds_left)),
            modulus_bits=config.secagg_modulus_bits,
            clip=config.secagg_clip,
            min_group=config.secagg_min_group,
            colluding_fraction=config.secagg_colluding_fraction,
            dropout_fraction=config.secagg_dropout_fraction,
        )
        epoch = CoordinatorEpoch(cohort, params)
        record = encode_announcement(epoch.announcement())
        timeout = config.secagg_stage_timeout
        replies = self.exchange([self._message(ADVERTISE, n, record) for n in epoch.cohort], failures,
                                "secagg-advertise", timeout)
        for node, reply in replies:
            try:
                epoch.receive_advertisement(decode_advertisement(_secagg(reply), node=node))
            except SecureAggregationError as exc:
                failures[node] = ("secagg-advertise", str(exc))
        directories = epoch.directories()
        messages = [self._message(SHARE, n, encode_directory(d)) for n, d in directories.items()]
        sharers: list[int] = []
        for node, reply in self.exchange(messages, failures, "secagg-share", timeout):
            try:
                epoch.receive_bundles(node, decode_bundles(_secagg(reply), node=node))
            except SecureAggregationError as exc:
                failures[node] = ("secagg-share", str(exc))
            else:
                sharers.append(node)
        epoch.close_setup(sharers)
        self.epoch = epoch
        self.stale = False
        self.epochs_started += 1
        log.info("secure aggregation: key epoch %s ready with %s of %s nodes (t=%s, %s slots)",
                 self.epochs_started, len(epoch.ready), len(cohort), params.threshold, params.slots)
        return epoch

    def round(
        self,
        models: Sequence[Arrays],
        configs: dict[int, TrainConfig],
        failures: Failures,
        timings: dict[str, float],
        *,
        cluster_of: Mapping[int, int] | None = None,
    ) -> TrainPhase:
        """One masked round for the selected nodes (the keys of ``configs``) on the global model
        (``models`` holds one) or, with ``cluster_of``, on IFCA's cluster models.

        Clustered: ``models`` are the cluster models and ``cluster_of`` each node's choice; each
        cluster is one masking group, summed and revealed on its own. A cluster with fewer nodes than
        the group quorum sits the round out (its nodes are recorded as failures): its sum would
        reveal too few departments' updates.
        """
        selected = sorted(configs)
        clustered = cluster_of is not None
        choice = dict(cluster_of) if cluster_of is not None else {n: 0 for n in selected}
        try:
            start = self.clock()
            epoch = self.epoch
            if epoch is None or self._needs_new_epoch(selected):
                number = min((c.server_round for c in configs.values()), default=1)
                epoch = self._setup(selected, failures, rounds_left=self.config.num_rounds - number + 1)
            timings["secagg-setup"] = self.clock() - start
            return self._masked_round(epoch, list(models), choice, configs, failures, timings, clustered=clustered)
        except QuorumError as exc:
            log.warning("secure aggregation: %s", exc)
            return TrainPhase(arrays=None, error=f"secure aggregation: {exc}")

    def _masked_round(
        self,
        epoch: CoordinatorEpoch,
        models: list[Arrays],
        cluster_of: dict[int, int],
        configs: dict[int, TrainConfig],
        failures: Failures,
        timings: dict[str, float],
        *,
        clustered: bool,
    ) -> TrainPhase:
        config = self.config
        quorum = epoch.params.group_quorum
        members = cluster_groups((n for n in configs if n in epoch.ready), cluster_of, quorum, failures)
        if not members:
            raise QuorumNotMetError(f"no cluster has the group quorum of {quorum} nodes")
        order = sorted(members)  # masking group i sums cluster order[i]
        participants = sorted(n for k in order for n in members[k])
        bases = {k: flatten(models[k]) for k in order}
        # Shared random-k: every node masks the values at the round's shared coordinates only.
        round_config = next(iter(configs.values()))
        positions: NDArray[np.int64] | None = None
        if round_config.compression == "randk" and not round_config.compression_full:
            shapes = {name: tuple(np.shape(v)) for name, v in models[order[0]].items()}
            positions = shared_positions(shapes, round_config.compression_fraction, round_config.compression_seed)
        length = HEADER + (len(positions) if positions is not None else next(iter(bases.values())).shape[0])
        rnd = epoch.start_round([members[k] for k in order], length=length)
        records = {k: to_array_record(models[k]) for k in order}
        messages = [
            Message(
                content=RecordDict(
                    {
                        ARRAYS: records[cluster_of[n]],
                        CONFIG: _with_noise_share(configs[n], quorum).to_record(),
                        SECAGG: encode_mask_request(epoch.mask_request(n, rnd), max_weight=config.secagg_max_weight),
                    }
                ),
                dst_node_id=n,
                message_type=MessageType.TRAIN,
            )
            for n in participants
        ]
        result = TrainPhase(arrays=None)
        start = self.clock()

        def take(node: int, reply: Message) -> None:
            """Fold one masked input into its group's sum as it is pulled; the reply is not kept, so the
            server holds one sum per group rather than every node's vector (1,000 departments ×
            437 KB for a 109k-parameter model)."""
            try:
                content = reply.content
                if REFUSAL in content.config_records:
                    failures[node] = ("dp-budget", f"refused: {content.config_records[REFUSAL].get('reason')!s}")
                    return
                if MASKED not in content.array_records:
                    raise SecureAggregationError("reply has no 'masked' record")
                vector, epoch_id, slot = decode_masked(content.array_records[MASKED], _secagg(reply))
                if epoch_id != epoch.epoch or slot != rnd.slot:
                    raise SecureAggregationError(f"masked input is for another epoch or slot ({slot})")
                rnd.add_masked(node, vector)
            except SecureAggregationError as exc:
                failures[node] = ("train", str(exc))
                return
            result.note_node(node, content)

        retried: dict[int, int] = {}
        self.exchange(messages, failures, "train", config.train_deadline(), consume=take,
                      retries=config.train_retries, retried=retried)
        result.note_retries(retried)
        timings["train"] = self.clock() - start
        self.stale = any(stage == "train" and MISSING_KEYS in reason
                         for node, (stage, reason) in failures.items() if node in participants)

        start = self.clock()
        request, _ = rnd.unmask_request()  # raises (and reveals nothing) when no group has its quorum
        survivors = [n for alive, _ in request.groups for n in alive]
        # A signed epoch has a consistency stage before the unmask stage, unless nobody dropped: a view
        # with no dropped node reveals no slot key, and with the complete graph the nodes answer it
        # unsigned (``NodeEpoch.unmask``), which saves a round trip in every round without dropouts.
        signed = any(ad.signature for ad in epoch.ads.values())
        consistency = signed and request.needs_confirmations(complete=epoch.complete)
        # With the complete graph any t survivors hold every needed share, and a node checks t
        # signatures over the view: ask t + spare of them (rotating with the slot) to confirm and then
        # to unmask, and the rest only if too few answer. Every survivor gets the same view and the
        # same request, so asking again reveals nothing new. The sparse graph asks every survivor.
        first = survivors
        if epoch.complete:
            turn = rnd.slot % len(survivors)
            rotated = survivors[turn:] + survivors[:turn]
            first = rotated[: epoch.params.threshold + config.secagg_unmask_spare]
        signatures: dict[int, bytes] = {}
        asked_to_confirm: set[int] = set()
        confirm_s = 0.0

        def confirm(nodes: list[int]) -> None:
            nonlocal request, confirm_s
            if not nodes:
                return
            began = self.clock()
            asked_to_confirm.update(nodes)
            view = encode_unmask_request(request)
            for node, reply in self.exchange([self._message(CONFIRM, n, view) for n in nodes], failures,
                                             "secagg-confirm", config.secagg_stage_timeout):
                try:
                    signatures[node] = decode_confirmation(_secagg(reply))
                except SecureAggregationError as exc:
                    failures[node] = ("secagg-confirm", str(exc))
            request = rnd.confirm(signatures)
            confirm_s += self.clock() - began

        asked_to_unmask: set[int] = set()
        for ask in (first, [n for n in survivors if n not in first]):
            ask = [n for n in ask if n not in asked_to_unmask]
            if not ask or rnd.can_unmask():
                break
            if consistency:  # only a node that signed the view may unmask, and only with t signatures in hand
                confirm([n for n in ask if n not in asked_to_confirm])
                if len(signatures) < epoch.params.threshold:
                    more = [n for n in survivors if n not in asked_to_confirm]
                    if more:
                        confirm(more)
                        ask += [n for n in more if n not in ask]
                ask = [n for n in ask if n in signatures]  # the others refuse to unmask
            asked_to_unmask.update(ask)
            record = encode_unmask_request(request)

            def unmask(node: int, reply: Message) -> None:
                try:  # each share is checked against its commitment as it arrives (``add_unmask``)
                    rnd.add_unmask(decode_unmask_reply(_secagg(reply), node=node))
                except SecureAggregationError as exc:
                    failures[node] = ("secagg-unmask", str(exc))

            # The stage ends once every needed secret has t checked shares: the spare's reply, or a
            # slow node's, is not waited for (asking it revealed nothing the others did not).
            self.exchange([self._message(UNMASK, n, record) for n in ask], failures, "secagg-unmask",
                          config.secagg_stage_timeout, consume=unmask, enough=rnd.can_unmask)
        outcomes = rnd.result()
        if consistency:
            timings["secagg-confirm"] = confirm_s
        timings["secagg-unmask"] = self.clock() - start - confirm_s
        fp = epoch.params.fixed_point(len(epoch.members))
        means: dict[int, tuple[list[int], SecureMean]] = {}
        errors = []
        for k, group in zip(order, outcomes, strict=True):
            if group.total is None:
                errors.append(f"cluster {k}: {group.error}")
                continue
            try:
                mean = read_payload(group.total, min_weight=100 * fp.error_bound, contributors=len(group.survivors),
                                    clip=epoch.params.clip, tolerance=100 * fp.error_bound)
            except EmptyAggregationError as exc:
                errors.append(f"cluster {k}: {exc}")
                continue
            except SecureAggregationError as exc:
                number = next(iter(configs.values())).server_round
                errors.append(f"round {number} cluster {k}: {exc}")
                continue
            if positions is not None:  # shared random-k: the mean covers the round's coordinates only
                full = np.zeros_like(bases[k])
                full[positions] = mean.update
                mean = replace(mean, update=full)
            means[k] = (list(group.survivors), mean)
        if not means:
            raise SecureAggregationError(f"no masked sum could be unmasked: {'; '.join(errors)}")
        if errors:
            log.warning("secure aggregation: %s", "; ".join(errors))
        result.apply_group_means(models, means, clustered=clustered, max_weight=config.secagg_max_weight)
        log.info("secure aggregation: slot %s summed %s of %s masked inputs in %s group(s)",
                 rnd.slot, len(result.accepted), len(participants), len(order))
        return result
