"""The node's half of masking secure aggregation, carried over Flower messages.

The protocol state (this epoch's private keys, the shares the node holds, which slots it used)
lives in the node's Flower ``context.state`` — kept by the SuperNode between messages, never sent
to the server. What leaves the node: public keys, share bundles encrypted for each neighbour, the
masked vector ``[w, w·loss, w·(θ_local − θ_global)]`` and, once per round, the shares the protocol
allows. Per-node metrics other than training time are not sent in this mode: they are part of the
secure sum or stay on the node.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from numpy.typing import NDArray

from quorumfl.aggregation.secagg import NodeEpoch, UnmaskRequest, flatten, weighted_payload
from quorumfl.aggregation.secagg.identity import Roster, department_message, load_signing_key, sign
from quorumfl.client.signed_config import check_masking_params
from quorumfl.client.virtual import record_payload
from quorumfl.errors import SecureAggregationError
from quorumfl.protocol.secure_wire import (
    MASKED,
    MISSING_KEYS,
    SECAGG,
    decode_announcement,
    decode_directory,
    decode_mask_request,
    decode_unmask_request,
    encode_advertisement,
    encode_bundles,
    encode_confirmation,
    encode_masked,
    encode_unmask_reply,
)
from quorumfl.protocol.wire import METRICS, NODE, ROSTER_KEY, clear_metrics

if TYPE_CHECKING:
    from quorumfl.client.steps import LocalTraining

__all__ = ["Identity", "advertise", "confirm", "identity", "masked_train_reply", "node_record", "share", "signed_slot",
           "unmask"]

_STATE = "secagg-epoch"


def _load(context: Context) -> NodeEpoch:
    if _STATE not in context.state.config_records:
        raise SecureAggregationError(
            f"this node {MISSING_KEYS} for the run (it restarted or missed the key set-up); "
            "the server re-keys in the next round", node=str(context.node_id)
        )
    data = context.state.config_records[_STATE].get("state")
    if not isinstance(data, bytes):
        raise SecureAggregationError("stored secure-aggregation state is unreadable", node=str(context.node_id))
    return NodeEpoch.from_bytes(data)


def _store(context: Context, state: NodeEpoch) -> None:
    context.state.config_records[_STATE] = ConfigRecord({"state": state.to_bytes()})


def _record(msg: Message) -> ConfigRecord:
    if SECAGG not in msg.content.config_records:
        raise SecureAggregationError("message has no 'secagg' record")
    return msg.content.config_records[SECAGG]


@dataclass(frozen=True)
class Identity:
    """How this node signs and checks advertisements: its node key and the run's roster (both None
    in an unsigned federation, where nodes have no keys and the run has no roster)."""

    key: ec.EllipticCurvePrivateKey | None
    roster: Roster | None
    department: str = ""

    def signer(self) -> Callable[[bytes], bytes] | None:
        key = self.key
        return None if key is None else (lambda message: sign(key, message))


def identity(context: Context) -> Identity:
    """This node's signing identity for the run; fails closed when only one of key and roster is there,
    or when the node's key is not the roster's key for the department it was started as."""
    node = str(context.node_id)
    key_path = str(context.node_config.get("node-key", "") or "")
    roster_json = str(context.run_config.get(ROSTER_KEY, "") or "")
    if not key_path and not roster_json:
        return Identity(None, None)
    if not key_path:
        raise SecureAggregationError("the run has a roster but this node has no node key to sign with "
                                     "(start it with its key: 'quorumfl node start --key')", node=node)
    if not roster_json:
        raise SecureAggregationError("the run carries no roster of departments, so peers' keys cannot be checked; "
                                     "refusing (the server could hand out keys of its own)", node=node)
    try:
        data = Path(key_path).read_bytes()
    except OSError as exc:
        raise SecureAggregationError(f"cannot read the node key {key_path}: {exc.strerror}", node=node) from exc
    key = load_signing_key(data, source=key_path)
    roster = Roster.from_json(roster_json)
    department = roster.department_of(key)
    claimed = str(context.node_config.get("department", "") or "")
    if claimed and claimed != department:
        raise SecureAggregationError(f"this node was started as department {claimed!r} but its key is "
                                     f"{department!r}'s on the roster; refusing", node=node)
    return Identity(key, roster, department)


def node_record(context: Context, department: str) -> ConfigRecord:
    """The ``node`` record of every reply: the department, and when the node has a key and the run a
    roster, its roster name signed with the node key (the server takes the name only if the
    signature verifies; a run without a roster, e.g. a hand-made ``flwr run`` app, gets the plain name)."""
    if not context.node_config.get("node-key") or not context.run_config.get(ROSTER_KEY):
        return ConfigRecord({"department": department})  # nothing to sign with, or no roster to be named by
    me = identity(context)
    signer = me.signer()
    if signer is None:
        return ConfigRecord({"department": department})
    signature = signer(department_message(binding=_binding(context), node=int(context.node_id), department=me.department))
    return ConfigRecord({"department": me.department, "department-signature": signature})


def advertise(msg: Message, context: Context) -> RecordDict:
    """Stage 1: fresh keys for a new epoch (any older epoch's keys are dropped), signed as the
    node's roster department, once the announced parameters are those the admin signed
    (``check_masking_params``); the signature covers them and the cohort, so peers told otherwise
    refuse it."""
    me = identity(context)
    announcement = decode_announcement(_record(msg))
    check_masking_params(context.run_config, announcement.params, len(announcement.cohort), node=str(context.node_id))
    state, ad = NodeEpoch.advertise(announcement, int(context.node_id), signer=me.signer(),
                                    department=me.department, binding=_binding(context))
    _store(context, state)
    return RecordDict({SECAGG: encode_advertisement(ad)})


def _binding(context: Context) -> bytes:
    return b"run:" + str(context.run_id).encode()


def share(msg: Message, context: Context) -> RecordDict:
    """Stage 2: Shamir shares of this epoch's slot keys and seeds, encrypted per neighbour, once
    every peer's advertisement verified against the roster."""
    state = _load(context)
    bundles = state.share(decode_directory(_record(msg), slots=state.params.slots), roster=identity(context).roster)
    _store(context, state)
    return RecordDict({SECAGG: encode_bundles(bundles)})


def signed_slot(context: Context, epoch: bytes, slot: int) -> str:
    """The contribution ledger's name for ``slot`` of ``epoch`` when the epoch is signed (it has a
    consistency stage, so an input this node never confirmed can be released), "" when it is not.
    Raises before anything is trained or recorded when this node does not hold that epoch's keys:
    it could not mask the update (the server re-keys on this reason)."""
    state = _load(context)
    if state.epoch != epoch:
        raise SecureAggregationError(f"this node {MISSING_KEYS} for the epoch of this request (it re-keyed or "
                                     "missed the key set-up); the server re-keys in the next round",
                                     node=str(context.node_id))
    if not state.signature:
        return ""
    from quorumfl.privacy.contributions import slot_key

    return slot_key(epoch, slot)


def constant_coordinates(local: LocalTraining) -> NDArray[np.bool_]:
    """The update's coordinates (``flatten`` order) that training never changes: the model's
    standardisation buffers, which only a statistics round fills, and a DP run has none."""
    from quorumfl.core.tasks import ModelSpec
    from quorumfl.core.tasks.modules import Standardize

    config = local.config
    spec = ModelSpec(config.task, config.model, config.schema)
    if not getattr(spec.resolve(), "needs_statistics", False):  # no standardisation layer: nothing to build
        return np.zeros(sum(np.asarray(v).size for v in local.trained.values()), dtype=bool)
    model = spec.build(seed=0)
    names = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
             if isinstance(module, Standardize) for name in Standardize.STATISTICS}
    return np.concatenate([np.full(np.asarray(local.trained[k]).size, k in names, dtype=bool)
                           for k in sorted(local.trained)])


