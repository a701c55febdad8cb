"""The server's half of threshold CKKS, carried over Flower messages.

``CkksSession`` runs a key ceremony across the connected nodes when the run has no key yet, when
the admin asked for one (``quorumfl keys ceremony RUN``) or when too few key holders remain;
three round trips (commit, reveal, finish), once. A round is then exactly two round trips:

1. train — to the key's holders only; the request carries the public key, the ciphertext level
   and a fresh round nonce (with key, round and group it names the round's common c1); each reply
   carries the node's encrypted ``[w, w·loss, w·Δθ]`` (c0 only), added at once into a running
   sum, and its contribution record signed with its node key over the c0's digest (checked here
   against the roster and the c0 received, so one bad contribution is dropped instead of failing
   the decryption); a node whose ClientApp crashed is sent the same request again
   (``train-retries``), which is safe because a node encrypts at most once under a round nonce;
2. decrypt — the server fixes S (t key holders among the contributors, rotating with the round),
   records the manifest (round, contributors, S) in the state DB, and sends S the manifest with
   every contributor's record (no ciphertext: each member derives c1 itself). With every partial
   decryption of S back it combines and decodes.

A new ceremony runs before a round when nodes that were not members of the current key's ceremony
are available (they cannot contribute under a key they hold no share of), when too few holders
remain, and when the key has answered ``ckks-max-decryptions`` decryptions (its holders refuse more).

The server holds no key material. Fewer than t contributors, or a member of S that does not
answer, ends the round with nothing decrypted; the global model stays as it was.
"""

from __future__ import annotations

import hmac
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from numpy.typing import NDArray

from quorumfl.aggregation.ckks import (
    Announcement,
    CeremonyCoordinator,
    CiphertextSum,
    Contribution,
    DecryptionSum,
    ceremony_threshold,
)
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES, c0_digest, contribution_message
from quorumfl.aggregation.secagg import (
    HEADER,
    SecureMean,
    flatten,
    read_payload,
)
from quorumfl.aggregation.secagg.identity import Roster
from quorumfl.errors import (
    EmptyAggregationError,
    QuorumError,
    QuorumNotMetError,
    SecureAggregationError,
    StateError,
)
from quorumfl.protocol.ckks_wire import ARRAYS as CKKS_ARRAYS
from quorumfl.protocol.ckks_wire import (
    CKKS,
    COMMIT,
    DECRYPT,
    ENCRYPTED,
    FINISH,
    REVEAL,
    TrainRequest,
    decode_commitment,
    decode_encrypted,
    decode_partial,
    decode_reveal,
    encode_announcement,
    encode_decrypt_request,
    encode_directory,
    encode_finish,
    encode_train_request,
    finish_arrays,
)
from quorumfl.protocol.wire import (
    ARRAYS,
    CONFIG,
    TrainConfig,
    to_array_record,
)
from quorumfl.server.config import RunConfig
from quorumfl.server.phase import TrainPhase, cluster_groups

__all__ = ["FINISH_WAVE_BYTES", "AuditTrail", "CkksKey", "CkksSession", "SpooledBundles", "finish_waves"]

log = logging.getLogger(__name__)
Arrays = dict[str, NDArray[np.generic]]
Failures = dict[int, tuple[str, str]]
# (messages, failures to fill, stage name, timeout seconds[, consume each good reply]) -> good replies
Exchange = Callable[..., list[tuple[int, Message]]]
# The finish stage asks members in waves whose inboxes add up to at most this much (at least one member
# a wave), so the server, and in a simulation Flower's Ray plumbing in the same process, never holds
# every member's inbox at once. Measured at 100 members (13 MB inboxes, scale.py's CKKS run): peak RSS
# 2,304 MB with no waves, 1,265 / 1,119 / 946 MB with waves of 96 / 32 / 16 MB; the ceremony took
# 84 s, then 91 / 91 / 98 s. In a deployment each wave is one more round trip (about 0.7 s on two cores).
FINISH_WAVE_BYTES = 16 << 20


