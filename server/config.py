"""Run configuration: Flower run config / TOML → one frozen, validated ``RunConfig``.

Each run-config key is declared once, as a ``RunConfig`` field made by ``key(default, help, …)``
(``core/settings.py``): its
kebab-case name, type, default, range, meaning and where it applies. Everything else is derived from
those declarations: parsing with every problem reported at once (each naming the key and what to
write instead), ``DEFAULTS`` (the Flower app's ``[tool.flwr.app.config]``, written into every app
bundle and checked against the repository's ``pyproject.toml``), the run-config reference page's table
(``docs/reference/run-config.md``) and
the part of the node's train config that is a setting as is (``node=True``).
``python -m quorumfl.server.config --write`` rewrites that table and the ``pyproject.toml``
defaults from the declarations; the tests fail when either is out of date.

Rules across keys (``RunConfig.problems``) are written out after the declarations.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

from quorumfl.aggregation.ckks import MAX_DECRYPTIONS, CkksParams
from quorumfl.aggregation.monitor import RobustRule
from quorumfl.core.settings import Key, declared, defaults, key, markdown_table, read, setting
from quorumfl.core.tasks import OPTIMIZERS, get_task, training_defaults
from quorumfl.errors import ConfigError

__all__ = [
    "DEFAULTS",
    "Compression",
    "DpMode",
    "Key",
    "RunConfig",
    "SecureMode",
    "StartFrom",
    "StrategyName",
    "expand_auto_rounds",
    "key",
    "load_run_config_file",
    "read_config_toml",
    "run_config_table",
]


class StrategyName(StrEnum):
    FEDAVG = "fedavg"
    FEDPROX = "fedprox"
    IFCA = "ifca"  # clustered FL: K models, each node trains the one that fits its data best
    FEDPER = "fedper"  # personal layers stay on the nodes
    DITTO = "ditto"  # a personal model per node, regularised towards the global one
    SCAFFOLD = "scaffold"  # control variates correct each node's drift (Karimireddy et al., 2020)


class SecureMode(StrEnum):
    NONE = "none"  # plaintext updates (the server sees each department's update)
    MASKING = "masking"  # threshold secure aggregation by masking (quorumfl.aggregation.secagg)
    CKKS = "ckks"  # threshold homomorphic encryption: t-of-n CKKS decryption (quorumfl.aggregation.ckks)


class Compression(StrEnum):
    NONE = "none"
    TOPK = "topk"  # the largest entries (plaintext only: each node picks its own coordinates)
    SIGN = "sign"  # 1 bit per entry and a scale
    INT8 = "int8"  # 8-bit stochastic quantisation
    RANDK = "randk"  # the same random coordinates on every node (a per-round seed from the server)


class DpMode(StrEnum):
    NONE = "none"
    LOCAL = "local"  # DP-SGD (Opacus) on every node; each department's ledger enforces its ε budget
    DISTRIBUTED = "distributed"  # under masking: each node clips its update and adds a share of the noise


class StartFrom(StrEnum):
    HEAD = "head"  # the architecture's head model version (see 'quorumfl models rollback')
    FRESH = "fresh"  # new weights from the seed


def _qat_problems(config: RunConfig) -> list[str]:
    """What ``qat-rounds`` does not combine with (``quorumfl.client.node_round._qat_round``)."""
    if not config.qat_rounds:
        return []
    problems = []
    if config.qat_rounds >= config.num_rounds:
        problems.append(f"qat-rounds {config.qat_rounds} must be below num-rounds {config.num_rounds}: QAT fine-tunes "
                        "a model that the earlier rounds trained")
    if config.strategy not in (StrategyName.FEDAVG, StrategyName.FEDPROX):
        problems.append(f"qat-rounds trains one global model with strategy fedavg or fedprox, not "
                        f"{config.strategy.value}; set qat-rounds = 0 or change the strategy")
    if config.dp is not DpMode.NONE:
        problems.append("qat-rounds with dp is not supported (the QAT loop is not DP-SGD); set dp = 'none' or "
                        "qat-rounds = 0")
    if config.compression is not Compression.NONE:
        problems.append("qat-rounds with compression is not supported: the activation ranges must arrive whole; set "
                        "compression = 'none'")
    if config.secure_aggregation is not SecureMode.NONE and config.secagg_clip < 1.0:
        problems.append(f"qat-rounds needs secagg-clip >= 1 (activation ranges travel as values within ±1), got "
                        f"{config.secagg_clip}")
    return problems


def _epoch_list(value: str, problems: list[str]) -> tuple[int, ...]:
    value = value.replace(" ", "")
    if not value:
        return ()
    try:
        epochs = tuple(sorted({int(v) for v in value.split(",")}))
    except ValueError:
        epochs = ()
    if not epochs or epochs[0] < 1 or epochs[-1] > 1000:
        problems.append(f"selection-epochs must be local-epoch counts in 1..1000 separated by commas, such "
                        f"as '1,2,4'; got {value!r}")
        return ()
    return epochs


def _epoch_text(epochs: tuple[int, ...]) -> str:
    return ",".join(str(e) for e in epochs)


def _roster_problems(text: str) -> list[str]:
    """The roster is JSON {department: OpenSSH ECDSA public key}; its signature is the run's own."""
    from quorumfl.aggregation.secagg.identity import Roster
    from quorumfl.errors import SecureAggregationError

    try:
        Roster.from_json(text)
    except SecureAggregationError as exc:
        return [f"roster: {exc}; it is written by the admin's 'quorumfl runs start' from the registered node keys"]
    return []


