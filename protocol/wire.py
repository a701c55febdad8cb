"""The message contract between the QuorumFL ServerApp and ClientApp (Flower records).

Train request: ``arrays`` (ArrayRecord, global model), ``config`` (ConfigRecord, see ``TrainConfig``).
Train reply:   ``arrays`` (updated model), ``metrics`` (MetricRecord: ``num-examples``, ``train-loss``,
               ``global-<primary>``/``global-loss`` of the received model on the department's own test
               split, ``local-<primary>`` after training, ``train-seconds``), ``node`` (ConfigRecord:
               ``department``). ``<primary>`` is the task's primary metric (``accuracy``, ``mae`` …).
Evaluate request/reply: same ``arrays``/``config``; reply ``metrics`` with the task's metrics
               (``<primary>``, ``loss`` …), ``num-examples``, and ``node``.
Clustered (IFCA) requests carry the K cluster models as ``cluster-0`` … ``cluster-{K-1}`` instead of
``arrays``; the reply's metrics add ``cluster``. Personalised runs (FedPer) carry only the shared
layers; the personal ones stay on the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from numpy.typing import NDArray

from quorumfl.aggregation.compression import Encoded, Scheme, decode_arrays
from quorumfl.errors import ConfigError

__all__ = [
    "ARRAYS", "COMPRESSION", "CONFIG", "METRICS", "NODE", "REFUSAL", "ROSTER_KEY", "UPDATE", "TrainConfig", "decode_update", "encode_update", "candidate_models", "cluster_key", "department_of",
    "CLEAR_METRICS", "array_bytes", "clear_metrics",
    "from_array_record", "to_array_record",
]

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NODE = "node"
ROSTER_KEY = "roster"  # run-config key: the admin's roster of departments, JSON {name: OpenSSH public key}


@dataclass(frozen=True)
class TrainConfig:
    """What the server tells a node for one round."""

    server_round: int
    model: str
    local_epochs: int
    batch_size: int
    learning_rate: float
    proximal_mu: float
    seed: int
    personalisation: str = "none"  # none | fedper | ditto | scaffold (the node keeps its control variate)
    personal_layers: str = ""  # FedPer: comma-separated layer prefixes, or "head"
    ditto_lambda: float = 0.0  # Ditto: pull of the personal model towards the global one
    clip_norm: float = 0.0  # per-step gradient clipping (0 = off)
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_reference_batch: int = 0  # linear scaling rule: lr × batch-size / this (0 = off)
    compression: str = "none"  # none | topk | sign | int8 | randk (quorumfl.aggregation.compression)
    compression_fraction: float = 0.01  # top-k / random-k: the fraction of entries sent
    compression_seed: int = 0  # random-k: this round's coordinates, the same on every node
    compression_full: bool = False  # the periodic full-precision sync: send update + residual as is
    dp: str = "none"  # none | local (DP-SGD on the node) | distributed (noise shares under masking)
    dp_epsilon: float = 0.0  # target ε of the whole run per department (0: use dp_noise_multiplier)
    dp_noise_multiplier: float = 0.0
    dp_clip: float = 1.0  # per-example gradient norm bound C
    dp_delta: float = 1e-5
    num_rounds: int = 1  # the run's length: the noise for a target ε is spread over all its rounds
    dp_noise_share: int = 0  # distributed DP: the node adds N(0, σ²C²/this); the server sends the threshold t
    task: str = "image"  # what is learned (quorumfl.core.tasks): built-in name, module:attribute or entry point
    schema: str = ""  # the run's schema (JSON) every department's data must fit; "" = the node's image dataset's
    update_norm_bound: float = 0.0  # secure rounds: the node scales its update down to this L2 norm (0 = off)
    qat: bool = False  # a federated QAT round (run config qat-rounds): fine-tune with fake quantisation
    local_baseline: bool = False  # the node also trains its department-alone model (client.alone)
    optimizer: str = "sgd"  # the local optimizer: sgd (momentum 0.9) or adam
    finetune_epochs: int = 0  # final evaluation: fine-tune the federation's model on the node's data (client.tuned)

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "server-round": self.server_round,
                "model": self.model,
                "local-epochs": self.local_epochs,
                "batch-size": self.batch_size,
                "learning-rate": self.learning_rate,
                "proximal-mu": self.proximal_mu,
                "seed": self.seed,
                "personalisation": self.personalisation,
                "personal-layers": self.personal_layers,
                "ditto-lambda": self.ditto_lambda,
                "clip-norm": self.clip_norm,
                "warmup-steps": self.warmup_steps,
                "lr-reference-batch": self.lr_reference_batch,
                "compression": self.compression,
                "compression-fraction": self.compression_fraction,
                "compression-seed": self.compression_seed,
                "compression-full": self.compression_full,
                "dp": self.dp,
                "dp-epsilon": self.dp_epsilon,
                "dp-noise-multiplier": self.dp_noise_multiplier,
                "dp-clip": self.dp_clip,
                "dp-delta": self.dp_delta,
                "num-rounds": self.num_rounds,
                "dp-noise-share": self.dp_noise_share,
                "task": self.task,
                "schema": self.schema,
                "update-norm-bound": self.update_norm_bound,
                "qat": self.qat,
                "local-baseline": self.local_baseline,
                "optimizer": self.optimizer,
                "finetune-epochs": self.finetune_epochs,
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> TrainConfig:
        def get(key: str, kind: type, default: object = None) -> Any:
            if key not in record:
                if default is not None:  # keys added later: an older server's request still trains
                    return default
                raise ConfigError(f"train config is missing '{key}'")
            value = record[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"train config '{key}' must be {kind.__name__}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"train config '{key}' must be a finite number, got {value!r}")
            return value

        return cls(
            server_round=get("server-round", int),
            model=get("model", str),
            local_epochs=get("local-epochs", int),
            batch_size=get("batch-size", int),
            learning_rate=get("learning-rate", float),
            proximal_mu=get("proximal-mu", float),
            seed=get("seed", int),
            personalisation=get("personalisation", str),
            personal_layers=get("personal-layers", str),
            ditto_lambda=get("ditto-lambda", float),
            clip_norm=get("clip-norm", float, 0.0),
            warmup_steps=get("warmup-steps", int, 0),
            lr_reference_batch=get("lr-reference-batch", int, 0),
            compression=get("compression", str, "none"),
            compression_fraction=get("compression-fraction", float, 0.01),
            compression_seed=get("compression-seed", int, 0),
            compression_full=get("compression-full", bool, False),
            dp=get("dp", str, "none"),
            dp_epsilon=get("dp-epsilon", float, 0.0),
            dp_noise_multiplier=get("dp-noise-multiplier", float, 0.0),
            dp_clip=get("dp-clip", float, 1.0),
            dp_delta=get("dp-delta", float, 1e-5),
            num_rounds=get("num-rounds", int, 1),
            dp_noise_share=get("dp-noise-share", int, 0),
            task=get("task", str, "image"),
            schema=get("schema", str, ""),
            update_norm_bound=get("update-norm-bound", float, 0.0),
            qat=get("qat", bool, False),
            local_baseline=get("local-baseline", bool, False),
            optimizer=get("optimizer", str, "sgd"),
            finetune_epochs=get("finetune-epochs", int, 0),
        )


UPDATE = "update"  # a compressed update (instead of ``arrays``)
REFUSAL = "refusal"  # a node that will not train this round says why (``reason``), e.g. its ε budget
COMPRESSION = "compression"


def encode_update(encoded: dict[str, Encoded], config: TrainConfig) -> tuple[ArrayRecord, ConfigRecord]:
    """A compressed update on the wire: each part (``gap``, ``val``, ``bits``, ``q``, ``scale``) of all
    arrays concatenated into one Array (Flower adds a ~128-byte header per Array), with the array names
    and the part lengths in the config record."""
    names = sorted(encoded)
    schemes = {encoded[n].scheme.value for n in names}
    if len(schemes) != 1:
        raise ConfigError(f"one update mixes compression schemes {sorted(schemes)}")
    parts = sorted(encoded[names[0]].parts)
    record = ArrayRecord({part: Array(np.ascontiguousarray(np.concatenate([encoded[n].parts[part] for n in names])))
                          for part in parts})
    layout: dict[str, Any] = {"scheme": schemes.pop(), "fraction": config.compression_fraction,
                              "seed": config.compression_seed, "names": names}
    for part in parts:
        layout[f"{part}-lengths"] = [int(encoded[n].parts[part].size) for n in names]
    return record, ConfigRecord(layout)


def decode_update(record: ArrayRecord, config: ConfigRecord, shapes: dict[str, tuple[int, ...]]
                  ) -> dict[str, NDArray[np.float32]]:
    """The update a compressed reply stands for, array by array (``shapes`` from the model sent)."""
    try:
        scheme = Scheme(str(config["scheme"]))
        fraction, seed = float(config["fraction"]), int(config["seed"])  # type: ignore[arg-type]
        names = [str(n) for n in config["names"]]  # type: ignore[union-attr]
        split: dict[str, list[NDArray[np.generic]]] = {}
        for part, value in record.items():
            lengths = [int(v) for v in config[f"{part}-lengths"]]  # type: ignore[union-attr]
            flat = value.numpy()
            if len(lengths) != len(names) or sum(lengths) != flat.size or min(lengths, default=0) < 0:
                raise ValueError(f"part '{part}' does not match its lengths")
            split[part] = np.split(flat, np.cumsum(lengths)[:-1])
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"compressed reply has a bad layout ({exc})") from exc
    if sorted(names) != sorted(shapes) or len(set(names)) != len(names):
        raise ConfigError(f"compressed update names {sorted(set(names) ^ set(shapes))} do not match the model")
    encoded = {n: Encoded(scheme, shapes[n], {part: split[part][i] for part in split}) for i, n in enumerate(names)}
    decoded: dict[str, NDArray[np.float32]] = decode_arrays(encoded, fraction=fraction, seed=seed)
    return decoded


def cluster_key(k: int) -> str:
    return f"cluster-{k}"


def candidate_models(content: RecordDict) -> list[dict[str, NDArray[np.generic]]]:
    """The model(s) a request carries: one global model, or the K cluster models in order."""
    if ARRAYS in content.array_records:
        return [from_array_record(content.array_records[ARRAYS])]
    models: list[dict[str, NDArray[np.generic]]] = []
    while cluster_key(len(models)) in content.array_records:
        models.append(from_array_record(content.array_records[cluster_key(len(models))]))
    if not models:
        raise ConfigError("the request carries no model ('arrays' or 'cluster-0')")
    return models


def to_array_record(arrays: dict[str, NDArray[np.generic]]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def from_array_record(record: ArrayRecord) -> dict[str, NDArray[np.generic]]:
    return {k: v.numpy() for k, v in record.items()}


# What a secure round's reply says in plaintext besides its encoded update: the node's training time
# and, in DP runs, its department's ε spent and budget (its ledger's totals, not a property of the data).
CLEAR_METRICS = ("train-seconds", "dp-epsilon", "dp-budget")


def clear_metrics(metrics: dict[str, float]) -> dict[str, int | float | list[int] | list[float]]:
    """The part of a secure round's node metrics that travels in plaintext (``CLEAR_METRICS``), as a
    ``MetricRecord`` takes it."""
    return {k: float(metrics[k]) for k in CLEAR_METRICS if k in metrics}


def array_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries (every array record's data; config records not counted):
    the report's uplink and downlink figures."""
    return sum(len(a.data) for record in content.array_records.values() for a in record.values())


def department_of(content: RecordDict) -> str | None:
    """The department name a node put in its reply's ``node`` record, if any."""
    if NODE not in content.config_records:
        return None
    value = content.config_records[NODE].get("department")
    return value if isinstance(value, str) and value else None
