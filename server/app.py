"""The QuorumFL ServerApp (Flower Message API): wiring from Flower's context to the federation loop.

The state DB comes from run config ``state-url``, else ``$QUORUMFL_DB_URL`` (set by
``quorumfl server start``), else the default SQLite file; it is migrated on start.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from quorumfl.protocol.pull_backoff import shorten_pull_backoff
from quorumfl.server.board import RoundHook, run_observed
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.rounds import Federation
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

__all__ = ["app", "serve"]

log = logging.getLogger(__name__)
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    serve(grid, context)


def serve(grid: Grid, context: Context, *, on_round: RoundHook | None = None) -> None:
    """The ServerApp's work; ``on_round`` is called after each round, in the round loop (an
    in-process caller's hook: ``quorumfl tune`` prunes a simulated trial there)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    shorten_pull_backoff()  # replies' objects: retry after 0.05 s, not Flower's 1 s
    config = RunConfig.from_mapping(dict(context.run_config))
    repo = Repository(connect(config.resolved_state_url(), migrate=True))
    store = ModelStore(config.resolved_model_dir())
    federation = Federation(grid, config, repo, store, flower_run_id=int(context.run_id))
    run_id = run_observed(federation, on_round)
    log.info("run %s (Flower run %s) completed", run_id, context.run_id)
