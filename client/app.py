"""The QuorumFL ClientApp: a department node trains and evaluates on its own partition only.

The node's partition directory comes from its node config (``data-path``), its name from
``department`` (else the partition's own label). Each message runs in a fresh process, so the
partition is read per message (it is small and local). torch is imported only by the handlers
that need it (``steps``), so the secure-aggregation stages start fast.

Handlers: ``train`` (plaintext reply, a masked one when the request carries ``secagg``, an
encrypted one when it carries ``ckks``), ``evaluate``, ``query.ifca_pick`` (IFCA's cluster choice,
asked before a masked round), the masking stages
``query.secagg_advertise|secagg_share|secagg_confirm|secagg_unmask`` and the threshold-CKKS stages
``query.ckks_commit|ckks_reveal|ckks_finish|ckks_decrypt``. On Flower's simulation engine the mod
``virtual_department`` gives each virtual node the node config a SuperNode would have.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quorumfl.client import ckks, secure
from quorumfl.client.virtual import virtual_department
from quorumfl.core.slots import hold_host_slot
from quorumfl.errors import PrivacyBudgetError, SecureAggregationError
from quorumfl.protocol.ckks_wire import CKKS
from quorumfl.protocol.secure_wire import SECAGG
from quorumfl.protocol.wire import (
    ARRAYS,
    COMPRESSION,
    METRICS,
    NODE,
    REFUSAL,
    UPDATE,
    to_array_record,
)

__all__ = ["app"]

app = ClientApp(mods=[virtual_department])  # a no-op on deployed SuperNodes (client/virtual.py)


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    hold_host_slot()  # several nodes on one host: at most K ClientApps load torch at once
    from quorumfl.client.compress import compressed_update
    from quorumfl.client.steps import (
        train_received,  # torch loads here, only for messages that train
    )

    try:
        local = train_received(msg, context)
    except PrivacyBudgetError as exc:  # the department's decision, said as an answer rather than a crash
        content = RecordDict({REFUSAL: ConfigRecord({"reason": str(exc)}),
                              NODE: secure.node_record(context, str(context.node_config.get("department", "")))})
        return Message(content=content, reply_to=msg)
    if SECAGG in msg.content.config_records:
        return Message(content=secure.masked_train_reply(msg, context, local), reply_to=msg)
    if local.config.dp == "distributed":  # fail closed: a noise share alone does not protect a plaintext update
        raise SecureAggregationError("dp 'distributed' needs a masked round; this request is not one, so the update "
                                     "is withheld")
    if CKKS in msg.content.config_records:
        return Message(content=ckks.encrypted_train_reply(msg, context, local), reply_to=msg)
    content = RecordDict(
        {
            METRICS: MetricRecord({k: v for k, v in local.metrics.items()}),
            NODE: secure.node_record(context, local.department),
        }
    )
    if local.config.compression != "none":  # the update, encoded with error feedback
        content[UPDATE], content[COMPRESSION] = compressed_update(context, local)
    else:
        content[ARRAYS] = to_array_record(local.trained)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    hold_host_slot()
    from quorumfl.client.steps import evaluate_received

    metrics, department = evaluate_received(msg, context)
    content = RecordDict({METRICS: MetricRecord(dict(metrics)), NODE: secure.node_record(context, department)})
    return Message(content=content, reply_to=msg)


@app.query("ifca_pick")
def ifca_pick(msg: Message, context: Context) -> Message:
    """IFCA under secure aggregation: which cluster model fits this node's data (the sums are per cluster)."""
    from quorumfl.client.steps import pick_received

    cluster, department = pick_received(msg, context)
    content = RecordDict({METRICS: MetricRecord({"cluster": cluster}), NODE: secure.node_record(context, department)})
    return Message(content=content, reply_to=msg)


@app.query("secagg_advertise")
def secagg_advertise(msg: Message, context: Context) -> Message:
    return Message(content=secure.advertise(msg, context), reply_to=msg)


@app.query("secagg_share")
def secagg_share(msg: Message, context: Context) -> Message:
    return Message(content=secure.share(msg, context), reply_to=msg)


@app.query("secagg_confirm")
def secagg_confirm(msg: Message, context: Context) -> Message:
    return Message(content=secure.confirm(msg, context), reply_to=msg)


@app.query("secagg_unmask")
def secagg_unmask(msg: Message, context: Context) -> Message:
    return Message(content=secure.unmask(msg, context), reply_to=msg)


@app.query("ckks_commit")
def ckks_commit(msg: Message, context: Context) -> Message:
    return Message(content=ckks.commit(msg, context), reply_to=msg)


@app.query("ckks_reveal")
def ckks_reveal(msg: Message, context: Context) -> Message:
    return Message(content=ckks.reveal(msg, context), reply_to=msg)


@app.query("ckks_finish")
def ckks_finish(msg: Message, context: Context) -> Message:
    return Message(content=ckks.finish(msg, context), reply_to=msg)


@app.query("ckks_decrypt")
def ckks_decrypt(msg: Message, context: Context) -> Message:
    return Message(content=ckks.decrypt(msg, context), reply_to=msg)