USUAL_RATE = {"sgd": 0.05, "adam": 0.003}  # a named optimizer's rate where the run gives none
AUTO_ROUNDS, AUTO_PATIENCE = 50, 3  # num-rounds = "auto": at most this many rounds, stopping after this many flat ones


def expand_auto_rounds(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with ``num-rounds = "auto"`` written out as the two keys it means: ``AUTO_ROUNDS`` rounds
    at most and ``early-stop-patience`` (``AUTO_PATIENCE`` unless the config sets one), so that what is
    submitted and signed holds numbers a node can check."""
    if values.get("num-rounds") != "auto":
        return dict(values)
    return {**values, "num-rounds": AUTO_ROUNDS, "early-stop-patience": values.get("early-stop-patience") or AUTO_PATIENCE}


@dataclass(frozen=True)
class RunConfig:
    """One run's settings. Each field is a run-config key, declared here once (``key``)."""

    # ---- strategy
    strategy: StrategyName = key(
        StrategyName.FEDAVG, "`fedavg`, `fedprox`, `scaffold` (control variates), `ifca` (clustered), `fedper` or "
        "`ditto` (personalised); docs/explanation/strategies.md")
    proximal_mu: float = key(
        0.1, "FedProx μ: nodes minimise `loss + μ/2·‖w − w_global‖²` (ignored by `fedavg`; `ifca`, `fedper` and "
        "`ditto` use it too, 0 turns it off)", low=0.0,
        applies="fedprox, ifca, fedper, ditto")
    clusters: int = key(2, "IFCA: K cluster models", low=1, high=64, applies="ifca")
    ifca_merge_distance: float = key(
        0.01, "IFCA repair: a cluster within this relative L2 distance of a larger one, or with no nodes, is "
        "re-seeded as the largest cluster's model plus noise (`ifca-reseed-noise`)", low=0.0, applies="ifca")
    ifca_reseed_noise: float = key(
        0.1, "IFCA repair: the noise of a re-seeded cluster, in per-tensor standard deviations", low=0.0, applies="ifca")
    personal_layers: str = key(
        "head", "FedPer: layers that never leave the node — comma-separated prefixes of the model's array names "
        "(`7,9`), or `head` for the last layer", applies="fedper")
    ditto_lambda: float = key(0.1, "Ditto: λ of the personal model's pull `λ/2·‖v − w_global‖²`", low=0.0,
                              applies="ditto")
    server_momentum: float = key(
        0.5, "FedAvgM: the server's momentum β over rounds (`m ← β·m + Δ`, Δ = the round's mean minus the global "
        "model; the model moves by `server-lr·m`; 0 = plain averaging). Ignored by `ifca` and `scaffold` (cluster "
        "models, control variates). Restarts from 0 on a resume", low=0.0, high=0.99,
        applies="fedavg, fedprox, fedper, ditto")
    server_lr: float = key(1.0, "the server's step on the round's mean change (FedOpt's η; 1 with `server-momentum` "
                           "0 is plain averaging; ignored by `ifca` and `scaffold`)", low=0.0, open_low=True, high=10.0,
                           applies="fedavg, fedprox, fedper, ditto")
    robust_aggregation: RobustRule = key(
        RobustRule.NONE, "plaintext rounds: combine the updates by `norm-bound` (each change scaled to at most "
        "`norm-bound-factor` × the round's median), `trimmed-mean`, `median` or `krum` instead of the weighted mean "
        "(docs/how-to/monitor.md); the server then holds the round's updates in memory",
        applies="fedavg, fedprox, fedper, ditto")
    robust_fraction: float = key(0.2, "the share trimmed at each end (`trimmed-mean`) or assumed Byzantine (`krum`)",
                                 low=0.0, high=0.49, applies="trimmed-mean, krum")
    norm_bound_factor: float = key(2.0, "`norm-bound`: the largest change kept, as a multiple of the round's median "
                                   "change norm", low=1.0, applies="norm-bound")
    # ---- rounds and training
    num_rounds: int = key(5, "training rounds (the most, with `early-stop-patience`); `auto`: at most "
                          f"{AUTO_ROUNDS}, stopping after `early-stop-patience` rounds ({AUTO_PATIENCE} unless set) "
                          "without a better round metric", low=1, high=10_000, node=True)
    early_stop_patience: int = key(
        0, "stop after this many rounds without a better round metric (the server's held-out figure, or the "
        "departments' federated evaluation); the stop is recorded (docs/how-to/good-models.md); 0 = every round",
        low=0)
    task: str = key("image", "what is learned: `image`, `tabular`, `text`, your own task as `module:attribute`, or "
                    "a `quorumfl.tasks` entry point (docs/tutorials/your-data.md)")
    task_schema: str = key("", "the departments' shared schema (`quorumfl data schema`): its JSON, or a file on the "
                           "server (`runs start` sends a file's JSON); empty: the image task's built-in `dataset`")
    dataset: str = key("digits", "image task: `digits` (embedded) or `fashion-mnist` (IDX files; Debian "
                       "`dataset-fashion-mnist`) for the server's held-out evaluation")
    data_dir: str = key("", "the dataset's folder (empty: `/usr/share/datasets/fashion-mnist` for `fashion-mnist`)")
    model: str = key("mlp", "image: `mlp`, `mlp-tanh` (the same with tanh; the one to pick with `dp = \"local\"`), "
                     "`mlp-wide` (~1.1M params on 8×8), `cnn`, `cnn-wide`; tabular: `mlp`, `linear`; text: `fasttext`",
                     node=True)
    local_epochs: int = key(5, "local epochs per round", low=1, high=1000, node=True)
    batch_size: int = key(32, "local batch size", low=1, node=True)
    optimizer: str = key("auto", "local optimizer: `sgd` (momentum 0.9), `adam`, or `auto`: the task's (image `sgd`; "
                         "tabular and text `adam`)", choices=("auto", *OPTIMIZERS), node=True)
    learning_rate: float = key(0.0, "local learning rate; 0: the task's (image 0.05 with SGD; tabular 0.003 and text "
                               "0.01 with Adam), or 0.05 for `sgd` and 0.003 for `adam` named against the task's",
                               low=0.0, node=True)
    clip_norm: float = key(0.0, "per-step gradient clipping (0 = off)", low=0.0, node=True)
    warmup_steps: int = key(0, "linear learning-rate warm-up, in steps (0 = off)", low=0, node=True)
    lr_reference_batch: int = key(
        0, "linear scaling rule `lr × batch-size / lr-reference-batch` (0 = off)", low=0, node=True)
    finetune_epochs: int = key(
        5, "at the end of a run each department fine-tunes the federation's model on its own data for this many "
        "epochs and keeps it as its own (`tuned-<metric>`; 0 = off; docs/how-to/good-models.md)",
        low=0, high=1000, node=True)
    local_baseline: bool = key(
        True, "each department also trains a model on its own data alone (same architecture, epochs and examples; "
        "it never leaves the node) and reports its metric at the end, beside the federation's "
        "(docs/how-to/good-models.md)", node=True)
    fraction_train: float = key(1.0, "share of enabled nodes sampled per round", low=0.0, high=1.0, open_low=True)
    min_nodes: int = key(2, "fewest valid updates for a round to count", low=1)
    round_timeout: float = key(300.0, "seconds to wait for replies", low=0.0, open_low=True)
    node_wait_timeout: float = key(120.0, "seconds to wait for enough nodes to connect", low=0.0, open_low=True)
    train_retries: int = key(
        1, "times a node whose ClientApp crashed mid-training (Flower error 8) is asked again within the round's "
        "deadline (plaintext, masked and CKKS rounds); it resumes from its checkpoint", low=0, high=10)
    seed: int = key(0, "seed of the initial weights, sampling and the nodes' plaintext training; `runs start` draws a "
                    "new one when the run config does not set it (shown in its first line)", low=0, node=True)
    qat_rounds: int = key(
        0, "federated quantisation-aware training: the last R rounds fine-tune with fake quantisation on every "
        "department, and the ranges their observers saw are averaged with the model, so `models promote --edge` "
        "calibrates the INT8 artifact on the departments' own data (docs/how-to/edge-devices.md); fedavg or fedprox (μ "
        "does not apply in these rounds), no dp, no compression", low=0, high=10_000)
    # ---- client selection
    selector: str = key(
        "random", "who trains each round: `random` (seeded uniform), `oort` (Oort's utility heuristic) or `rl` (a "
        "learned policy with an Oort fallback); see Client selection", choices=("random", "oort", "rl"))
    selection_epochs: tuple[int, ...] = key(
        (), "the local epochs the agent may give a node, e.g. `\"1,2,4\"` (must include `local-epochs`); empty = "
        "`local-epochs` only", applies="rl", parse=_epoch_list, show=_epoch_text)
    selection_key: str = key(
        "", "where the selector's learned state is kept in the state DB (default `SELECTOR:DATASET:MODEL`); a new "
        "run under the same key continues from it")
    round_deadline: float = key(
        0.0, "seconds the train stage waits (0 = `round-timeout`); a node that misses it is recorded late (stage "
        "`deadline`) and, under masking, is a dropout", low=0.0)
    over_selection: float = key(
        0.0, "β: ask K·(1+β) nodes and aggregate the first K replies; the rest are recorded late (stage `late`)",
        low=0.0, high=10.0)
    # ---- state
    start_from: StartFrom = key(
        StartFrom.HEAD, "`head`: continue from the architecture's head model version; `fresh`: new weights from `seed`")
    state_url: str = key("", "the state DB URL (default: `$QUORUMFL_DB_URL` or `~/.quorumfl/quorumfl.db`)")
    model_dir: str = key("", "the model folder (default: `$QUORUMFL_MODEL_DIR` or `~/.quorumfl/models`)")
    tensorboard_dir: str = key(
        "", "write the run report's series as TensorBoard scalars under this folder, one `run-ID` folder per run "
        "(empty = off); see Watching a federation")
    resume_run: int = key(0, "set by `quorumfl runs resume`: the stopped run this one continues", low=0)
    max_reply_mb: float = key(1024.0, "largest reply the server accepts from one node, in MB (0 = no limit)",
                              low=0.0)
    # ---- secure aggregation
    secure_aggregation: SecureMode = key(
        SecureMode.MASKING, "`masking` (the default): the server learns only the sum of a quorum's updates; `ckks`: "
        "it adds ciphertexts and any t key holders decrypt the sum (docs/explanation/secure-aggregation.md, threshold-ckks.md); `none`: plaintext, the server sees "
        "each department's update")
    secagg_threshold: float = key(
        0.6, "t: a fraction in (0.5, 1) of the round's (masking) or the ceremony's (ckks) nodes, or a whole number "
        "of nodes (a majority, ≥ 2)", low=0.5, open_low=True, applies="masking, ckks")
    secagg_epoch_rounds: int = key(10, "rounds served by one key set-up (each round uses its own pre-shared keys; "
                                   "fewer when the run has fewer rounds left)",
                                   low=1, high=10_000, applies="masking")
    secagg_clip: float = key(8.0, "fixed-point encoding: updates clipped to ±clip", low=0.0, open_low=True,
                             applies="masking, ckks")
    update_norm_bound: float = key(
        0.0, "masking and ckks: each node scales its update down to this L2 norm before encoding (0 = off); the "
        "round's norm histogram still counts the norm it had (docs/how-to/monitor.md)", low=0.0, node=True,
        applies="masking, ckks")
    secagg_max_weight: float = key(
        10000.0, "the example count a node claims is capped at this in every mode (plaintext too), so no node "
        "outweighs the others by its word alone", low=0.0, open_low=True)
    secagg_modulus_bits: int = key(32, "masked sums are taken mod 2^32 or 2^64", low=32, high=64, applies="masking")
    secagg_min_group: int = key(
        0, "fewest nodes whose sum is revealed (0 = the threshold t); with IFCA each cluster is a group, and a "
        "smaller cluster sits the round out. Under ckks the nodes read it from the signed run config and refuse "
        "to decrypt a smaller sum", low=0, high=10_000, applies="masking, ckks")
    secagg_colluding_fraction: float = key(
        0.2, "cohorts over 100: the colluders the sparse graph must withstand; its degree and local threshold "
        "follow (exposure ≤ 2⁻⁴⁰), or the complete graph where no sparse one does", low=0.0, high=0.49,
        applies="masking")
    secagg_dropout_fraction: float = key(0.1, "cohorts over 100: the dropouts the sparse graph must withstand",
                                         low=0.0, high=0.49, applies="masking")
    secagg_stage_timeout: float = key(120.0, "deadline of each key/unmask/ceremony/decrypt stage, in seconds",
                                      low=0.0, open_low=True, applies="masking, ckks")
    secagg_unmask_spare: int = key(1, "survivors asked to unmask beyond t before asking the rest", low=0,
                                   high=10_000, applies="masking")
    roster: str = key(
        "", "the admin's roster of departments (JSON name → node public key); `quorumfl runs start` fills it from "
        "`HOME/certs/nodes` and signs it with the run; nodes check peers' keys against it")
    run_nonce: str = key(
        "", "set by the admin's signature (`runs start`, `certs sign-app`): this signed run's nonce; each node serves "
        "one Flower run per nonce and refuses the same signed run sent again (docs/explanation/security.md)")
    run_expires: int = key(
        0, "set by the admin's signature: Unix time after which nodes that have not served this run refuse it "
        "(signed runs are valid for 6 hours)", low=0)
    roster_version: int = key(
        0, "set by the admin's signature: the version of the roster it carries (grows with every node key added or "
        "retired); nodes refuse a run whose roster is older than one they have seen", low=0)
    node_state_key: str = key("", "set by `quorumfl runs resume`: the Flower run id whose node state (personal "
                              "layers, residuals) the nodes continue from")
    ckks_poly_degree: int = key(
        8192, "CKKS ring dimension N (8192, 16384, 32768); N values per ciphertext (two per complex slot). "
        "`secagg-clip` and `secagg-max-weight` apply to ckks too", low=8192, high=32768, applies="ckks")
    ckks_min_threshold: int = key(
        0, "the smallest t a node accepts for a key ceremony (0 = `secagg-threshold` over the roster's departments): a "
        "ceremony of fewer members keeps that t, so leaving departments out of it does not let fewer colluders "
        "decrypt", low=0, high=10_000, applies="ckks")
    ckks_max_decryptions: int = key(
        MAX_DECRYPTIONS, "partial decryptions each key share answers (its holders refuse more); the server runs a "
        "new key ceremony first. Each published decryption leaks at most 2^−κ of the key, so the cap bounds the "
        "total", low=1, high=1_000_000, applies="ckks")
    # ---- compression
    compression: Compression = key(
        Compression.NONE, "the update a node sends: `topk`, `sign`, `int8`, `randk` (docs/explanation/compression.md); `randk` composes "
        "with masking", node=True)
    compression_fraction: float = key(0.01, "top-k / random-k share of entries", low=0.0, high=1.0,
                                      open_low=True, applies="topk, randk", node=True)
    compression_sync_every: int = key(0, "every M-th round a full-precision sync (0 = never)", low=0,
                                      applies="compression")
    compression_warmup_rounds: int = key(
        0, "rounds 1…W keep 25 %, 6.25 %, … (never below `compression-fraction`) before settling at it (Deep "
        "Gradient Compression's warm-up)", low=0, applies="topk")
    # ---- differential privacy
    dp: DpMode = key(
        DpMode.NONE, "`local`: DP-SGD on every node, each round charged to the department's ε ledger; "
        "`distributed`: under masking each node adds a share of the noise (docs/explanation/differential-privacy.md)", node=True)
    dp_epsilon: float = key(3.0, "DP target ε of the whole run per department (exactly one of this and "
                            "`dp-noise-multiplier` > 0)", low=0.0, applies="dp", node=True)
    dp_noise_multiplier: float = key(0.0, "a fixed noise multiplier σ instead of a target ε", low=0.0,
                                     applies="dp")
    dp_clip: float = key(1.0, "per-example gradient norm bound C", low=0.0, open_low=True, applies="dp", node=True)
    dp_delta: float = key(1e-5, "δ of the accounting", low=0.0, high=0.1, open_low=True, applies="dp", node=True)

    @classmethod
    def declared(cls) -> dict[str, tuple[str, Any, Key]]:
        """Every run-config key: its kebab-case name → (field name, field type, declaration)."""
        return declared(cls)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key's default as a run-config value (what Flower's app config holds)."""
        return defaults(cls)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        values = expand_auto_rounds(values)
        problems: list[str] = []
        declared = cls.declared()
        for name in sorted(set(values) - set(declared)):
            close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "docs/reference/run-config.md lists every key"
            problems.append(f"unknown key '{name}': {hint}")
        settings = {name: read(name, kind, spec, values[name], problems) if name in values else spec.default
                    for name, (_, kind, spec) in declared.items()}
        config = cls(**{declared[name][0]: value for name, value in settings.items()})
        problems.extend(config.problems())
        if problems:
            raise ConfigError(problems)
        return config

    def problems(self) -> list[str]:
        """What is wrong across keys (each key's own type and range are checked by ``from_mapping``)."""
        from quorumfl.core.data.datasets import DATASETS

        problems: list[str] = []
        config = self
        if config.dataset not in DATASETS:
            problems.append(f"dataset must be one of {sorted(DATASETS)}, got {config.dataset!r}")
        problems.extend(_task_problems(config))
        if config.roster:
            problems.extend(_roster_problems(config.roster))
        if config.node_state_key and not (config.node_state_key.isdigit() and len(config.node_state_key) <= 20):
            problems.append(f"node-state-key must be a Flower run id (digits), got {config.node_state_key!r}")
        if config.selection_epochs and config.local_epochs not in config.selection_epochs:
            problems.append(f"selection-epochs {list(config.selection_epochs)} must include local-epochs "
                            f"{config.local_epochs} (what the heuristic fallback gives)")
        if config.selection_epochs and config.selector != "rl":
            problems.append("selection-epochs is the RL selector's set of local-epoch choices; set selector = 'rl' "
                            "or leave selection-epochs empty")
        if config.round_deadline > config.round_timeout:
            problems.append(f"round-deadline {config.round_deadline} is longer than round-timeout "
                            f"{config.round_timeout}; lower it or raise round-timeout")
        if config.secagg_modulus_bits not in (32, 64):
            problems.append(f"secagg-modulus-bits must be 32 or 64, got {config.secagg_modulus_bits}")
        if 1 < config.secagg_threshold and not float(config.secagg_threshold).is_integer():
            problems.append(
                f"secagg-threshold must be a fraction in (0.5, 1) or a whole number of nodes, got {config.secagg_threshold}"
            )
        if config.ckks_poly_degree not in (8192, 16384, 32768):
            problems.append(f"ckks-poly-degree must be 8192, 16384 or 32768, got {config.ckks_poly_degree}")
        if config.secagg_threshold == 1.0:
            problems.append("secagg-threshold 1 is not a majority; write a fraction in (0.5, 1) or a node count >= 2")
        if config.strategy is StrategyName.FEDPER and not config.personal_layers.strip():
            problems.append("strategy fedper needs personal-layers: layer prefixes such as '7,9', or 'head'")
        if config.secagg_min_group == 1:
            problems.append("secagg-min-group 1 would reveal single updates; write 0 (= the threshold) or >= 2")
        if config.secure_aggregation is SecureMode.MASKING and config.compression not in (Compression.NONE,
                                                                                          Compression.RANDK):
            problems.append(f"compression {config.compression.value} with secure-aggregation masking is not possible: "
                            "the server only sees the sum, so every node must send the same coordinates; use "
                            "compression = 'randk' (or 'none'), or secure-aggregation = 'none' for plaintext updates")
        if config.secure_aggregation is SecureMode.CKKS and config.compression is not Compression.NONE:
            problems.append(f"compression {config.compression.value} with secure-aggregation ckks is not supported "
                            "yet; use compression = 'none', or secure-aggregation = 'masking'")
        if config.dp is not DpMode.NONE and (config.dp_epsilon > 0) == (config.dp_noise_multiplier > 0):
            problems.append(f"dp '{config.dp.value}' needs exactly one of dp-epsilon (the run's target) and "
                            "dp-noise-multiplier; set the other to 0")
        if config.dp is DpMode.DISTRIBUTED and config.secure_aggregation is not SecureMode.MASKING:
            problems.append("dp 'distributed' adds each node's share of the noise, which only protects an update "
                            "inside a masked sum; set secure-aggregation = 'masking' (or use dp = 'local')")
        if config.compression_warmup_rounds and config.compression is not Compression.TOPK:
            problems.append(f"compression-warmup-rounds applies to compression = 'topk' only (got "
                            f"'{config.compression.value}'); set it to 0")
        if config.strategy is StrategyName.SCAFFOLD and config.dp is DpMode.LOCAL:
            problems.append("strategy scaffold with dp 'local' is not supported: DP-SGD clips per example, the control "
                            "variates' correction is per step; use dp = 'none' or 'distributed'")
        if config.strategy is StrategyName.SCAFFOLD and config.compression is not Compression.NONE:
            problems.append("strategy scaffold with compression is not supported yet: the control variates must arrive "
                            "whole; set compression = 'none'")
        if config.dp is DpMode.DISTRIBUTED and config.compression is not Compression.NONE:
            problems.append("dp 'distributed' with compression is not supported; set compression = 'none'")
        problems.extend(_qat_problems(config))
        if config.secure_aggregation is not SecureMode.NONE and config.min_nodes < 2:
            problems.append(f"secure-aggregation {config.secure_aggregation.value} reveals only a sum of two or more "
                            f"departments, so min-nodes must be >= 2 (got {config.min_nodes}); raise min-nodes, or set "
                            "secure-aggregation = 'none' for plaintext updates")
        if config.robust_aggregation is not RobustRule.NONE and (
                config.secure_aggregation is not SecureMode.NONE
                or config.strategy in (StrategyName.IFCA, StrategyName.SCAFFOLD)):
            problems.append(f"robust-aggregation {config.robust_aggregation.value} needs every update in plaintext and "
                            "one global model; it does not combine with secure aggregation, ifca or scaffold, so set "
                            "robust-aggregation = 'none' (or secure-aggregation = 'none': the server then sees each "
                            "department's update)")
        return problems

    def resolved(self) -> dict[str, Any]:
        """Kebab-case mapping of every setting, as stored with the run."""
        return {name: setting(spec, getattr(self, attr)) for name, (attr, _, spec) in self.declared().items()}

    def node_settings(self) -> dict[str, Any]:
        """The settings the node's train config carries (declared ``node=True``), by field name, with
        ``optimizer = "auto"`` and ``learning-rate = 0`` resolved to the task's (``training_defaults``)."""
        settings = {attr: setting(spec, getattr(self, attr)) for attr, _, spec in self.declared().values() if spec.node}
        settings["optimizer"], settings["learning_rate"] = self.training()
        return settings

    def server_step(self) -> tuple[float, float]:
        """The server's momentum and step size over rounds: the run's, or plain averaging (0, 1) for the
        strategies they do not apply to (IFCA's cluster models, SCAFFOLD's control variates)."""
        if self.strategy in (StrategyName.IFCA, StrategyName.SCAFFOLD):
            return 0.0, 1.0
        return self.server_momentum, self.server_lr

    def training(self) -> tuple[str, float]:
        """The local optimizer and learning rate: those the run names, else the task's; a run that names
        another optimizer than the task's and no rate gets that optimizer's usual one."""
        optimizer, rate = training_defaults(get_task(self.task))
        if self.optimizer not in ("auto", optimizer):
            optimizer, rate = self.optimizer, USUAL_RATE[self.optimizer]
        return optimizer, self.learning_rate or rate

    def ckks_params(self) -> CkksParams:
        """The threshold-CKKS parameter set: N from the config, a (60, 60, 60)-bit chain, Δ = 2^100."""
        return CkksParams(poly_degree=self.ckks_poly_degree)

    def epoch_choices(self) -> tuple[int, ...]:
        """The local epochs a selector may give a node: ``selection-epochs``, or just ``local-epochs``."""
        return self.selection_epochs or (self.local_epochs,)

    def resolved_selection_key(self) -> str:
        """Where the selector's state is kept: ``selection-key``, or selector, dataset and model, so a
        restarted server (a new run of the same federation) continues with what was learned."""
        data = self.dataset if self.task == "image" else self.task
        return self.selection_key or f"{self.selector}:{data}:{self.model}"

    def train_deadline(self) -> float:
        """How long the train stage waits for replies: ``round-deadline`` if set, else ``round-timeout``."""
        return self.round_deadline or self.round_timeout

    def data_path(self) -> Path | None:
        return Path(self.data_dir).expanduser() if self.data_dir else None

    def resolved_state_url(self) -> str:
        from quorumfl.server.state.database import default_url

        return self.state_url or default_url()

    def resolved_model_dir(self) -> Path:
        from quorumfl.core.files import default_home

        if self.model_dir:
            return Path(self.model_dir).expanduser()
        return Path(os.environ.get("QUORUMFL_MODEL_DIR") or default_home() / "models")


DEFAULTS: dict[str, Any] = RunConfig.defaults()


TABLE_START = "<!-- run-config table: generated from server/config.py by `python -m quorumfl.server.config --write` -->\n"
TABLE_END = "<!-- end of the run-config table -->\n"
APP_CONFIG = re.compile(r"(?ms)^\[tool\.flwr\.app\.config\]\n.*?\n(?=\[)")


def run_config_table(config: type[RunConfig] = RunConfig) -> str:
    """The run-config reference table, one row per declared key."""
    return markdown_table(config.declared())


def derived_files(root: Path, config: type[RunConfig] = RunConfig) -> dict[Path, str]:
    """The run-config reference page and ``pyproject.toml`` under ``root`` as the declarations say they
    should read."""
    import tomli_w

    readme, pyproject = root / "docs" / "reference" / "run-config.md", root / "pyproject.toml"
    text = readme.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    new_readme = text[:start] + run_config_table(config) + text[end:]
    table = tomli_w.dumps({"tool": {"flwr": {"app": {"config": config.defaults()}}}}).split("\n", 1)[1]
    new_pyproject = APP_CONFIG.sub(lambda _: "[tool.flwr.app.config]\n" + table.lstrip("\n") + "\n",
                                   pyproject.read_text(), count=1)
    return {readme: new_readme, pyproject: new_pyproject}


MAX_CONFIG_BYTES = 2**20


def _task_problems(config: RunConfig) -> list[str]:
    """The task exists here, the model is one of its models, and a non-image task has its schema file."""
    from quorumfl.core.tasks import get_task

    try:
        task = get_task(config.task)
    except ConfigError as exc:
        return exc.problems
    problems: list[str] = []
    if config.model not in task.model_names():
        problems.append(f"model must be one of {list(task.model_names())} for task '{task.name}', got {config.model!r}")
    if task.name != "image" and not config.task_schema:
        problems.append(f"task '{task.name}' needs task-schema: the departments' shared schema file (make one with "
                        "'quorumfl data schema FILE --task …')")
    inline = config.task_schema.lstrip().startswith("{")
    if config.task_schema and not inline and not Path(config.task_schema).expanduser().is_file():
        problems.append(f"task-schema {config.task_schema!r} is not a file on the server; give the schema's path")
    return problems


def load_run_config_file(path: Path) -> dict[str, Any]:
    """Read a run-config TOML file (UTF-8, at most 1 MiB): run keys at top level or under ``[run]``."""
    data = read_config_toml(path)
    values = data.get("run", data)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [run] must be a table of run-config keys")
    RunConfig.from_mapping(values)  # report every problem before anything is submitted
    return expand_auto_rounds(values)


def read_config_toml(path: Path) -> dict[str, Any]:
    """A config TOML file's tables (UTF-8, at most 1 MiB), each problem one line naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"run config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"run config file {path} cannot be read: {exc.strerror}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"run config file {path} is over {MAX_CONFIG_BYTES // 2**20} MiB; a run config is a few lines")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    return data


if __name__ == "__main__":  # python -m quorumfl.server.config --write (from the repository root)
    if sys.argv[1:] != ["--write"]:
        print("usage: python -m quorumfl.server.config --write  (run in the repository root)", file=sys.stderr)
        sys.exit(64)
    for path, text in derived_files(Path.cwd()).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"rewrote {path}")