class SpooledBundles:
    """The ceremony's encrypted share bundles on disk between the reveal and finish stages.

    Every member sends a bundle for every other member through the server: n·(n − 1) of them, 1.3 GB
    at 100 members, which the server would otherwise hold in memory until every member has its inbox.
    They go to an anonymous temporary file (unlinked as it is made, so a crash leaves nothing) in the
    run's model folder, where the admin keeps the run's large files. They are encrypted for their
    recipients; the file holds nothing the server could not already read from the messages."""

    def __init__(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._file = tempfile.TemporaryFile(dir=directory, prefix="ckks-bundles-")  # noqa: SIM115 (closed by close)
        except OSError as exc:
            raise StateError(f"cannot make the key ceremony's bundle file in {directory} ({exc.strerror}); "
                             "set model-dir to a writable folder") from exc
        self._index: dict[int, dict[int, tuple[int, int]]] = {}
        self._end = 0

    def put(self, sender: int, recipient: int, bundle: bytes) -> None:
        self._file.seek(self._end)
        self._file.write(bundle)
        self._index.setdefault(recipient, {})[sender] = (self._end, len(bundle))
        self._end += len(bundle)

    def inbox(self, recipient: int) -> dict[int, bytes]:
        bundles = {}
        for sender, (offset, size) in sorted(self._index.get(recipient, {}).items()):
            self._file.seek(offset)
            data = self._file.read(size)
            if len(data) != size:
                raise SecureAggregationError(f"the spooled bundle from node {sender} to node {recipient} is truncated")
            bundles[sender] = data
        return bundles

    def size(self, recipient: int) -> int:
        return sum(size for _, size in self._index.get(recipient, {}).values())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SpooledBundles:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def finish_waves(members: Sequence[int], size: Callable[[int], int], budget: int | None = None) -> list[list[int]]:
    """``members`` in order, cut into consecutive waves whose inboxes add up to at most ``budget``
    bytes (default ``FINISH_WAVE_BYTES``; a member whose inbox alone is larger forms a wave of its own)."""
    budget = FINISH_WAVE_BYTES if budget is None else budget
    waves: list[list[int]] = []
    current: list[int] = []
    used = 0
    for member in members:
        need = size(member)
        if current and used + need > budget:
            waves.append(current)
            current, used = [], 0
        current.append(member)
        used += need
    if current:
        waves.append(current)
    return waves


@dataclass(frozen=True)
class CkksKey:
    key_id: str
    public_key: bytes
    threshold: int
    members: tuple[int, ...]
    holders: tuple[int, ...]


class AuditTrail:
    """Where the session records ceremonies and decryptions (the state DB in a run; nothing in tests)."""

    def ceremony_requested(self) -> bool:
        return False

    def ceremony_started(self, members: Sequence[int], threshold: int, params: dict[str, object]) -> int:
        return 0

    def ceremony_finished(self, ceremony: int, *, key_id: str | None, holders: Sequence[int], error: str | None) -> None:
        return None

    def decryption_started(self, *, key_id: str, contributors: Sequence[int], decryptors: Sequence[int]) -> int:
        return 0

    def decryption_finished(self, decryption: int, *, error: str | None) -> None:
        return None


def _reply_config(reply: Message) -> ConfigRecord:
    if CKKS not in reply.content.config_records:
        raise SecureAggregationError("reply has no 'ckks' record")
    return reply.content.config_records[CKKS]


class CkksSession:
    """Threshold-CKKS rounds of one run against a Flower Grid (through the Federation's exchange)."""

    def __init__(self, config: RunConfig, exchange: Exchange, *, run_id: int, audit: AuditTrail | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.params = config.ckks_params()
        self.exchange = exchange
        self.run_id = run_id
        self.audit = audit or AuditTrail()
        self.clock = clock
        self.key: CkksKey | None = None
        self.ceremonies = 0
        self.decryptions = 0  # asked under the current key
        self.roster = Roster.from_json(config.roster) if config.roster else None
        self.binding = b"run:" + str(run_id).encode()

    def _message(self, kind: str, node: int, content: RecordDict) -> Message:
        return Message(content=content, dst_node_id=node, message_type=kind)

    # ---- key ceremony -------------------------------------------------------------------------------
    def ceremony(self, nodes: Sequence[int], failures: Failures) -> CkksKey:
        """Commit, reveal, finish across ``nodes``; raises when fewer than t finish."""
        self.key = None
        members = sorted(nodes)
        threshold = ceremony_threshold(self.config.secagg_threshold, len(members), floor=self.config.ckks_min_threshold,
                                       roster=len(self.roster.keys) if self.roster is not None else 0)
        if threshold > len(members):
            raise QuorumNotMetError(f"{len(members)} node(s) can take part in a key ceremony, but its t is {threshold} "
                                    f"(secagg-threshold over the roster, or ckks-min-threshold); more departments must "
                                    "be online")
        # the scale this ceremony's size needs (more holders, more flooding noise); the key's rounds use it
        self.params = self.config.ckks_params().fitted(threshold=threshold, contributors=len(members))
        self.params.check(threshold=threshold, contributors=len(members), value_bound=self.config.secagg_clip)
        ann = Announcement.new(members, threshold, self.params)
        record_id = self.audit.ceremony_started(members, threshold, self.params.to_dict())
        timeout = self.config.secagg_stage_timeout
        try:
            with SpooledBundles(self.config.resolved_model_dir()) as spool:
                coordinator = CeremonyCoordinator(ann, spool)
                announce = encode_announcement(ann, run_id=self.run_id)
                for node, reply in self.exchange([self._message(COMMIT, n, RecordDict({CKKS: announce})) for n in members],
                                                 failures, "ckks-commit", timeout):
                    try:
                        coordinator.add_commitment(decode_commitment(_reply_config(reply), node=node, ceremony=ann.ceremony))
                    except SecureAggregationError as exc:
                        failures[node] = ("ckks-commit", str(exc))
                directory = encode_directory(ann.ceremony, coordinator.directory())
                committed = sorted(coordinator.commitments)

                def take_reveal(node: int, reply: Message) -> None:
                    """Decode each reveal as it is pulled and spool its bundles; neither the reply nor the
                    decoded bundles are kept."""
                    try:
                        content = reply.content
                        if CKKS_ARRAYS not in content.array_records:
                            raise SecureAggregationError("reveal reply has no arrays")
                        coordinator.add_reveal(decode_reveal(_reply_config(reply), content.array_records[CKKS_ARRAYS],
                                                             node=node, ceremony=ann.ceremony))
                    except SecureAggregationError as exc:
                        failures[node] = ("ckks-reveal", str(exc))

                self.exchange([self._message(REVEAL, n, RecordDict({CKKS: directory})) for n in committed],
                              failures, "ckks-reveal", timeout, consume=take_reveal)
                reveals, inbox = coordinator.finish_request()
                shared = finish_arrays(reveals)  # one record for every member's request
                deadline = self.clock() + timeout  # the stage's, across its waves
                for wave in finish_waves(sorted(reveals), spool.size):
                    messages = []
                    for node in wave:
                        config, arrays = encode_finish(ann.ceremony, reveals, inbox[node], shared)
                        messages.append(self._message(FINISH, node, RecordDict({CKKS: config, CKKS_ARRAYS: arrays})))
                    replies = self.exchange(messages, failures, "ckks-finish", max(0.0, deadline - self.clock()))
                    del messages  # this wave's inboxes go before the next wave's are read
                    for node, reply in replies:
                        try:
                            key_id = _reply_config(reply).get("key_id")
                            if not isinstance(key_id, str):
                                raise SecureAggregationError("finish reply has no key id")
                            coordinator.confirm(node, key_id)
                        except SecureAggregationError as exc:
                            failures[node] = ("ckks-finish", str(exc))
                if len(coordinator.confirmed) < threshold:
                    raise QuorumNotMetError(
                        f"only {len(coordinator.confirmed)} of {len(members)} nodes hold a key share; t is {threshold}"
                    )
        except QuorumError as exc:
            self.audit.ceremony_finished(record_id, key_id=None, holders=[], error=str(exc))
            raise
        assert coordinator.public_key is not None
        key = CkksKey(coordinator.key_id, coordinator.public_key, threshold, tuple(members),
                      tuple(sorted(coordinator.confirmed)))
        self.audit.ceremony_finished(record_id, key_id=key.key_id, holders=key.holders, error=None)
        self.key = key
        self.ceremonies += 1
        self.decryptions = 0
        log.info("threshold CKKS: key %s with %s of %s holders (t=%s)", key.key_id, len(key.holders), len(members),
                 threshold)
        return key

    def _needs_ceremony(self, available: Sequence[int]) -> bool:
        key = self.key
        return (
            key is None
            or self.audit.ceremony_requested()
            or len(set(key.holders) & set(available)) < key.threshold
            or bool(set(available) - set(key.members))  # new nodes hold no share of this key
            or self.decryptions >= self.config.ckks_max_decryptions
        )

    def _check_tag(self, tag: Contribution, c0: NDArray[np.uint64], key_id: str, number: int, group: int,
                   nonce: bytes, *, length: int, primes: int) -> None:
        if not hmac.compare_digest(tag.digest, c0_digest(c0)):
            raise SecureAggregationError("the contribution record names another ciphertext than the one sent")
        if self.roster is not None:
            self.roster.check(tag.department, contribution_message(
                binding=self.binding, key_id=key_id, round_number=number, group=group, nonce=nonce, length=length,
                primes=primes, node=tag.node, department=tag.department, digest=tag.digest), tag.signature,
                node=tag.node)

    # ---- one round ----------------------------------------------------------------------------------------
    def round(
        self,
        number: int,
        available: Sequence[int],
        models: Sequence[Arrays],
        configs: dict[int, TrainConfig],
        failures: Failures,
        timings: dict[str, float],
        *,
        cluster_of: Mapping[int, int] | None = None,
    ) -> TrainPhase:
        """One CKKS round for the selected nodes (the keys of ``configs``) on the global model
        (``models`` holds one) or, with ``cluster_of``, on IFCA's cluster models: each cluster is
        one group, encrypted, summed and decrypted on its own; a cluster with fewer nodes than the
        group minimum (``secagg-min-group``, else t) sits the round out."""
        try:
            start = self.clock()
            key = self.key
            if key is None or self._needs_ceremony(available):
                key = self.ceremony(available, failures)
            timings["ckks-ceremony"] = self.clock() - start
            choice = dict(cluster_of) if cluster_of is not None else {n: 0 for n in configs}
            return self._round(key, number, list(models), choice, configs, failures, timings,
                               clustered=cluster_of is not None)
        except QuorumError as exc:
            log.warning("threshold CKKS: %s", exc)
            return TrainPhase(arrays=None, error=f"secure aggregation: {exc}")

    def _groups(self, key: CkksKey, cluster_of: Mapping[int, int], configs: Mapping[int, TrainConfig],
                failures: Failures, *, clustered: bool) -> dict[int, list[int]]:
        """Each group's members: the selected key holders, by cluster. A cluster below the group minimum
        sits out (its nodes recorded): its sum would reveal too few updates, and its members would
        refuse to decrypt it."""
        holders = [n for n in configs if n in key.holders]
        if not clustered:
            return {0: sorted(holders)} if holders else {}
        fewest = self.config.secagg_min_group or key.threshold
        members = cluster_groups(holders, cluster_of, fewest, failures)
        if not members:
            raise QuorumNotMetError(f"no cluster has the group minimum of {fewest} nodes")
        return members

    def _round(
        self,
        key: CkksKey,
        number: int,
        models: list[Arrays],
        cluster_of: Mapping[int, int],
        configs: dict[int, TrainConfig],
        failures: Failures,
        timings: dict[str, float],
        *,
        clustered: bool,
    ) -> TrainPhase:
        config = self.config
        groups = self._groups(key, cluster_of, configs, failures, clustered=clustered)
        if not groups:
            raise QuorumNotMetError(f"none of the selected nodes holds a share of key {key.key_id}; nothing was sent")
        group_of = {n: k for k, nodes in groups.items() for n in nodes}
        participants = sorted(group_of)
        bases = {k: flatten(models[k]) for k in groups}
        length = HEADER + next(iter(bases.values())).shape[0]
        primes = self.params.send_primes(key.threshold, max(len(key.members), len(participants)), config.secagg_clip)
        records = {k: to_array_record(models[k]) for k in groups}
        nonce = os.urandom(NONCE_BYTES)
        requests = {k: encode_train_request(TrainRequest(
            key_id=key.key_id, public_key=key.public_key, params=self.params, primes=primes, clip=config.secagg_clip,
            max_weight=config.secagg_max_weight, round_number=number, participants=tuple(groups[k]), nonce=nonce,
            group=k,
        )) for k in groups}
        messages = [
            Message(content=RecordDict({ARRAYS: records[group_of[n]], CONFIG: configs[n].to_record(),
                                        CKKS: requests[group_of[n]]}),
                    dst_node_id=n, message_type=MessageType.TRAIN)
            for n in participants
        ]
        totals = {k: CiphertextSum(self.params, length=length, primes=primes) for k in groups}
        tags: dict[int, Contribution] = {}
        result = TrainPhase(arrays=None)

        def add(node: int, reply: Message) -> None:  # each reply joins its group's running sum as it arrives
            try:
                content = reply.content
                if ENCRYPTED not in content.array_records:
                    raise SecureAggregationError("reply has no 'encrypted' record")
                polys, tag, key_id, round_number = decode_encrypted(content.array_records[ENCRYPTED],
                                                                    _reply_config(reply), node=node)
                if key_id != key.key_id or round_number != number:
                    raise SecureAggregationError(f"ciphertext is for key {key_id} round {round_number}")
                self._check_tag(tag, polys, key_id, number, group_of[node], nonce, length=length, primes=primes)
                totals[group_of[node]].add(node, polys)
            except SecureAggregationError as exc:
                failures[node] = ("train", str(exc))
                return
            tags[node] = tag
            result.note_node(node, content)
            if self.roster is not None:  # the name its registered key signed, not what the reply says
                result.departments[node] = tag.department

        # A node whose ClientApp crashed is asked again (``train-retries``): a crashed ClientApp sent no
        # ciphertext, and a node that did encrypt under this nonce refuses a second time (its ledger),
        # so a server that claims a crash after the reply gets no second encryption under c1.
        retried: dict[int, int] = {}
        start = self.clock()
        self.exchange(messages, failures, "train", config.train_deadline(), add, retries=config.train_retries,
                      retried=retried)
        result.note_retries(retried)
        timings["train"] = self.clock() - start

        start = self.clock()
        alive = sorted(n for total in totals.values() for n in total.contributors)
        means: dict[int, tuple[list[int], SecureMean]] = {}
        errors = []
        for k in sorted(groups):
            try:
                mean, contributors = self._decrypt(key, number, k, nonce, totals[k], tags, alive, failures)
            except (QuorumError, EmptyAggregationError) as exc:
                errors.append(f"cluster {k}: {exc}" if clustered else str(exc))
                continue
            means[k] = (contributors, mean)
        timings["ckks-decrypt"] = self.clock() - start
        if not means:
            raise SecureAggregationError("; ".join(errors))
        if errors:
            log.warning("threshold CKKS: %s", "; ".join(errors))
        result.apply_group_means(models, means, clustered=clustered, max_weight=config.secagg_max_weight)
        log.info("threshold CKKS: round %s summed %s encrypted updates in %s group(s) (t=%s, %s holders)",
                 number, len(result.accepted), len(groups), key.threshold, len(key.holders))
        return result

    def _decrypt(self, key: CkksKey, number: int, group: int, nonce: bytes, total: CiphertextSum,
                 tags: Mapping[int, Contribution], alive: Sequence[int],
                 failures: Failures) -> tuple[SecureMean, list[int]]:
        """The decryption round trip of one group's sum: t key holders among the round's contributors
        (its own first, rotating with the round), the manifest, every contributor's tag."""
        config = self.config
        contributors = sorted(total.contributors)
        fewest = config.secagg_min_group or key.threshold
        if len(contributors) < fewest:
            raise QuorumNotMetError(f"{len(contributors)} encrypted update(s), fewer than "
                                    f"{'t=' if fewest == key.threshold else 'the group minimum '}{fewest}; "
                                    "nothing is decrypted")
        own = [n for n in contributors if n in key.holders]
        others = [n for n in alive if n in key.holders and n not in own]
        turn = (number + group) % len(own) if own else 0
        candidates = own[turn:] + own[:turn] + others
        if len(candidates) < key.threshold:
            raise QuorumNotMetError(f"only {len(candidates)} key holder(s) among the contributors; t is {key.threshold}")
        subset = sorted(candidates[: key.threshold])
        manifest = total.manifest(key_id=key.key_id, round=number, group=group, nonce=nonce, subset=subset)
        audit_id = self.audit.decryption_started(key_id=key.key_id, contributors=contributors, decryptors=subset)
        config_record = encode_decrypt_request(manifest, {n: tags[n] for n in contributors})
        self.decryptions += 1
        content = RecordDict({CKKS: config_record})
        decrypted = DecryptionSum(self.params, total.c0, manifest)

        def add_partial(node: int, reply: Message) -> None:  # each partial joins the running sum as it arrives
            try:
                if CKKS_ARRAYS not in reply.content.array_records:
                    raise SecureAggregationError("decryption reply has no arrays")
                decrypted.add(node, decode_partial(_reply_config(reply), reply.content.array_records[CKKS_ARRAYS],
                                                   manifest))
            except SecureAggregationError as exc:
                failures[node] = ("ckks-decrypt", str(exc))

        self.exchange([self._message(DECRYPT, n, content) for n in subset], failures, "ckks-decrypt",
                      config.secagg_stage_timeout, add_partial)
        try:
            vector = decrypted.result()
            mean = read_payload(vector, min_weight=1e3 * self.params.precision, contributors=len(contributors),
                                clip=config.secagg_clip, tolerance=1e3 * self.params.precision)
        except (QuorumError, EmptyAggregationError) as exc:
            self.audit.decryption_finished(audit_id, error=str(exc))
            raise SecureAggregationError(f"round {number}: {exc}") from exc
        self.audit.decryption_finished(audit_id, error=None)
        return mean, contributors
