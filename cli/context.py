"""Options shared by every command (home, database, debug) and the objects built from them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # imported where used: a command loads only what it needs (startup time)
    from sqlalchemy import Engine

    from quorumfl.deploy.certs import Credentials
    from quorumfl.deploy.control import Control
    from quorumfl.server.state.repository import Repository

__all__ = ["DEFAULT_SUPERLINK", "INSECURE_WARNING", "Settings", "settings"]

INSECURE_WARNING = (
    "[yellow]warning: --insecure: no TLS and no node authentication. Traffic to and from the SuperLink "
    "(model updates, run config) is unencrypted and any process that reaches its port can join as a "
    "node or control runs. Use this only on a trusted, isolated network.[/yellow]"
)

DEFAULT_SUPERLINK = os.environ.get("QUORUMFL_SUPERLINK", "127.0.0.1:9093")


@dataclass
class Settings:
    home: Path
    db_url: str
    debug: bool = False

    def reader(self) -> Engine:
        """The state DB for a Core read (``runs list``): checked, nothing created, no ORM imported."""
        from quorumfl.server.state.database import reader

        return reader(self.db_url)

    def repository(self, *, migrate: bool = False) -> Repository:
        from quorumfl.server.state.database import connect
        from quorumfl.server.state.repository import Repository

        return Repository(connect(self.db_url, migrate=migrate))

    @property
    def credentials(self) -> Credentials:
        """The federation's credentials folder (``quorumfl certs init`` makes it)."""
        from quorumfl.deploy.certs import Credentials

        return Credentials(self.home / "certs")

    def control(self, superlink: str, *, insecure: bool = False, ca_cert: Path | None = None,
                admin_key: Path | None = None) -> Control:
        """A Control API client: TLS verified against the federation CA and every call signed with the
        admin key (default HOME/certs/admin.key), unless ``insecure``."""
        from quorumfl.deploy.certs import Credentials, roster_json
        from quorumfl.deploy.control import Control

        if insecure:
            from quorumfl.cli.output import err_console

            err_console.print(INSECURE_WARNING)
            return Control(superlink)
        ca = ca_cert or self.credentials.ca_cert
        if not ca.exists():
            from quorumfl.errors import CredentialError

            raise CredentialError(f"no CA certificate at {ca} to verify the SuperLink; run 'quorumfl certs init' "
                                  "(admin), copy the federation's ca.crt there or pass --ca-cert, or pass "
                                  "--insecure for a SuperLink started with --insecure")
        admin = admin_key or self.credentials.admin_key
        if not admin.exists():
            from quorumfl.errors import CredentialError

            raise CredentialError(f"no admin key at {admin}: the SuperLink obeys only calls signed by the federation "
                                  "admin; run this on the admin's machine, or make the key with "
                                  "'quorumfl certs admin-key' (then restart 'quorumfl server start')")
        creds = Credentials(admin.parent)
        return Control(superlink, insecure=False, root_certificates=str(ca), admin_key=admin,
                       roster=lambda: roster_json(creds))


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    if isinstance(obj, Settings):
        return obj
    from quorumfl.core.files import default_home
    from quorumfl.server.state.database import default_url

    home = default_home()
    return Settings(home=home, db_url=default_url(home))
