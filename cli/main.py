"""The ``quorumfl`` admin command: wiring of the sub-commands and the error boundary.

Errors of the QuorumFL tree print as one red line and exit with the code documented in
``quorumfl.cli.errors``; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import click
import typer
from rich.markup import escape
from typer.core import TyperGroup

from quorumfl.cli.context import Settings
from quorumfl.cli.errors import exit_code
from quorumfl.cli.output import err_console
from quorumfl.deploy.signals import terminate_on_signals
from quorumfl.errors import QuorumError

__all__ = ["COMMANDS", "app", "load_command", "main"]


def _models_app() -> typer.Typer:
    from quorumfl.cli.cmd_edge import promote
    from quorumfl.cli.cmd_state import models_app

    if "promote" not in {c.name for c in models_app.registered_commands}:
        models_app.command("promote")(promote)
    return models_app


def _simulate_app() -> typer.Typer:
    from quorumfl.cli.cmd_simulate import simulate_command

    single = typer.Typer()
    single.command("simulate")(simulate_command)
    return single


def _demo_app() -> typer.Typer:
    from quorumfl.cli.cmd_federation import demo

    single = typer.Typer()
    single.command("demo")(demo)
    return single


# Every top-level command: where it lives and the help line the root's --help shows. A command's
# module (and Flower, torch, cryptography... that it needs) is imported only when that command runs,
# so `quorumfl --help` and the read-only commands start in well under a second.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("", "Run a real local federation: SuperLink + one SuperNode per department on 127.0.0.1."),
    "simulate": ("", "Rehearse a run config on N virtual departments (Flower's simulation engine)."),
    "server": ("cmd_federation:server_app", "The coordinating server (Flower SuperLink + QuorumFL state)."),
    "node": ("cmd_federation:node_app", "A department node (Flower SuperNode running the QuorumFL ClientApp)."),
    "runs": ("cmd_runs:runs_app", "Start, follow, inspect and stop federated training runs."),
    "rounds": ("cmd_runs:rounds_app", "Inspect the rounds of a run."),
    "nodes": ("cmd_state:nodes_app", "Department nodes known to the server."),
    "models": ("", "Model versions produced by rounds."),
    "data": ("cmd_data:data_app", "Department data: import a department's file, propose and check schemas, split "
                                  "built-in datasets."),
    "db": ("cmd_federation:db_app", "The state database."),
    "keys": ("cmd_keys:keys_app", "Threshold-CKKS keys: ceremonies and who decrypted what."),
    "selection": ("cmd_selection:selection_app", "Client selection: choices, rewards and the selector's learned state."),
    "edge": ("cmd_edge:edge_app", "Edge devices: signed INT8 artifacts and model sync."),
    "certs": ("cmd_certs:certs_app", "TLS certificates and SuperNode keys of the federation."),
    "tune": ("cmd_tune:tune_app", "Federated hyper-parameter search: each trial a federated run (Optuna)."),
}
_BUILDERS: dict[str, Callable[[], typer.Typer]] = {"demo": _demo_app, "simulate": _simulate_app,
                                                    "models": _models_app}
_SINGLE = ("demo", "simulate")  # single commands, not groups


def load_command(name: str) -> click.Command:
    """The real click command of top-level command ``name`` (imports its module)."""
    where, help_line = COMMANDS[name]
    if name in _BUILDERS:
        sub = _BUILDERS[name]()
    else:
        module, attr = where.split(":")
        sub = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
    if name in _SINGLE:
        command = typer.main.get_command(sub)
    else:  # a group even when it has one sub-command (db upgrade)
        command = typer.main.get_group(sub)
        command.help = help_line
        _click_suggests(command)
    command.name = name
    _name_exit_codes(command)
    return command


def _name_exit_codes(command: click.Command) -> None:
    """Every command's --help ends by naming where its exit codes are documented."""
    command.epilog = command.epilog or EXIT_CODES_EPILOG
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _name_exit_codes(sub)


def _click_suggests(group: click.Group) -> None:
    """Click already says "Did you mean …" for an unknown command; Typer's own would say it twice."""
    if isinstance(group, TyperGroup):
        group.suggest_commands = False
        for command in group.commands.values():
            if isinstance(command, click.Group):
                _click_suggests(command)


class LazyGroup(TyperGroup):
    """The root group: placeholders (name and help line) for listing; the real command is loaded
    when it is invoked (``resolve_command``), so nothing a command does not need is imported."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.suggest_commands = False  # click's own "Did you mean" is enough
        for name, (_where, help_line) in COMMANDS.items():
            self.commands[name] = click.Command(name, help=help_line)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if name in COMMANDS:
            command = load_command(name)
            self.commands[name] = command  # later lookups (help of a sub-command) see the real one
        return name, command, rest


EXIT_CODES_EPILOG = "Exit codes: 0 ok, 2 usage, others per error kind (docs/reference/exit-codes.md)."

app = typer.Typer(
    cls=LazyGroup,
    help="QuorumFL: federated learning for municipal departments.",
    epilog=EXIT_CODES_EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


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
    from quorumfl.core.files import default_home
    from quorumfl.server.state.database import default_url

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
        # the message is text, never markup: a "[run]" or ":x:" in it is printed as written
        err_console.print(f"[red]error: {escape(str(exc))}[/red]", highlight=False, soft_wrap=True, emoji=False)
        sys.exit(exit_code(exc))
    except KeyboardInterrupt:
        _exit_interrupted()
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        sys.exit(130)
    except Exception as exc:  # click usage errors and anything unexpected
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if debug:
            err_console.print_exception()
        err_console.print(f"[red]unexpected error: {exc.__class__.__name__}: {escape(str(exc))} (run with --debug for the "
                          "traceback)[/red]", highlight=False, emoji=False)
        sys.exit(1)
