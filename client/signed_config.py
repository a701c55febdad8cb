"""A train request checked against the admin-signed run config before the node trains or sends anything.

The request's train config and its secure-aggregation records come from the ServerApp, i.e. from the
server. The run config comes from the admin: the launch gate (``deploy.app_guard``) has checked that
the run config Flower hands the app equals the one inside the signed bundle. An active server could
otherwise ask for a plaintext reply in a masked or encrypted run (and read one department's update),
or downgrade differential privacy (``dp = none``, a smaller noise multiplier, a larger clip). So a
node refuses a request that:

- is not masked although the signed run says ``secure-aggregation = masking``, or not encrypted
  although it says ``ckks``;
- names another ``dp`` mode, ``dp-clip``, ``dp-delta`` or ``dp-epsilon`` than the signed run;
- asks for less noise than the signed run implies: ``dp-noise-multiplier`` when the run sets one,
  else (distributed DP) the σ that the run's ε target gives over its rounds — the same accountant
  call the server makes (``privacy.accounting.noise_for_target``);
- in a FedPer run, names other personal layers or no personalisation (the personal layers would
  then leave the node);
- in a masked or CKKS round, names another ``update-norm-bound`` (a looser bound would let a broken
  department's update weigh more than the admin allowed).

A key the run config does not hold is not checked (an in-process test federation without a signed
bundle); a deployed run's signed config holds every key (the app's defaults are written into it).

``check_masking_params`` does the same for a masking epoch's announcement, and ``check_ceremony``
for a CKKS key ceremony's (t over the announced members but never below that over the whole roster
or the signed ``ckks-min-threshold``, nor the signed minimum group; no more members than the
roster; the parameter set the signed ring dimension gives): every parameter the
node's safety depends on (t over the announced cohort, the minimum group, the sparse graph's
fractions and complete-graph limit, the fixed-point clip and modulus, the slots) must be the one
the signed run config gives. A run with a roster (every deployed run) must hold each of those keys.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from quorumfl.aggregation.ckks.keys import Announcement
from quorumfl.aggregation.ckks.params import ceremony_threshold
from quorumfl.aggregation.secagg import MaskingParams, resolve_threshold
from quorumfl.aggregation.secagg.graph import COMPLETE_UP_TO
from quorumfl.errors import ConfigError, PrivacyBudgetError, SecureAggregationError
from quorumfl.protocol.wire import ROSTER_KEY, TrainConfig

__all__ = ["check_ceremony", "check_masking_params", "check_train_request", "signed_number"]


@functools.cache
def _distributed_sigma(epsilon: float, delta: float, fraction: float, rounds: int) -> float:
    from quorumfl.privacy.accounting import noise_for_target

    return noise_for_target(epsilon, delta, fraction, rounds)


def _number(run: Mapping[str, object], key: str) -> float | None:
    value = run.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def signed_number(run: Mapping[str, object], key: str, *, node: str) -> float | None:
    """The signed run config's number ``key``; None where an unsigned (roster-less) run leaves it out.
    A signed run (it has a roster) without the key, or with a non-number there, is refused."""
    value = _number(run, key)
    if value is None and (key in run or run.get(ROSTER_KEY)):
        raise SecureAggregationError(f"the admin-signed run config has no number for {key} ({run.get(key)!r}), so "
                                     "this node cannot check what the server announces; refusing", node=node)
    return value


def _signed_masking(run: Mapping[str, object], n: int, *, node: str) -> dict[str, float]:
    """What the signed run config fixes of a masking epoch over a cohort of ``n`` (only the keys it holds)."""
    expected: dict[str, float] = {"complete-up-to": COMPLETE_UP_TO}
    threshold = signed_number(run, "secagg-threshold", node=node)
    if threshold is not None:
        try:
            expected["threshold"] = resolve_threshold(threshold, n)
        except ConfigError as exc:
            raise SecureAggregationError(f"the signed secagg-threshold is unusable ({exc})", node=node) from exc
    for key, field in (("secagg-min-group", "min-group"), ("secagg-clip", "clip"),
                       ("secagg-modulus-bits", "modulus-bits"), ("secagg-colluding-fraction", "colluding-fraction"),
                       ("secagg-dropout-fraction", "dropout-fraction")):
        value = signed_number(run, key, node=node)
        if value is not None:
            expected[field] = value
    return expected


def check_masking_params(run: Mapping[str, object], params: MaskingParams, cohort: int, *, node: str) -> None:
    """Raise unless the announced masking ``params`` for a cohort of ``cohort`` nodes are those the
    signed run config ``run`` gives (module docstring), naming every parameter that differs."""
    announced = params.to_dict()
    wrong = [f"{key} {announced[key]:g} (signed: {value:g})"
             for key, value in _signed_masking(run, cohort, node=node).items() if float(announced[key]) != float(value)]
    most = [v for v in (signed_number(run, "secagg-epoch-rounds", node=node),
                        signed_number(run, "num-rounds", node=node)) if v is not None]
    if most and params.slots > min(most):  # a slot is one round: more would outlive the signed run
        wrong.append(f"slots {params.slots} (signed: at most {min(most):g})")
    wrong += _beyond_roster(run, cohort, node=node)
    if wrong:
        raise SecureAggregationError(f"the server announced {', '.join(wrong)} for this key epoch, which the "
                                     "admin-signed run config does not allow; refusing to take part", node=node)


def _roster_size(run: Mapping[str, object], *, node: str) -> int:
    """How many departments the signed roster lists (0 without a roster)."""
    roster = run.get(ROSTER_KEY)
    if not isinstance(roster, str) or not roster:
        return 0
    import json

    try:
        return len(json.loads(roster))
    except (ValueError, TypeError) as exc:
        raise SecureAggregationError(f"the signed roster is not JSON ({exc})", node=node) from exc


def _beyond_roster(run: Mapping[str, object], count: int, *, node: str) -> list[str]:
    """The problem when ``count`` nodes are more than the signed roster's departments (none without a roster)."""
    size = _roster_size(run, node=node)
    return [f"{count} nodes (the signed roster has {size} departments)"] if size and count > size else []


