"""The node's half of threshold CKKS, carried over Flower messages.

Key material lives in the node's key store (``privacy.keystore``): a directory given by the node
config ``key-dir`` (default ``$QUORUMFL_HOME/node-keys/<node id>``), never sent anywhere. What
leaves the node: a commitment and a transport key (signed with its node key in a signed
federation), its public share b_i and Shamir shares encrypted for each member, its encrypted
update (c0 under the round's common c1) with a signed contribution record, and partial
decryptions of aggregates whose manifest passes every refusal rule. A node encrypts only under a
key it holds a share of (a node that joined after the ceremony refuses until the next one) and
only once under a round nonce. Both ledgers — nonces encrypted under, (round, group) pairs
decrypted — are written to disk before what they guard is returned, so a restarted node still
refuses a repeat; each key answers at most the run's ``ckks-max-decryptions``.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from quorumfl.aggregation.ckks import (
    MAX_DECRYPTIONS,
    KeyParty,
    check_request,
    contribute,
    encrypt_vector,
)
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.ckks.threshold import answer_checked
from quorumfl.aggregation.secagg import flatten, weighted_payload
from quorumfl.client.secure import _binding, identity, node_record
from quorumfl.client.signed_config import check_ceremony
from quorumfl.client.virtual import record_payload
from quorumfl.core.files import default_home
from quorumfl.errors import NotFoundError, SecureAggregationError
from quorumfl.privacy.keystore import KeyStore, StoredKey
from quorumfl.protocol.ckks_wire import (
    ARRAYS,
    CKKS,
    ENCRYPTED,
    decode_announcement,
    decode_decrypt_request,
    decode_directory,
    decode_finish,
    decode_train_request,
    encode_commitment,
    encode_encrypted,
    encode_partial,
    encode_reveal,
)
from quorumfl.protocol.wire import METRICS, NODE, clear_metrics

MAX_DECRYPTIONS_KEY = "ckks-max-decryptions"  # run-config key (declared in the server's config defaults)
MIN_GROUP_KEY = "secagg-min-group"  # run-config key: the fewest contributors a decrypted sum may have

if TYPE_CHECKING:
    from quorumfl.client.steps import LocalTraining

__all__ = ["commit", "decrypt", "encrypted_train_reply", "finish", "key_store", "reveal"]


def key_store(context: Context) -> KeyStore:
    configured = context.node_config.get("key-dir")
    if isinstance(configured, str) and configured:
        return KeyStore(Path(configured).expanduser())
    home = default_home()
    return KeyStore(home / "node-keys" / str(context.node_id))


def _config(msg: Message) -> ConfigRecord:
    if CKKS not in msg.content.config_records:
        raise SecureAggregationError("message has no 'ckks' record")
    return msg.content.config_records[CKKS]


def _arrays(msg: Message) -> RecordDict:
    if ARRAYS not in msg.content.array_records:
        raise SecureAggregationError(f"message has no '{ARRAYS}' record")
    return msg.content


def commit(msg: Message, context: Context) -> RecordDict:
    """Ceremony stage 1: a fresh secret, its public share, and only a commitment to it, once the
    announced members, t and parameters are those the admin signed (``check_ceremony``); the
    commitment's signature covers them, so members told otherwise refuse it."""
    announcement, _ = decode_announcement(_config(msg))
    check_ceremony(context.run_config, announcement, node=str(context.node_id))
    me = identity(context)
    party, commitment = KeyParty.commit(announcement, int(context.node_id), signer=me.signer(),
                                        department=me.department, binding=_binding(context))
    key_store(context).save_party(party)
    return RecordDict({CKKS: encode_commitment(commitment, announcement.ceremony)})


def reveal(msg: Message, context: Context) -> RecordDict:
    """Ceremony stage 2: reveal b_i and send every committed member its encrypted share."""
    ceremony, commitments = decode_directory(_config(msg))
    store = key_store(context)
    party = store.load_party(ceremony)
    result = party.reveal(commitments, roster=identity(context).roster, binding=_binding(context))
    store.save_party(party)
    config, arrays = encode_reveal(result, ceremony)
    return RecordDict({CKKS: config, ARRAYS: arrays})


