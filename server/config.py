"""Run configuration: Flower run config / TOML → one frozen, validated ``RunConfig``.

Every problem is collected and reported at once, each naming the key and what to write instead.
Keys are Flower's kebab-case run-config keys; defaults live in ``DEFAULTS`` (mirrored in the
``[tool.flwr.app.config]`` table of ``pyproject.toml`` so plain ``flwr run`` gets the same run).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from quorumfl.aggregation.ckks import MAX_DECRYPTIONS, CkksParams
from quorumfl.errors import ConfigError

__all__ = ["DEFAULTS", "Compression", "DpMode", "RunConfig", "SecureMode", "StartFrom", "StrategyName", "load_run_config_file"]


class StrategyName(StrEnum):
    FEDAVG = "fedavg"
    FEDPROX = "fedprox"
    IFCA = "ifca"  # clustered FL: K models, each node trains the one that fits its data best
    FEDPER = "fedper"  # personal layers stay on the nodes
    DITTO = "ditto"  # a personal model per node, regularised towards the global one


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


SELECTORS = ("random", "oort", "rl")  # quorumfl.server.selection.build_selector's names


class StartFrom(StrEnum):
    HEAD = "head"  # the architecture's head model version (see 'quorumfl models rollback')
    FRESH = "fresh"  # new weights from the seed


DEFAULTS: dict[str, Any] = {
    "strategy": "fedprox",
    "proximal-mu": 0.1,
    "num-rounds": 5,
    "dataset": "digits",
    "data-dir": "",
    "model": "mlp",
    "local-epochs": 5,
    "batch-size": 32,
    "learning-rate": 0.05,
    "fraction-train": 1.0,
    "min-nodes": 2,
    "round-timeout": 300.0,
    "train-retries": 1,
    "node-wait-timeout": 120.0,
    "seed": 0,
    "state-url": "",
    "model-dir": "",
    "start-from": "head",
    "secure-aggregation": "none",
    "secagg-threshold": 0.6,
    "secagg-clip": 8.0,
    "secagg-max-weight": 10000.0,
    "secagg-modulus-bits": 32,
    "secagg-epoch-rounds": 10,
    "secagg-stage-timeout": 120.0,
    "secagg-unmask-spare": 1,
    "ckks-poly-degree": 8192,
    "ckks-max-decryptions": MAX_DECRYPTIONS,  # partial decryptions one key answers; then a new ceremony
    "clusters": 2,
    "ifca-merge-distance": 0.01,
    "ifca-reseed-noise": 0.1,
    "personal-layers": "head",
    "ditto-lambda": 0.1,
    "secagg-min-group": 0,
    "secagg-colluding-fraction": 0.2,
    "secagg-dropout-fraction": 0.1,
    "clip-norm": 0.0,
    "warmup-steps": 0,
    "lr-reference-batch": 0,
    "compression": "none",
    "compression-fraction": 0.01,
    "compression-sync-every": 0,
    "compression-warmup-rounds": 0,
    "dp": "none",
    "dp-epsilon": 3.0,
    "dp-noise-multiplier": 0.0,
    "dp-clip": 1.0,
    "dp-delta": 1e-5,
    "selector": "random",
    "selection-epochs": "",
    "selection-key": "",
    "round-deadline": 0.0,
    "over-selection": 0.0,
    "max-reply-mb": 1024.0,
    "resume-run": 0,
    "node-state-key": "",
    "roster": "",
}


def _roster_problems(text: str) -> list[str]:
    """The roster is JSON {department: OpenSSH ECDSA public key}; its signature is the run's own."""
    from quorumfl.aggregation.secagg.identity import Roster
    from quorumfl.errors import SecureAggregationError

    try:
        Roster.from_json(text)
    except SecureAggregationError as exc:
        return [f"roster: {exc}; it is written by the admin's 'quorumfl runs start' from the registered node keys"]
    return []


