"""The ``quorumfl`` admin command: wiring of the sub-commands and the error boundary.

Errors of the QuorumFL tree print as one red line and exit with the code documented in
``quorumfl.server.cli.errors``; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from quorumfl.aggregation.errors import QuorumError

from ..processes import terminate_on_signals
from ..state.database import default_home, default_url
from .cmd_certs import certs_app
from .cmd_edge import edge_app, promote
from .cmd_federation import data_app, db_app, demo, node_app, server_app
from .cmd_keys import keys_app
from .cmd_runs import rounds_app, runs_app
from .cmd_selection import selection_app
from .cmd_state import models_app, nodes_app
from .context import Settings
from .errors import exit_code
from .output import err_console

__all__ = ["app", "main"]

app = typer.Typer(
    help="QuorumFL: federated learning for municipal departments.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("demo")(demo)
app.add_typer(server_app, name="server")
app.add_typer(node_app, name="node")
app.add_typer(runs_app, name="runs")
app.add_typer(rounds_app, name="rounds")
app.add_typer(nodes_app, name="nodes")
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(selection_app, name="selection")
app.add_typer(edge_app, name="edge")
app.add_typer(certs_app, name="certs")
models_app.command("promote")(promote)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"quorumfl {version('quorumfl')} (flwr {version('flwr')})")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    home: Annotated[Path | None, typer.Option(help="QuorumFL home (state DB, models, logs). Default $QUORUMFL_HOME or ~/.quorumfl.")] = None,
    db: Annotated[str | None, typer.Option(help="State DB SQLAlchemy URL. Default $QUORUMFL_DB_URL or HOME/quorumfl.db.")] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks and debug logs.")] = False,
    _version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                           callback=_print_version)] = False,
) -> None:
    resolved_home = (home or default_home()).expanduser().resolve()
    ctx.obj = Settings(home=resolved_home, db_url=db or default_url(resolved_home), debug=debug)
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _exit_interrupted() -> NoReturn:
    """Exit with status 130 after an interrupt (Ctrl-C or SIGTERM), once every child is stopped.

    ``os._exit`` rather than ``sys.exit``: when the KeyboardInterrupt had passed through code that the
    interpreter runs from a string (``exec``/``eval``, which dataclasses and SQLAlchemy use for
    generated code), CPython 3.11 run as ``python -m`` remembers it as unhandled and ends the process
    by SIGINT (status -2) whatever ``sys.exit`` asked for. The clean-up that matters (child
    processes, open files, the DB session) has already run while the interrupt unwound.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C must not cut the exit short
    err_console.print("[red]interrupted[/red]")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        with terminate_on_signals():  # SIGTERM unwinds like Ctrl-C, so child processes are stopped
            # Typer returns (not raises) the exit code of an interrupt or typer.Exit here.
            code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            if code == 130:
                _exit_interrupted()
            sys.exit(code)
    except QuorumError as exc:
        if debug:
            err_console.print_exception()
        err_console.print(f"[red]error: {exc}[/red]", highlight=False, soft_wrap=True)
        sys.exit(exit_code(exc))
    except KeyboardInterrupt:
        _exit_interrupted()
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        sys.exit(130)
    except Exception as exc:  # click usage errors and anything unexpected
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if debug:
            err_console.print_exception()
        err_console.print(f"[red]unexpected error: {exc.__class__.__name__}: {exc} (run with --debug for the traceback)[/red]")
        sys.exit(1)
