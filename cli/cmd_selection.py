"""``quorumfl selection …``: what the client selector chose, how it was rewarded, and its kept state."""

from __future__ import annotations

from typing import Annotated

import typer

from quorumfl.cli.context import settings
from quorumfl.cli.output import Format, console, print_json, table
from quorumfl.server.services import selection_view

selection_app = typer.Typer(help="Client selection: choices, rewards and the selector's learned state.",
                            no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """The reward curve in one line of block characters (lowest to highest)."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(BARS[min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


@selection_app.command("show")
def show(
    ctx: typer.Context,
    run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Selection counts and outcomes per node, the reward per round and which policy was active."""
    view = selection_view(settings(ctx).repository(), run)
    if fmt is Format.JSON:
        print_json(view)
        return
    policies = ", ".join(f"{name} {count} round(s)" for name, count in view["policies"].items()) or "no rounds yet"
    kept = f"state key {view['selection_key']}" if view["selection_key"] else "no state kept"
    console.print(f"[bold]run {view['run']}[/bold]: selector {view['selector']} ({kept}), "
                  f"deadline {view['round_deadline'] or 'none'}, over-selection {view['over_selection']}; {policies}",
                  soft_wrap=True)
    console.print(table("Nodes", view["nodes"], ["node_id", "department", "selected", "mean_epochs", "ok", "late",
                                                 "failed"]))
    console.print(table("Rounds", view["rounds"], ["round", "policy", "reward", "agent_avg", "heuristic_avg",
                                                   "chosen", "late", "failed", "seconds"]))
    console.print(f"reward curve: {sparkline([r['reward'] for r in view['rounds']])}", soft_wrap=True)


@selection_app.command("list")
def list_states(ctx: typer.Context, fmt: FormatOpt = Format.TABLE) -> None:
    """Kept selector states: key, kind, rounds learned from, last update."""
    rows = [{"key": r.key, "kind": r.kind, "rounds": r.rounds, "updated_at": r.updated_at.isoformat()}
            for r in settings(ctx).repository().selector_states()]
    if fmt is Format.JSON:
        print_json(rows)
        return
    console.print(table("Selector states", rows, ["key", "kind", "rounds", "updated_at"]))


@selection_app.command("reset")
def reset(ctx: typer.Context, key: Annotated[str, typer.Argument(help="Selector state key ('selection list').")]) -> None:
    """Forget a selector's learned state: the next run under KEY starts learning afresh."""
    settings(ctx).repository().delete_selector_state(key)
    console.print(f"selector state {key!r} deleted; the next run with it starts afresh")