def masked_train_reply(msg: Message, context: Context, local: LocalTraining) -> RecordDict:
    """The train reply in masked mode: only the masked weighted update and the training time."""
    state = _load(context)
    request, max_weight = decode_mask_request(_record(msg), node=int(context.node_id))
    if local.config.compression == "randk":  # shared coordinates: the masked sum is the sum of encodings
        from quorumfl.client.compress import shared_update_vector

        update = shared_update_vector(context, local)
    elif local.config.compression != "none":
        raise SecureAggregationError(f"compression {local.config.compression} cannot be masked: only randk keeps "
                                     "the same coordinates on every node")
    else:
        update = flatten(local.trained) - flatten(local.received)
    examples = float(local.num_examples)
    if local.config.dp == "distributed":  # clip, add this node's noise share; every department counts once
        from quorumfl.privacy.distributed import noisy_share

        # the node reveals a group's sum only with at least group_quorum survivors, so each adds
        # 1/group_quorum of the variance: a larger divisor from the server would thin the noise
        if not 1 <= local.config.dp_noise_share <= state.params.group_quorum:
            raise SecureAggregationError(
                f"the request divides the DP noise among {local.config.dp_noise_share} nodes, but a sum is revealed "
                f"with as few as {state.params.group_quorum}; the update is withheld", node=str(context.node_id))

        update = noisy_share(update, clip=local.config.dp_clip, noise_multiplier=local.config.dp_noise_multiplier,
                             share=local.config.dp_noise_share, rng=np.random.default_rng(secrets.randbits(128)),
                             constant=constant_coordinates(local))
        examples = max_weight
    payload = weighted_payload(update, examples=examples, loss=local.train_loss, max_weight=max_weight,
                               clip=state.params.clip, value=local.eval_value, eval_loss=local.eval_loss,
                               norm_bound=local.config.update_norm_bound)
    record_payload(context.node_config, round_number=local.config.server_round, node=int(context.node_id),
                   received=local.received, payload=payload)
    masked = state.mask(request, payload, np.random.default_rng(secrets.randbits(128)))
    _store(context, state)
    arrays, config = encode_masked(masked, epoch=request.epoch, slot=request.slot)
    return RecordDict(
        {
            MASKED: arrays,
            SECAGG: config,
            METRICS: MetricRecord(clear_metrics(local.metrics)),
            NODE: node_record(context, local.department),
        }
    )


