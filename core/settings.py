"""Declared settings: each setting is one dataclass field whose declaration (``key``) says its
default, meaning, range and where it applies; parsing with every problem reported at once, the
defaults, stored values and a Markdown table are derived from the declarations.

Written here rather than taken from a settings library because the same declaration must also
produce Flower's run-config defaults and the run-config reference page's table, and report all problems of a config in
one ``ConfigError`` naming each key; the run config (``server/config.py``) is its user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, get_type_hints

__all__ = ["Key", "declared", "defaults", "key", "markdown_table", "read", "setting"]


@dataclass(frozen=True)
class Key:
    """What a setting is, said once: its default, what it means, its range, where it applies.

    The setting's name is its field's in kebab case; its type is the field's annotation (``int``,
    ``float``, ``str``, a ``StrEnum``)."""

    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False  # the low bound itself is not allowed
    choices: tuple[str, ...] = ()  # a ``str`` key's allowed values (a StrEnum's are its members)
    applies: str = "all"  # which strategies, modes or features read it
    node: bool = False  # the node's train config carries it as is (a ``TrainConfig`` field of that name)
    parse: Callable[[str, list[str]], Any] | None = None  # a ``str`` setting read into another type
    show: Callable[[Any], Any] | None = None  # the field's value back as the setting (for ``parse``)


def key(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field declaring one setting (see ``Key``)."""
    declaration = Key(default=default, help=help, **spec)
    return field(default=default, metadata={"key": declaration})


def declared(cls: type) -> dict[str, tuple[str, Any, Key]]:
    """Every setting of a dataclass of ``key`` fields: kebab-case name → (field name, type, declaration)."""
    hints = get_type_hints(cls)
    return {f.name.replace("_", "-"): (f.name, hints[f.name], f.metadata["key"]) for f in dataclasses.fields(cls)}


def defaults(cls: type) -> dict[str, Any]:
    """Every setting's default as a setting value."""
    return {name: setting(spec, spec.default) for name, (_, _, spec) in declared(cls).items()}


def setting(spec: Key, value: Any) -> Any:
    """A field's value as the setting's value (what a config file, Flower's config and a stored run hold)."""
    if spec.show is not None:
        return spec.show(value)
    return value.value if isinstance(value, StrEnum) else value


def read(name: str, kind: Any, spec: Key, value: Any, problems: list[str]) -> Any:
    """One key's value checked against its declaration; on a problem, noted, the default."""
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        try:
            return kind(value)
        except ValueError:
            problems.append(f"{name} must be one of {[e.value for e in kind]}, got {value!r}")
            return spec.default
    if kind is str or spec.parse is not None:
        if not isinstance(value, str):
            problems.append(f"{name} must be a string, got {value!r}")
            return spec.default
        if spec.choices and value not in spec.choices:
            problems.append(f"{name} must be one of {list(spec.choices)}, got {value!r}")
            return spec.default
        return spec.parse(value, problems) if spec.parse is not None else value
    if kind is bool:
        if not isinstance(value, bool):
            problems.append(f"{name} must be true or false, got {value!r}")
            return spec.default
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problems.append(f"{name} must be a number, got {value!r}")
        return spec.default
    if kind is int and not float(value).is_integer():
        problems.append(f"{name} must be a whole number, got {value!r}")
        return spec.default
    low, high = spec.low, spec.high
    too_low = low is not None and (value <= low if spec.open_low else value < low)
    if too_low or (high is not None and value > high):
        bounds = [f"{'>' if spec.open_low else '>='} {low}"] if low is not None else []
        bounds += [f"<= {high}"] if high is not None else []
        problems.append(f"{name} must be {' and '.join(bounds)}, got {value!r}")
        return spec.default
    return kind(value)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`" if value != "" else '`""`'


def markdown_table(declared: Mapping[str, tuple[str, Any, Key]]) -> str:
    """A Markdown table of declared settings (``declared``'s result), one row each."""
    rows = ["| key | default | applies to | meaning |", "|---|---|---|---|"]
    for name, (_, _, spec) in declared.items():
        rows.append(f"| `{name}` | {_shown(setting(spec, spec.default))} | {spec.applies} | {spec.help} |")
    return "\n".join(rows) + "\n"
