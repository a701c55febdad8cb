"""The CLI reference page (``docs/reference/cli.md``), generated from the Typer app itself.

Typer's own ``typer … utils docs`` stops at the top-level commands here, because ``quorumfl`` loads
each command's module only when it runs (``main.LazyGroup``); this walks the real click commands
(``main.load_command``) instead, so every sub-command, argument and option is listed with its help,
type and default exactly as ``--help`` has them. ``python -m quorumfl.cli.reference_docs --write``
rewrites the page from the repository root; a test fails while the page is out of date.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click
import typer

from quorumfl.cli.main import COMMANDS, app, load_command

__all__ = ["PAGE", "cli_reference", "walk"]

PAGE = Path("docs") / "reference" / "cli.md"

HEADER = """# CLI reference

<!-- generated from the Typer app by `python -m quorumfl.cli.reference_docs --write`; do not edit -->

Every command takes the global options of `quorumfl` before its name (`quorumfl --home DIR runs
list`). Errors print one line naming the input and the fix, and exit with a documented code:
[exit codes](exit-codes.md). Tables print for people; `--format json` prints the same data for
scripts where a command offers it.
"""


def walk(command: click.Command, path: list[str]) -> Iterator[tuple[list[str], click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name in command.list_commands(click.Context(command)):
            sub = command.get_command(click.Context(command), name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, [*path, name])


def _param(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        kind = "required" if param.required else "optional"
        text = _clean(getattr(param, "help", "") or "")
        return f"* `{param.human_readable_name}` (argument, {kind})" + (f": {text}" if text else "")
    assert isinstance(param, click.Option)
    names = " / ".join(", ".join(f"`{o}`" for o in opts) for opts in (param.opts, param.secondary_opts) if opts)
    kind = "" if param.is_flag else f" {param.type.name.upper()}"
    line = f"* {names}{kind}: {_clean(param.help or '')}"
    if param.required:
        line += " (required)"
    elif param.show_default is not False and _shown(param.default) and not param.is_flag:
        line += f" Default: `{param.default}`."
    return line


def _shown(default: object) -> bool:
    """Whether a default is worth printing: not unset, empty or a callable's."""
    return default is not None and not callable(default) and default not in ("", ()) and not isinstance(default, bool)


def _clean(text: str) -> str:
    return " ".join(text.replace("[default: ", "(default: ").split())


def _section(path: list[str], command: click.Command) -> list[str]:
    title = " ".join(path)
    lines = [f"{'#' * min(len(path) + 1, 4)} `{title}`", ""]
    if command.help:
        lines += [_clean(command.help.split("\b")[0]), ""]
    params = [p for p in command.params if p.name not in ("help", "install_completion", "show_completion")]
    usage = " ".join(command.collect_usage_pieces(click.Context(command)))
    lines += ["```", f"{title} {usage}".rstrip(), "```", ""]
    if params:
        lines += [_param(p) for p in params] + [""]
    return lines


def cli_reference() -> str:
    """The page's Markdown: the root, then each top-level command and its sub-commands in order."""
    root = typer.main.get_command(app)
    lines = [HEADER, *_section(["quorumfl"], root)]
    for name in COMMANDS:
        for path, command in walk(load_command(name), ["quorumfl", name]):
            lines += _section(path, command)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # python -m quorumfl.cli.reference_docs --write (from the repository root)
    if sys.argv[1:] != ["--write"]:
        print("usage: python -m quorumfl.cli.reference_docs --write  (run in the repository root)", file=sys.stderr)
        sys.exit(64)
    text = cli_reference()
    if not PAGE.exists() or PAGE.read_text() != text:
        PAGE.write_text(text)
        print(f"rewrote {PAGE.resolve()}")