def confirm(msg: Message, context: Context) -> RecordDict:
    """Consistency stage (signed epochs): sign the round's survivor/dropped view, once per slot."""
    me = identity(context)
    signer = me.signer()
    if signer is None:
        raise SecureAggregationError("this node has no key to confirm the survivors with", node=str(context.node_id))
    state = _load(context)
    request = decode_unmask_request(_record(msg))
    signature = state.confirm(request, signer)
    # The contribution ledger learns that this slot's input may now be unmasked (and refuses a slot
    # released by a later contribution from the same model), and the node its confirmed view, both
    # before the signature leaves.
    _consent(context, request)
    _store(context, state)
    return RecordDict({SECAGG: encode_confirmation(signature)})


def _consent(context: Context, request: UnmaskRequest) -> None:
    """Record in the node's contribution ledger that its input in ``request``'s slot may be unmasked;
    refuses a slot released by a later contribution from the same model (signed epochs)."""
    from quorumfl.client.personal_store import node_state_dir
    from quorumfl.privacy.contributions import ContributionLedger, slot_key

    ContributionLedger(node_state_dir(context.node_config, int(context.node_id))).confirm(
        slot_key(request.epoch, request.slot))


def unmask(msg: Message, context: Context) -> RecordDict:
    """Stage 4: the shares this node may reveal for the round's survivors and dropped nodes; in a
    signed epoch only for the view it confirmed, with enough valid confirmations from its peers, or
    for a view with no dropped node without a consistency stage (``NodeEpoch.unmask``)."""
    state = _load(context)
    request = decode_unmask_request(_record(msg))
    confirmed = request.slot in state.confirmed  # the consistency stage already told the ledger
    reply = state.unmask(request, roster=identity(context).roster)
    if state.signature and not confirmed:  # signed epoch, no consistency stage: consent before the shares leave
        _consent(context, request)
    _store(context, state)  # what was revealed is recorded before it leaves
    return RecordDict({SECAGG: encode_unmask_reply(reply)})
