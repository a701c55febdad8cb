"""Options shared by every command (home, database, debug) and the objects built from them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import typer

from ..state.database import connect, default_home, default_url
from ..state.repository import Repository

__all__ = ["DEFAULT_SUPERLINK", "Settings", "settings"]

DEFAULT_SUPERLINK = os.environ.get("QUORUMFL_SUPERLINK", "127.0.0.1:9093")


@dataclass
class Settings:
    home: Path
    db_url: str
    debug: bool = False

    def repository(self, *, migrate: bool = False) -> Repository:
        return Repository(connect(self.db_url, migrate=migrate))


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    if isinstance(obj, Settings):
        return obj
    home = default_home()
    return Settings(home=home, db_url=default_url(home))
