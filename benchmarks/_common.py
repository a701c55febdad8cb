"""Helpers shared by the benchmark scripts: peak RSS, JSON-as-last-line output, a small table."""

from __future__ import annotations

import json
import resource
from typing import Any


def peak_rss_mb(*, children: bool = False) -> float:
    """Peak resident set size of this process (or of its waited-for children), in MiB."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux reports KiB


def report(figures: dict[str, Any], *, as_json: bool) -> None:
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    if as_json:
        print(json.dumps(figures))
