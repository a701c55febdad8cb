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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from quorumfl.errors import PrivacyBudgetError, SecureAggregationError
from quorumfl.protocol.wire import TrainConfig

__all__ = ["check_train_request"]


@functools.cache
def _distributed_sigma(epsilon: float, delta: float, fraction: float, rounds: int) -> float:
    from quorumfl.privacy.accounting import noise_for_target

    return noise_for_target(epsilon, delta, fraction, rounds)


def _number(run: Mapping[str, object], key: str) -> float | None:
    value = run.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


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
