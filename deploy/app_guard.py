"""Flower's ``flwr-clientapp``, with the federation admin's signature checked before the app loads.

A department node runs whatever ClientApp the run's app bundle (FAB) names, with the run's config,
and the SuperLink hands out runs for anyone who can start them there. So the node checks, in the
ClientApp process, before Flower installs or imports anything from the bundle:

- the bundle carries the admin's Ed25519 signature over every one of its files
  (``quorumfl.privacy.admin.verify_app``), and
- the run config Flower hands the app equals the config inside the signed bundle (no override
  sent beside it: ``secure-aggregation = none`` cannot be slipped in), and
- the signed run is fresh (``privacy.served_runs``, in the node's state directory): its nonce was
  never served as another Flower run, it is not past its expiry when first served, and its roster
  is not older than one this node has seen.

Otherwise the task fails with the reason (the server sees it as the node's error reply) and no code
of the bundle runs. Flower 1.42 has FAB verification of its own (``--trusted-entities``), but its
SuperLink keeps signatures only for apps from Flower's hub, never for a bundle sent with
``StartRun``; this hook is the smallest equivalent: it wraps Flower's ``pull_task_input`` in this
process and then runs Flower's own ``flwr-clientapp`` unchanged.

Started by the launch gate (``launch_gate.py``) when ``QUORUMFL_ADMIN_KEYS`` names the admin's
public key file.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quorumfl.client.personal_store import node_state_dir
from quorumfl.deploy.launch_gate import ADMIN_KEYS_ENV, write_gate
from quorumfl.errors import CredentialError
from quorumfl.privacy.served_runs import ServedRuns, SignedRun

__all__ = ["ADMIN_KEYS_ENV", "app_guard_env", "check_run", "main"]


def app_guard_env(admin_keys: Path, directory: Path, *, path: str) -> dict[str, str]:
    """Environment for a SuperNode whose ClientApps run only admin-signed apps: the launch gate
    (written to ``directory/bin``) first on ``path``, and the admin key file it checks against."""
    if not admin_keys.is_file():
        raise CredentialError(f"no admin public key at {admin_keys}; copy the federation's admin.pub there "
                              "(the admin makes it with 'quorumfl certs init' or 'quorumfl certs admin-key') "
                              "or pass --admin-key")
    gate_dir = write_gate(directory / "bin")
    return {ADMIN_KEYS_ENV: str(admin_keys.resolve()), "PATH": os.pathsep.join([str(gate_dir), path])}


def check_run(fab: bytes, run_config: Mapping[str, Any], admin_keys: bytes, *, source: str = ADMIN_KEYS_ENV,
              served: ServedRuns | None = None, run_id: int = 0, now: float | None = None) -> str:
    """The signing key's id when ``fab`` is signed by an admin key and ``run_config`` is the signed
    one, and (with ``served``, the node's ledger) when the signed run is fresh: never served as
    another Flower run than ``run_id``, not expired, its roster not older than one seen
    (``privacy.served_runs``); raises ``CredentialError`` with the reason otherwise."""
    import tomllib

    from flwr.common.config import flatten_dict

    from quorumfl.privacy.admin import load_admin_publics, verify_app

    signature = verify_app(fab, load_admin_publics(admin_keys, source=source))
    try:
        manifest = tomllib.loads(signature.files["pyproject.toml"].decode())
        signed = flatten_dict(manifest["tool"]["flwr"]["app"].get("config", {}))
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise CredentialError(f"the signed app bundle has no readable pyproject.toml ({exc})") from exc
    changed = sorted(k for k in set(signed) | set(run_config) if signed.get(k) != run_config.get(k))
    if changed:
        raise CredentialError(f"run config differs from the one the admin signed ({', '.join(changed[:8])}); "
                              "the run is refused")
    if served is not None:
        served.admit(SignedRun(signed), run_id=run_id, now=time.time() if now is None else now)
    return signature.key


def main() -> None:
    """Run Flower's ``flwr-clientapp`` with the signature check in front of the app's loading."""
    keys_path = os.environ.get(ADMIN_KEYS_ENV, "")
    try:
        admin_keys = Path(keys_path).read_bytes()
    except OSError as exc:
        print(f"quorumfl app guard: cannot read the admin key file {ADMIN_KEYS_ENV}={keys_path!r} "
              f"({exc.strerror}); refusing to run any app", file=sys.stderr)
        sys.exit(78)
    import importlib

    from flwr.supernode.cli import flwr_clientapp

    from quorumfl.protocol.pull_backoff import shorten_pull_backoff
    from quorumfl.protocol.reply_push import retry_reply_push

    shorten_pull_backoff()
    retry_reply_push()
    runner: Any = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    pull, install = runner.pull_task_input, runner.install_from_fab
    refusal: list[CredentialError] = []

    def pull_checked(client: Any) -> Any:
        message, context, run, fab = pull(client)
        try:
            served = ServedRuns(node_state_dir(context.node_config, int(context.node_id)))
            check_run(fab.content, context.run_config, admin_keys, source=keys_path, served=served,
                      run_id=int(context.run_id))
        except CredentialError as exc:  # raised at installation, once Flower holds the message to answer
            refusal.append(exc)
        return message, context, run, fab

    def install_checked(*args: Any, **kwargs: Any) -> Any:
        if refusal:
            raise refusal[0]
        return install(*args, **kwargs)

    runner.pull_task_input = pull_checked
    runner.install_from_fab = install_checked
    flwr_clientapp()


if __name__ == "__main__":
    main()
