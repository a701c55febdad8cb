"""``quorumfl keys …``: threshold-CKKS key ceremonies and the decryption audit trail of a run."""

from __future__ import annotations

from typing import Annotated

import typer

from quorumfl.cli.context import settings
from quorumfl.cli.output import Format, console, print_json, table
from quorumfl.server.services import keys_view

keys_app = typer.Typer(help="Threshold-CKKS keys: ceremonies and who decrypted what.", no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
RunRef = Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")]


@keys_app.command("ceremony")
def ceremony(ctx: typer.Context, run: RunRef) -> None:
    """Ask a running ckks run for a fresh key ceremony across its connected nodes before its next round."""
    record = settings(ctx).repository().request_ceremony(run)
    console.print(f"key ceremony {record.id} requested for run {record.run_id}; it runs before the next round")


@keys_app.command("status")
def status(ctx: typer.Context, run: RunRef, fmt: FormatOpt = Format.TABLE) -> None:
    """The run's key ceremonies (t of n, holders) and every threshold decryption (round, decryptors)."""
    view = keys_view(settings(ctx).repository(), run)
    if fmt is Format.JSON:
        print_json(view)
        return
    ceremonies = [{**c, "holders": ", ".join(c["holders"])} for c in view["ceremonies"]]
    console.print(table(f"Key ceremonies of run {view['run']}", ceremonies,
                        ["ceremony", "status", "key_id", "threshold", "holders", "finished_at", "error"]))
    decryptions = [{**d, "decryptors": ", ".join(d["decryptors"])} for d in view["decryptions"]]
    console.print(table("Threshold decryptions", decryptions,
                        ["round", "status", "key_id", "contributors", "decryptors", "error"]))