def finish(msg: Message, context: Context) -> RecordDict:
    """Ceremony stage 3: check reveals against commitments, keep the summed share, name the key."""
    content = _arrays(msg)
    ceremony, reveals, inbox = decode_finish(_config(msg), content.array_records[ARRAYS])
    store = key_store(context)
    party = store.load_party(ceremony)
    share = party.finish(reveals, inbox)
    store.save_key(StoredKey(share, run_id=int(context.run_id)))
    store.drop_party(ceremony)
    return RecordDict({CKKS: ConfigRecord({"ceremony": ceremony, "key_id": share.key_id})})


def encrypted_train_reply(msg: Message, context: Context, local: LocalTraining) -> RecordDict:
    """The train reply in CKKS mode: the weighted, clipped update encrypted under the joint key."""
    request = decode_train_request(_config(msg))
    seal = Seal.of(request.params)
    if request.primes not in seal.levels:
        raise SecureAggregationError(f"no ciphertext level with {request.primes} primes")
    store = key_store(context)
    try:
        share = store.load_key(request.key_id).share
    except NotFoundError:
        raise SecureAggregationError(
            f"this node holds no share of key {request.key_id} (it joined after that key ceremony), so it cannot "
            "check the public key it was sent; it contributes after the next ceremony", node=str(context.node_id)
        ) from None
    if not hmac.compare_digest(share.public_key, request.public_key):
        raise SecureAggregationError(f"the public key sent for {request.key_id} is not the one this node holds; "
                                     "refusing to encrypt under it", node=str(context.node_id))
    me = identity(context)
    update = flatten(local.trained) - flatten(local.received)
    payload = weighted_payload(update, examples=local.num_examples, loss=local.train_loss, max_weight=request.max_weight,
                               clip=request.clip, value=local.eval_value, eval_loss=local.eval_loss,
                               norm_bound=local.config.update_norm_bound)
    payload = np.clip(payload, -request.clip, request.clip)
    record_payload(context.node_config, round_number=request.round_number, node=int(context.node_id),
                   received=local.received, payload=payload)
    c0 = encrypt_vector(share, payload, primes=request.primes, round_number=request.round_number,
                        group=request.group, nonce=request.nonce, wire=True)
    tag = contribute(share, c0, round_number=request.round_number, group=request.group, nonce=request.nonce,
                     length=len(payload), primes=request.primes, signer=me.signer(), department=me.department,
                     binding=_binding(context))
    store.record_encrypted(request.key_id, request.nonce)  # on disk before the ciphertext leaves
    arrays, config = encode_encrypted(c0, tag, key_id=request.key_id, round_number=request.round_number)
    return RecordDict({
        ENCRYPTED: arrays,
        CKKS: config,
        METRICS: MetricRecord(clear_metrics(local.metrics)),
        NODE: node_record(context, local.department),
    })


def decrypt(msg: Message, context: Context) -> RecordDict:
    """A partial decryption, after every refusal rule and after the ledger entry is on disk."""
    manifest, contributions = decode_decrypt_request(_config(msg))
    store = key_store(context)
    stored = store.load_key(manifest.key_id)
    asked = set(stored.asked)
    roster, binding, cap = identity(context).roster, _binding(context), _max_decryptions(context)
    check_request(stored.share, manifest, asked, contributions, roster=roster, binding=binding, max_decryptions=cap,
                  min_contributors=_min_contributors(context))
    store.record_asked(manifest.key_id, manifest.round, manifest.group)
    partial = answer_checked(stored.share, manifest)  # checked above, before the ledger entry
    config, arrays = encode_partial(partial, manifest)
    return RecordDict({CKKS: config, ARRAYS: arrays})


def _min_contributors(context: Context) -> int | None:
    """The run's ``secagg-min-group`` (admin-signed run config): the fewest contributors a decrypted
    sum may have; None (0 or unset): the key's threshold t."""
    value = context.run_config.get(MIN_GROUP_KEY, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value == 1:
        raise SecureAggregationError(f"run config {MIN_GROUP_KEY}={value!r} must be 0 (the threshold) or a whole "
                                     "number >= 2")
    return value or None


def _max_decryptions(context: Context) -> int:
    value = context.run_config.get(MAX_DECRYPTIONS_KEY, MAX_DECRYPTIONS)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SecureAggregationError(f"run config {MAX_DECRYPTIONS_KEY}={value!r} must be a positive integer")
    return value