@dataclass(frozen=True)
class RunConfig:
    strategy: StrategyName
    proximal_mu: float
    num_rounds: int
    dataset: str
    data_dir: str
    model: str
    local_epochs: int
    batch_size: int
    learning_rate: float
    fraction_train: float
    min_nodes: int
    round_timeout: float
    train_retries: int
    node_wait_timeout: float
    seed: int
    state_url: str
    model_dir: str
    start_from: StartFrom
    secure_aggregation: SecureMode
    secagg_threshold: float
    secagg_clip: float
    secagg_max_weight: float
    secagg_modulus_bits: int
    secagg_epoch_rounds: int
    secagg_stage_timeout: float
    secagg_unmask_spare: int
    ckks_poly_degree: int
    ckks_max_decryptions: int
    clusters: int
    ifca_merge_distance: float
    ifca_reseed_noise: float
    personal_layers: str
    ditto_lambda: float
    secagg_min_group: int
    secagg_colluding_fraction: float
    secagg_dropout_fraction: float
    clip_norm: float
    warmup_steps: int
    lr_reference_batch: int
    compression: Compression
    compression_fraction: float
    compression_sync_every: int
    compression_warmup_rounds: int
    dp: DpMode
    dp_epsilon: float
    dp_noise_multiplier: float
    dp_clip: float
    dp_delta: float
    selector: str
    selection_epochs: tuple[int, ...]
    selection_key: str
    round_deadline: float
    over_selection: float
    max_reply_mb: float
    resume_run: int
    node_state_key: str
    roster: str

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        problems: list[str] = []
        for key in sorted(set(values) - set(DEFAULTS)):
            close = difflib.get_close_matches(key, list(DEFAULTS), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "the README's run-config table lists every key"
            problems.append(f"unknown key '{key}': {hint}")
        merged = {**DEFAULTS, **{k: v for k, v in values.items() if k in DEFAULTS}}

        def number(key: str, kind: type, *, low: float, high: float | None = None, open_low: bool = False) -> Any:
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{key} must be a number, got {value!r}")
                return DEFAULTS[key]
            if kind is int and not float(value).is_integer():
                problems.append(f"{key} must be a whole number, got {value!r}")
                return DEFAULTS[key]
            ok = value > low if open_low else value >= low
            if not ok or (high is not None and value > high):
                bound = f"> {low}" if open_low else f">= {low}"
                rng = f"{bound}" + (f" and <= {high}" if high is not None else "")
                problems.append(f"{key} must be {rng}, got {value!r}")
                return DEFAULTS[key]
            return kind(value)

        def choice(key: str, enum: type[StrEnum]) -> Any:
            value = merged[key]
            try:
                return enum(value)
            except ValueError:
                problems.append(f"{key} must be one of {[e.value for e in enum]}, got {value!r}")
                return enum(DEFAULTS[key])

        def text(key: str) -> str:
            value = merged[key]
            if not isinstance(value, str):
                problems.append(f"{key} must be a string, got {value!r}")
                return str(DEFAULTS[key])
            return value

        def epoch_list() -> tuple[int, ...]:
            value = text("selection-epochs").replace(" ", "")
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

        from quorumfl.core.data.datasets import DATASETS
        from quorumfl.core.models import MODELS

        dataset = text("dataset")
        if dataset not in DATASETS:
            problems.append(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
        model = text("model")
        if model not in MODELS:
            problems.append(f"model must be one of {sorted(MODELS)}, got {model!r}")
        config = cls(
            strategy=choice("strategy", StrategyName),
            proximal_mu=number("proximal-mu", float, low=0.0),
            num_rounds=number("num-rounds", int, low=1, high=10_000),
            dataset=dataset,
            data_dir=text("data-dir"),
            model=model,
            local_epochs=number("local-epochs", int, low=1, high=1000),
            batch_size=number("batch-size", int, low=1),
            learning_rate=number("learning-rate", float, low=0.0, open_low=True),
            fraction_train=number("fraction-train", float, low=0.0, high=1.0, open_low=True),
            min_nodes=number("min-nodes", int, low=1),
            round_timeout=number("round-timeout", float, low=0.0, open_low=True),
            train_retries=number("train-retries", int, low=0, high=10),
            node_wait_timeout=number("node-wait-timeout", float, low=0.0, open_low=True),
            seed=number("seed", int, low=0),
            state_url=text("state-url"),
            model_dir=text("model-dir"),
            start_from=choice("start-from", StartFrom),
            secure_aggregation=choice("secure-aggregation", SecureMode),
            secagg_threshold=number("secagg-threshold", float, low=0.5, open_low=True),
            secagg_clip=number("secagg-clip", float, low=0.0, open_low=True),
            secagg_max_weight=number("secagg-max-weight", float, low=0.0, open_low=True),
            secagg_modulus_bits=number("secagg-modulus-bits", int, low=32, high=64),
            secagg_epoch_rounds=number("secagg-epoch-rounds", int, low=1, high=10_000),
            secagg_stage_timeout=number("secagg-stage-timeout", float, low=0.0, open_low=True),
            secagg_unmask_spare=number("secagg-unmask-spare", int, low=0, high=10_000),
            ckks_poly_degree=number("ckks-poly-degree", int, low=8192, high=32768),
            ckks_max_decryptions=number("ckks-max-decryptions", int, low=1, high=1_000_000),
            clusters=number("clusters", int, low=1, high=64),
            ifca_merge_distance=number("ifca-merge-distance", float, low=0.0),
            ifca_reseed_noise=number("ifca-reseed-noise", float, low=0.0),
            personal_layers=text("personal-layers"),
            ditto_lambda=number("ditto-lambda", float, low=0.0),
            secagg_min_group=number("secagg-min-group", int, low=0, high=10_000),
            secagg_colluding_fraction=number("secagg-colluding-fraction", float, low=0.0, high=0.49),
            secagg_dropout_fraction=number("secagg-dropout-fraction", float, low=0.0, high=0.49),
            clip_norm=number("clip-norm", float, low=0.0),
            warmup_steps=number("warmup-steps", int, low=0),
            lr_reference_batch=number("lr-reference-batch", int, low=0),
            compression=choice("compression", Compression),
            compression_fraction=number("compression-fraction", float, low=0.0, high=1.0, open_low=True),
            compression_sync_every=number("compression-sync-every", int, low=0),
            compression_warmup_rounds=number("compression-warmup-rounds", int, low=0),
            dp=choice("dp", DpMode),
            dp_epsilon=number("dp-epsilon", float, low=0.0),
            dp_noise_multiplier=number("dp-noise-multiplier", float, low=0.0),
            dp_clip=number("dp-clip", float, low=0.0, open_low=True),
            dp_delta=number("dp-delta", float, low=0.0, high=0.1, open_low=True),
            selector=text("selector"),
            selection_epochs=epoch_list(),
            selection_key=text("selection-key"),
            round_deadline=number("round-deadline", float, low=0.0),
            over_selection=number("over-selection", float, low=0.0, high=10.0),
            max_reply_mb=number("max-reply-mb", float, low=0.0),
            resume_run=number("resume-run", int, low=0),
            node_state_key=text("node-state-key"),
            roster=text("roster"),
        )
        if config.roster:
            problems.extend(_roster_problems(config.roster))
        if config.node_state_key and not (config.node_state_key.isdigit() and len(config.node_state_key) <= 20):
            problems.append(f"node-state-key must be a Flower run id (digits), got {config.node_state_key!r}")
        if config.selector not in SELECTORS:
            problems.append(f"selector must be one of {list(SELECTORS)}, got {config.selector!r}")
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
        if config.strategy is StrategyName.IFCA and config.secure_aggregation is SecureMode.CKKS and config.clusters > 1:
            problems.append("strategy ifca with secure-aggregation ckks is not supported yet; use masking "
                            "(sums per cluster) or clusters = 1")
        if config.secure_aggregation is SecureMode.MASKING and config.compression not in (Compression.NONE,
                                                                                          Compression.RANDK):
            problems.append(f"compression {config.compression.value} with secure-aggregation masking is not possible: "
                            "the server only sees the sum, so every node must send the same coordinates; use "
                            "compression = 'randk' (or 'none')")
        if config.secure_aggregation is SecureMode.CKKS and config.compression is not Compression.NONE:
            problems.append(f"compression {config.compression.value} with secure-aggregation ckks is not supported "
                            "yet; use compression = 'none'")
        if config.dp is not DpMode.NONE and (config.dp_epsilon > 0) == (config.dp_noise_multiplier > 0):
            problems.append(f"dp '{config.dp.value}' needs exactly one of dp-epsilon (the run's target) and "
                            "dp-noise-multiplier; set the other to 0")
        if config.dp is DpMode.DISTRIBUTED and config.secure_aggregation is not SecureMode.MASKING:
            problems.append("dp 'distributed' adds each node's share of the noise, which only protects an update "
                            "inside a masked sum; set secure-aggregation = 'masking' (or use dp = 'local')")
        if config.compression_warmup_rounds and config.compression is not Compression.TOPK:
            problems.append(f"compression-warmup-rounds applies to compression = 'topk' only (got "
                            f"'{config.compression.value}'); set it to 0")
        if config.dp is DpMode.DISTRIBUTED and config.compression is not Compression.NONE:
            problems.append("dp 'distributed' with compression is not supported; set compression = 'none'")
        if problems:
            raise ConfigError(problems)
        return config

    def resolved(self) -> dict[str, Any]:
        """Kebab-case mapping of every setting, as stored with the run."""
        values = {k.replace("_", "-"): (v.value if isinstance(v, StrEnum) else v) for k, v in asdict(self).items()}
        values["selection-epochs"] = ",".join(str(e) for e in self.selection_epochs)
        return values

    def ckks_params(self) -> CkksParams:
        """The threshold-CKKS parameter set: N from the config, a (60, 60, 60)-bit chain, Δ = 2^100."""
        return CkksParams(poly_degree=self.ckks_poly_degree)

    def epoch_choices(self) -> tuple[int, ...]:
        """The local epochs a selector may give a node: ``selection-epochs``, or just ``local-epochs``."""
        return self.selection_epochs or (self.local_epochs,)

    def resolved_selection_key(self) -> str:
        """Where the selector's state is kept: ``selection-key``, or selector, dataset and model, so a
        restarted server (a new run of the same federation) continues with what was learned."""
        return self.selection_key or f"{self.selector}:{self.dataset}:{self.model}"

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


MAX_CONFIG_BYTES = 2**20


def load_run_config_file(path: Path) -> dict[str, Any]:
    """Read a run-config TOML file (UTF-8, at most 1 MiB): run keys at top level or under ``[run]``."""
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
    values = data.get("run", data)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [run] must be a table of run-config keys")
    RunConfig.from_mapping(values)  # report every problem before anything is submitted
    return values