def check_ceremony(run: Mapping[str, object], announcement: Announcement, *, node: str) -> None:
    """Raise unless a CKKS key ceremony's members, t and parameters are those the signed run config
    ``run`` allows (module docstring), naming every one that differs."""
    from quorumfl.aggregation.ckks import CkksParams

    n, t = len(announcement.members), announcement.threshold
    wrong = _beyond_roster(run, n, node=node)
    signed = signed_number(run, "secagg-threshold", node=node)
    if signed is not None:
        roster = _roster_size(run, node=node)
        floor = int(signed_number(run, "ckks-min-threshold", node=node) or 0)
        try:
            expected = ceremony_threshold(signed, n, roster=roster, floor=floor)
        except ConfigError as exc:
            raise SecureAggregationError(f"the signed secagg-threshold is unusable ({exc})", node=node) from exc
        if t != expected:
            wrong.append(f"threshold {t} (signed: {expected} for {n} members of a {roster}-department roster)")
    min_group = signed_number(run, "secagg-min-group", node=node) or 0
    if t < min_group:
        wrong.append(f"threshold {t} (below the signed secagg-min-group {min_group:g})")
    degree = signed_number(run, "ckks-poly-degree", node=node)
    if degree is not None:
        try:
            fitted = CkksParams(poly_degree=int(degree)).fitted(threshold=t, contributors=n)
        except ConfigError as exc:
            raise SecureAggregationError(f"the signed ckks-poly-degree is unusable ({exc})", node=node) from exc
        if announcement.params != fitted:
            wrong.append(f"parameters {announcement.params.to_dict()} (signed: {fitted.to_dict()})")
    if wrong:
        raise SecureAggregationError(f"the server announced {', '.join(wrong)} for this key ceremony, which the "
                                     "admin-signed run config does not allow; refusing to take part", node=node)


def check_train_request(run: Mapping[str, object], config: TrainConfig, *, masked: bool, encrypted: bool,
                        node: str) -> None:
    """Raise unless the request fits the signed run config ``run`` (module docstring)."""
    mode = run.get("secure-aggregation")
    if mode == "masking" and not masked or mode == "ckks" and not encrypted:
        raise SecureAggregationError(f"the admin-signed run config sets secure-aggregation = {mode}, but this train "
                                     "request asks for an update that is not secured that way; the update is withheld",
                                     node=node)
    if run.get("strategy") == "fedper" and (config.personalisation != "fedper"
                                            or config.personal_layers != run.get("personal-layers")):
        raise SecureAggregationError(f"the admin-signed run is FedPer with personal layers "
                                     f"'{run.get('personal-layers')}', but this request asks for personalisation "
                                     f"'{config.personalisation}' with '{config.personal_layers}'; the personal layers "
                                     "stay on the node and nothing is sent", node=node)
    bound = _number(run, "update-norm-bound")
    if bound is not None and (masked or encrypted) and config.update_norm_bound != bound:
        raise SecureAggregationError(f"the train request asks for update-norm-bound {config.update_norm_bound:g}, the "
                                     f"admin-signed run config sets {bound:g}; the update is withheld", node=node)
    signed_dp = run.get("dp")
    if isinstance(signed_dp, str) and config.dp != signed_dp:
        raise PrivacyBudgetError(f"the train request asks for dp = '{config.dp}', the admin-signed run config sets "
                                 f"'{signed_dp}'; refusing to train")
    for key, asked in (("dp-clip", config.dp_clip), ("dp-delta", config.dp_delta), ("dp-epsilon", config.dp_epsilon)):
        signed = _number(run, key)
        if signed is not None and config.dp != "none" and asked != signed:
            raise PrivacyBudgetError(f"the train request asks for {key} = {asked:g}, the admin-signed run config "
                                     f"sets {signed:g}; refusing to train")
    if config.dp == "none":
        return
    sigma = _number(run, "dp-noise-multiplier") or 0.0
    if not sigma and config.dp == "distributed":
        epsilon, delta = _number(run, "dp-epsilon"), _number(run, "dp-delta")
        fraction, rounds = _number(run, "fraction-train"), _number(run, "num-rounds")
        if None not in (epsilon, delta, fraction, rounds):
            sigma = _distributed_sigma(epsilon, delta, fraction, int(rounds))  # type: ignore[arg-type]
    if sigma and not (math.isfinite(config.dp_noise_multiplier) and config.dp_noise_multiplier >= sigma * (1 - 1e-9)):
        raise PrivacyBudgetError(f"the train request asks for noise multiplier {config.dp_noise_multiplier:g}, below "
                                 f"the {sigma:g} the admin-signed run config implies; refusing to train")
